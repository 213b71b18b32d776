"""NeMo RL's grpo.invalid_tool_call_advantage and malformed_thinking_advantage: which turns are found
wrong (a tool call that cannot be run, <think> tags out of order), their tokens in the batch, and the
advantages that replace the estimator's there; through the real loop in tests/test_tool_task.py."""

from __future__ import annotations

import pytest
import torch

from novarl.config import load_config
from novarl.rollout.batch import build_train_batch, flagged_turns
from novarl.rollout.environment import EnvStep
from novarl.rollout.episodes import Episode, malformed_thinking
from novarl.rollout.tools import ToolEnvironment
from novarl.trainer.stages import AdvantageOverwrites, StepWork, build_stages
from novarl.types import Completion, Prompt

TOOLS = {"tools": ["tests.helpers.tools:add"], "reward": "exact_match"}


@pytest.mark.parametrize("text, malformed", [
    ("<think>a</think> 4", False), ("a</think> 4", False), ("4", False), ("<think>cut by the length limit", False),
    ("<think>a</think><think>b</think> 4", True), ("a</think> b</think>", True), ("</think> a <think>", True),
])
def test_thinking_is_malformed_when_a_tag_repeats_or_the_order_is_wrong(text, malformed):
    assert malformed_thinking(text) is malformed


def call(text: str) -> EnvStep:
    return ToolEnvironment(TOOLS).step([{"role": "user", "content": "q"}, {"role": "assistant", "content": text}], {})


def test_the_tool_environment_flags_the_calls_it_cannot_run():
    good = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    assert call(good).flags == frozenset()
    assert call('<tool_call>\n{"name": "add", "arguments": \n</tool_call>').flags == {"invalid_tool_call"}
    assert call('<tool_call>\n{"name": "sub", "arguments": {"a": 1}}\n</tool_call>').flags == {"invalid_tool_call"}
    assert call("the answer is 3").flags == frozenset()  # no call: the final answer


def completion(prompt: list[int], tokens: list[int], text: str = "", turns: int = 1, flagged=(),
               observed=()) -> Completion:
    return Completion(prompt=Prompt(text="p", token_ids=prompt, answer="a"), token_ids=tokens,
                      logprobs=[-0.5] * len(tokens), text=text, finish_reason="stop", policy_version=0, turns=turns,
                      flagged=tuple(flagged), observed=tuple(observed))


def test_an_episode_records_the_spans_of_its_flagged_turns():
    episode = Episode(Prompt(text="p", token_ids=[1], answer="a"), [], {})
    episode.took(completion([1], [5, 6, 7], "<think>x</think><think>y</think>"))
    episode.answered(EnvStep(reward=0.0, done=False, observation={"role": "tool", "content": "r"},
                             flags=frozenset({"invalid_tool_call"})), [9, 9])
    episode.took(completion([1], [8, 8], "3"))
    episode.answered(EnvStep(reward=1.0, done=True), None)
    assert episode.completion().flagged == ((0, 3, "malformed_thinking"), (0, 3, "invalid_tool_call"))
    assert episode.completion().observed == ((3, 5),)


def test_the_flagged_turns_tokens_get_the_configured_advantage():
    """Three samples: an episode whose first turn (tokens 0-2) made an invalid call, a one-turn completion
    with malformed thinking (read from its text), and a fine one; the invalid turn is malformed too, and
    the invalid-tool-call advantage wins there (NeMo RL's order)."""
    completions = [completion([1], [5, 6, 7, 9, 9, 8], "3", turns=2, observed=[(3, 5)],
                              flagged=[(0, 3, "malformed_thinking"), (0, 3, "invalid_tool_call")]),
                   completion([1, 2], [5, 6], "</think><think>"), completion([1], [4], "4")]
    batch = build_train_batch(completions, torch.tensor([0.5, 0.25, -1.0]))
    tokens, metrics = flagged_turns(completions, batch)
    assert metrics == {"num_assistant_messages": 4.0, "num_invalid_tool_calls": 1.0, "invalid_tool_call_rate": 0.25,
                       "num_malformed_thinking": 2.0, "malformed_thinking_rate": 0.5}
    work = StepWork(batch, rewards=torch.zeros(3), flagged=tokens)
    AdvantageOverwrites({"malformed_thinking": -2.0, "invalid_tool_call": -5.0})(work)
    rows = batch.to_rows(batch.advantages).tolist()
    assert rows[0] == [0.5, -5.0, -5.0, -5.0, 0.5, 0.5, 0.5]  # the prompt's token, the invalid turn, the rest
    assert rows[1][:4] == [0.25, 0.25, -2.0, -2.0] and rows[2][:2] == [-1.0, -1.0]


def test_the_keys_load_and_build_their_stage_and_are_said_where_nothing_calls_a_tool():
    from types import SimpleNamespace

    cfg = load_config({"grpo": {"invalid_tool_call_advantage": -5.0, "malformed_thinking_advantage": -5.0}})
    assert cfg.grpo.invalid_tool_call_advantage == -5.0 and cfg.grpo.malformed_thinking_advantage == -5.0
    assert any("'grpo.invalid_tool_call_advantage' = -5.0: this run's rollouts are single-turn" in w
               for w in cfg.load_warnings)
    roles = SimpleNamespace(policy=None, reference=None, critic=None)
    inputs = SimpleNamespace(batches=SimpleNamespace(optimizer_steps_per_step=1, global_batch_size=8))
    (stage,) = [s for s in build_stages(cfg, inputs, roles, loss_fn=None) if isinstance(s, AdvantageOverwrites)]
    assert list(stage.values.items()) == [("malformed_thinking", -5.0), ("invalid_tool_call", -5.0)]
