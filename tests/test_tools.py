"""Tools (issue 33): a user's functions as the model's tools -- schemas from signatures and docstrings,
Hermes/Qwen tool calls parsed, calls run concurrently under one deadline, every failure told to the
model and counted, the final answer scored; and a run whose environment is the tools."""

from __future__ import annotations

import time


from novarl.rollout.tools import BadCall, ToolCall, ToolEnvironment, parse_hermes, tool_schema
from tests.helpers import tools

CFG = {"tools": ["tests.helpers.tools:add", "tests.helpers.tools:wait", "tests.helpers.tools:boom"],
       "reward": "exact_match", "timeout_s": 0.6, "max_calls_per_turn": 3}


def call(name: str, **arguments) -> str:
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def turn(text: str) -> list[dict]:
    return [{"role": "user", "content": "2+3="}, {"role": "assistant", "content": text}]


def test_a_schema_comes_from_the_signature_and_docstring():
    schema = tool_schema(tools.add)
    assert schema == {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "required": ["a"],
                       "properties": {"a": {"type": "integer", "description": "the first"},
                                      "b": {"type": "integer", "description": "the second"}}}}}


def test_hermes_calls_are_parsed_and_malformed_ones_kept_as_such():
    text = (f"let me add {call('add', a=2, b=3)} and {call('wait', seconds=0)}"
            '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>'
            "<tool_call>{not json}</tool_call><tool_call>[1, 2]</tool_call>")
    calls = parse_hermes(text)
    assert calls[:3] == [ToolCall("add", {"a": 2, "b": 3}), ToolCall("wait", {"seconds": 0}), ToolCall("add", {"a": 1})]
    assert [type(c) for c in calls[3:]] == [BadCall, BadCall] and "not JSON" in calls[3].why
    assert parse_hermes("no calls here") == []


def test_calls_run_concurrently_and_every_failure_is_told_and_counted():
    env = ToolEnvironment(CFG)
    start = time.monotonic()
    step = env.step(turn(call("wait", seconds=0.4) + call("wait", seconds=0.4) + call("add", a=2, b=3)), {})
    assert time.monotonic() - start < 0.75  # the two waits overlapped
    assert (step.done, step.reward, step.observation["role"]) == (False, 0.0, "tool")
    assert step.observation["content"] == ("<tool_response>\nslept 0.4\n</tool_response>\n" * 2
                                           + "<tool_response>\n5\n</tool_response>\n")
    failing = env.step(turn(call("boom") + call("nope") + call("wait", seconds=2) + call("add", a=1)), {})
    content = failing.observation["content"]
    assert "RuntimeError: the tool broke" in content and "no tool named 'nope'" in content
    assert "did not answer within 0.6 s" in content and "at most 3 tool calls a turn" in content
    bad = env.step(turn("<tool_call>{oops</tool_call>" + call("add", c=1)), {})
    assert "malformed tool call" in bad.observation["content"] and "TypeError" in bad.observation["content"]
    assert env.take_metrics() == {"tool_calls": 9.0, "tool_errors": 5.0, "tool_timeouts": 1.0}
    assert env.take_metrics() == {"tool_calls": 0.0, "tool_errors": 0.0, "tool_timeouts": 0.0}


def test_a_turn_without_calls_is_the_scored_answer():
    env = ToolEnvironment(CFG)
    right, wrong = env.step(turn("5"), {"answer": "5"}), env.step(turn("6"), {"answer": "5"})
    assert (right.done, right.reward, wrong.reward) == (True, 1.0, 0.0)


def test_the_chat_template_lists_the_tools_in_chat_prompts():
    from novarl.cli import BUNDLED_RECIPE
    from novarl.config import load_config
    from novarl.data.arithmetic import Example
    from novarl.models.loading import load_tokenizer, resolve_model_path
    from novarl.trainer.setup import split_prompts

    template = "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
    cfg = load_config(BUNDLED_RECIPE, overrides=[f"policy.tokenizer.chat_template={template!r}",
                                                 "policy.max_seq_length=48"])
    tokenizer = load_tokenizer(resolve_model_path("tiny-arith"))
    example = Example(prompt=({"role": "user", "content": "12+34="},), answer="46")
    prompt, = split_prompts(cfg, tokenizer, "train", [example], tools=ToolEnvironment(CFG).tool_schemas)
    assert prompt.text == "[add][wait][boom]12+34="


def test_a_run_plays_tool_episodes(tmp_path):
    from novarl.cli import BUNDLED_RECIPE
    from novarl.config import load_config
    from novarl.logging.metrics import read_jsonl
    from novarl.trainer.api import GRPOTrainer

    cfg = load_config(BUNDLED_RECIPE, overrides=[
        "env.calc.actor_class_fqn=novarl.rollout.tools:ToolEnvironment",
        "env.calc.cfg={tools: ['tests.helpers.tools:add'], reward: exact_match}", "grpo.max_rollout_turns=2",
        "grpo.max_num_steps=2", "grpo.val_period=0", "grpo.val_at_start=false", "grpo.max_val_samples=8",
        "logger.progress_bar=false", "grpo.max_train_seconds=null", f"logger.log_dir={tmp_path}"])
    result = GRPOTrainer(cfg).train()
    steps = [r for r in read_jsonl(result.output_dir / "metrics.jsonl") if r["kind"] == "train"]
    # the tiny model writes no tool calls: every episode is its answer, scored by exact_match
    assert len(steps) == 2 and all(s["tool_calls"] == 0 and s["episode_turns_mean"] == 1.0 for s in steps)
    assert all(0.0 <= s["reward_mean"] <= 1.0 for s in steps)
