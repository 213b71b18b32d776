"""Reward domains (novarl/rewards/domains.py): several verifiers in one run, examples routed by
their domain column, tag (ROLL's tag_included) or dataset (NeMo RL's env_name); each step's prompts
drawn by domain (ROLL's domain_interleave_probs); ROLL's difficulty mask; ROLL's reward workers
read from its own config."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml

from novarl.config import load_config
from novarl.errors import ConfigError, UserError
from novarl.rewards.domains import DomainSampler, Routing, run_sampler, run_scorer
from novarl.rewards.ifeval import CHECKS, ifeval
from novarl.rewards.verifiers import crossthinkqa, repetition_penalty
from novarl.rollout.batch import build_train_batch
from novarl.rollout.collect import Rollouts
from novarl.types import Completion, Prompt

ROLL = Path(__file__).parent / "data" / "roll"


def test_rolls_reward_workers_become_domains_with_their_mix_and_difficulty_mask():
    cfg = load_config(ROLL / "qwen2.5-7B-rlvr_megatron.yaml")
    reward = cfg.reward
    assert (reward.function, reward.default_domain) == ("math_verify", "math_rule")
    assert {n: (d.function, d.tags) for n, d in reward.domains.items()} == {
        "crossthinkqa": ("crossthinkqa", ["crossthinkqa"]), "ifeval": ("ifeval", ["ifeval"]),
        "code_sandbox": ("code_tests", ["KodCode"]), "llm_judge": ("llm_judge", ["RLVR"])}
    judge = reward.judge
    assert (judge.backend, judge.prompt, judge.parser, judge.max_new_tokens, judge.top_k, judge.temperature,
            judge.precision, judge.max_model_len) == ("vllm", "yes_no", "yes_no", 100, 50, 0.8, "bfloat16", 8000)
    assert cfg.data.domain_interleave_probs == {"math_rule": 0.4, "code_sandbox": 0.3, "llm_judge": 0.1,
                                                "crossthinkqa": 0.1, "ifeval": 0.1}
    assert any("rewards.ifeval.reward_type='soft': ROLL's IFEval rule worker does not read it" in w
               for w in cfg.load_warnings)
    mask = cfg.grpo.difficulty_mask
    assert (mask.enabled, mask.low_threshold, mask.high_threshold) == (True, 0.1, 0.95)
    became = "\n".join(cfg.load_notes)
    assert "rewards.code_sandbox (CodeSandboxRewardWorker) -> reward.domains.code_sandbox: code_tests on the " \
           "examples tagged KodCode" in became
    tree = yaml.safe_load((ROLL / "qwen2.5-7B-rlvr_megatron.yaml").read_text())
    tree["rewards"]["code_sandbox"]["use_local"] = False
    tree["rewards"]["llm_judge"]["judge_model_type"] = "api"
    with pytest.raises(ConfigError) as refused:
        load_config(tree)
    message = str(refused.value)
    assert "'rewards.code_sandbox.use_local' = false: a remote sandbox needs its code_url" in message
    assert "'rewards.llm_judge.judge_model_type' = 'api': novarl's judge is a model it runs" in message
    assert "domain_interleave_probs" not in message  # said once, at the workers


def completion(text: str, answer: str | None = None, **columns) -> Completion:
    return Completion(Prompt(f"q{len(columns)}", [len(text)], answer, columns=columns), [1], [0.0], text, "stop", 0)


def test_each_example_is_scored_by_its_domains_verifier(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rows = {"math.jsonl": [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4", "tag": "KodCode"}],
            "code.jsonl": [{"prompt": "add", "answer": "", "tests": ["assert add(1, 2) == 3"]}]}
    for name, lines in rows.items():
        Path(name).write_text("".join(json.dumps(r) + "\n" for r in lines))
    datasets = [{"data_path": "math.jsonl"}, {"data_path": "code.jsonl", "env_name": "code"}]
    cfg = load_config({"data": {"train": datasets},
                       "reward": {"function": "exact_match", "domains": {
                           "code": {"function": "code_tests", "tags": ["KodCode"]},
                           "choice": {"function": "crossthinkqa"}}}})
    from novarl.data.datasets import load_examples

    examples = load_examples(cfg.data, "train")
    routing = Routing.of(cfg.reward)
    # the dataset's env_name, the tag, else the default domain; a row's own domain column wins
    assert [routing.domain_of(e.columns) for e in examples] == ["default", "code", "code"]
    assert routing.domain_of({"domain": "choice", "tag": "KodCode"}) == "choice"
    with pytest.raises(UserError, match="domain column is 'nope', not a reward domain"):
        routing.domain_of({"domain": "nope"})
    scorer = run_scorer(cfg)
    done = [completion("2", "2"), completion("5", "2"),
            completion("```python\ndef add(a, b):\n    return a + b\n```", tests=["assert add(1, 2) == 3"],
                       domain="code"),
            completion("def add(a, b): return a - b", tests=["assert add(1, 2) == 3"], tag="KodCode"),
            completion("so \\boxed{B}", "B", domain="choice")]
    assert scorer.score(done) == [1.0, 0.0, 1.0, 0.0, 1.0]
    metrics = scorer.take_metrics()
    assert metrics["domain/default/reward_mean"] == 0.5 and metrics["domain/default/samples"] == 2
    assert metrics["domain/code/pass_rate"] == 0.5 and metrics["domain/choice/samples"] == 1
    assert metrics["domain/code/verifier_seconds"] > 0 and "domain/code/reward/code_tests/timeout" in metrics


def test_domain_interleave_probs_draw_each_steps_prompts_in_rolls_shares():
    domains = {"math_rule": 0.4, "code": 0.3, "judge": 0.1, "choice": 0.1, "ifeval": 0.1}
    cfg = load_config({"grpo": {"num_prompts_per_step": 64}, "data": {"domain_interleave_probs": domains},
                       "reward": {"default_domain": "math_rule", "domains": {
                           d: {"function": "exact_match"} for d in [*domains, "unused"] if d != "math_rule"}}})
    prompts = [Prompt(f"{d}{i}", [i], "x", columns={"domain": d}) for d in [*domains, "unused"] for i in range(70)]
    notes: list[str] = []
    sampler = run_sampler(cfg, prompts, notes)
    assert isinstance(sampler, DomainSampler)
    assert sampler.counts(64) == {"math_rule": 25, "code": 19, "judge": 6, "choice": 6, "ifeval": 8}  # ROLL's split
    assert "not drawn (no probability in data.domain_interleave_probs, as ROLL leaves them out): 70 example(s) " \
           "of unused" in notes
    first = sampler.next_batch(64)
    assert Counter(p.columns["domain"] for p in first) == {"math_rule": 25, "code": 19, "judge": 6, "choice": 6,
                                                            "ifeval": 8}
    state = sampler.state_dict()
    second = [p.text for p in sampler.next_batch(64)]
    sampler.load_state_dict(state)
    assert [p.text for p in sampler.next_batch(64)] == second  # a resume draws the same prompts
    fresh = run_sampler(cfg, prompts, [])
    seen = [p.text for _ in range(2) for p in fresh.next_batch(64) if p.columns["domain"] == "math_rule"]
    assert len(seen) == len(set(seen)) == 50  # each pool read without replacement within its epoch
    with pytest.raises(UserError, match="too few training examples in code \\(3 example\\(s\\) for 19 a step\\)"):
        run_sampler(cfg, [p for p in prompts if p.columns["domain"] != "code"] +
                    [Prompt("c", [1], "x", columns={"domain": "code"})] * 3, [])


def test_difficulty_mask_trains_only_groups_neither_too_easy_nor_too_hard():
    cfg = load_config({"grpo": {"num_generations_per_prompt": 4, "difficulty_mask": {
        "enabled": True, "low_threshold": 0.1, "high_threshold": 0.95}}})
    raw = torch.tensor([1., 1, 1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 1, 1, 1, 0])  # means 1, 0, 0.25, 0.75
    done = [completion("a") for _ in range(16)]
    rollouts = Rollouts.of(cfg, done, raw, raw.clone(), {})
    assert rollouts.trained.tolist() == [False] * 8 + [True] * 8
    assert rollouts.metrics["difficulty_mask_ratio"] == 0.5
    batch = build_train_batch(done, torch.ones(16), trained=rollouts.trained)
    per_sample = [bool(batch.loss_mask[int(batch.cu_seqlens[s]):int(batch.cu_seqlens[s + 1])].any()) for s in range(16)]
    assert per_sample == rollouts.trained.tolist()
    with pytest.raises(ConfigError, match="low_threshold=0.9 must be below high_threshold=0.5"):
        load_config({"grpo": {"difficulty_mask": {"enabled": True, "low_threshold": 0.9, "high_threshold": 0.5}}})


def test_crossthinkqa_rule_rewards_by_rolls_table():
    soft = [crossthinkqa(text, "B") for text in ("so \\boxed{B}", "The answer is B.", "\\boxed{C}", "no idea")]
    assert soft == [1.0, 0.5, -0.5, -1.0]
    assert [crossthinkqa("The answer is B.", "B", kind) for kind in ("loose", "strict")] == [1.0, -1.0]
    assert crossthinkqa("<think>\\boxed{A}</think> the answer is (B)", "B") == 0.5
    assert repetition_penalty("a b c a b c") == pytest.approx(-0.5 * (1 - 3 / 4))


@pytest.mark.parametrize("text, check, held", [
    ("all lower case here", {"func_name": "validate_lowercase"}, True),
    ("Not lower", {"func_name": "validate_lowercase"}, False),
    ("one, two", {"func_name": "validate_no_commas"}, False),
    ("a cat and a dog", {"func_name": "verify_keywords", "keyword_list": ["cat", "DOG"]}, True),
    ("the cat saw the cat", {"func_name": "verify_keyword_frequency", "word": "cat", "N": 2}, True),
    ("one two three four", {"func_name": "validate_word_constraint", "N": 3, "quantifier": "at least"}, True),
    ("one two", {"func_name": "validate_word_constraint", "N": 3, "quantifier": "at least"}, False),
    ("First one.\n\nSecond one.", {"func_name": "validate_paragraphs", "N": 2, "first_word": "second", "i": 2}, True),
    ("* a\n* b\n- c", {"func_name": "verify_bullet_points", "N": 3}, True),
    ("<<My Title>> body", {"func_name": "validate_title"}, True),
    ('{"a": 1}', {"func_name": "validate_json_format"}, True),
    ("yes ****** no", {"func_name": "validate_two_responses"}, True),
    ("body\nP.S. bye", {"func_name": "verify_postscript", "postscript_marker": "P.S."}, True),
    ("SECTION 1 a SECTION 2 b", {"func_name": "validate_sections", "N": 2, "section_splitter": "SECTION"}, True),
    ("fill [name] and [date]", {"func_name": "validate_placeholders", "N": 2}, True),
    ('"quoted"', {"func_name": "validate_quotation"}, True),
    ("Is that all?", {"func_name": "validate_end", "end_phrase": "Is that all?"}, True),
    ("WOW so GOOD", {"func_name": "validate_frequency_capital_words", "N": 2, "quantifier": "at least"}, True),
    ("lower", {"func_name": "validate_word_constraint", "N": None, "quantifier": "at least"}, False),  # raises
])
def test_ifeval_checks_as_rolls_rule_worker_reads_them(text, check, held):
    result = ifeval(f"<think>ignored</think>{text}", json.dumps({**check, "unused_argument": None}))
    assert result["reward"] == float(held) + repetition_penalty(text)
    assert result["check_errors"] == float(check.get("N", 0) is None)


def test_ifeval_refuses_answers_that_name_no_check():
    assert len(CHECKS) == 25
    with pytest.raises(UserError, match="names check 'nope', not one of the 25 known"):
        ifeval("x", json.dumps({"func_name": "nope"}))
    with pytest.raises(UserError, match="check verify_keywords needs keyword_list"):
        ifeval("x", json.dumps({"func_name": "verify_keywords"}))


def test_a_roll_config_with_math_code_and_judge_domains_trains_on_the_tiny_models(tmp_path, monkeypatch, capsys):
    """ROLL's format end to end on one CPU rank: a math rule, the code sandbox and an LLM judge (the bundled
    tiny model, in an engine of its own), each step's prompts drawn 2 / 1 / 1 by domain, every reward
    computed by its domain's verifier."""
    from novarl.cli import main
    from novarl.logging.metrics import read_jsonl

    monkeypatch.chdir(tmp_path)
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b), "tag": "arithmetic"} for a in range(10, 20) for b in (40, 41)]
    rows += [{"prompt": f"{a}+{b}=", "answer": "", "tag": "KodCode", "tests": [f"assert {a} + {b} == {a + b}"]}
             for a in range(10, 16) for b in (40, 41)]
    rows += [{"prompt": f"{a}+{b}=", "answer": str(a + b), "tag": "RLVR"} for a in range(20, 26) for b in (1, 2)]
    Path("data").mkdir()
    Path("data/train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tree = yaml.safe_load((ROLL / "tiny_grpo_fsdp2.yaml").read_text())
    tree["num_gpus_per_node"] = 1
    for role in ("actor_train", "actor_infer", "reference"):
        tree[role]["device_mapping"] = [0]
    tree["actor_train"]["strategy_args"]["strategy_config"]["fsdp_size"] = 1
    tree["actor_train"]["data_args"]["domain_interleave_probs"] = {"math_rule": 0.5, "code_sandbox": 0.25,
                                                                   "llm_judge": 0.25}
    tree["rewards"]["code_sandbox"] = {"worker_cls": "CodeSandboxRewardWorker", "tag_included": ["KodCode"],
                                       "use_local": True}
    tree["rewards"]["llm_judge"] = {
        "worker_cls": "LLMJudgeRewardWorker", "judge_prompt": "Qwen2.5-7B-Instruct-RLVR-prompt",
        "judge_model_type": "inference", "tag_included": ["RLVR"], "model_args": {"model_name_or_path": "tiny-arith"},
        "generating_args": {"max_new_tokens": 4, "temperature": 0.0}, "strategy_args": {"strategy_name": "hf_infer"}}
    Path("roll.yaml").write_text(yaml.safe_dump(tree))
    code = main(["train", "roll.yaml", "logger.progress_bar=false", "grpo.max_num_steps=2", "grpo.val_at_start=false",
                 "grpo.val_at_end=false", "checkpointing.enabled=false"])
    assert code == 0, capsys.readouterr().err[-3000:]
    metrics = [r for r in read_jsonl(next(Path("output/logs").glob("*/metrics.jsonl"))) if r["kind"] == "train"]
    assert len(metrics) == 2
    for step in metrics:  # 4 prompts x 4 samples: 2 math, 1 code, 1 judged prompt a step
        assert (step["domain/math_rule/samples"], step["domain/code_sandbox/samples"],
                step["domain/llm_judge/samples"]) == (8, 4, 4)
        assert step["domain/code_sandbox/reward/code_tests/sandbox_failed"] == 0.0
        assert "domain/llm_judge/reward/llm_judge/unparsable" in step  # the judge's own answers, parsed


def test_difficulty_loss_weight_scales_each_samples_advantages_by_rolls_rule():
    from novarl.rollout.collect import difficulty_weights
    from novarl.algorithms.losses import ClippedPGSettings
    from novarl.trainer.stages import Advantages, StepWork, advantage_estimator

    done = [completion("a", difficulty=d) for d in (0.0, 0.0, 1.0, 1.0, "0.5", "0.5", 3.0, 3.0)]
    raw = 0.5 + 1.5 * torch.tensor([0.0, 0.0, 1.0, 1.0, 0.5, 0.5, 1.0, 1.0])  # clamped to [0, 1]
    weights = difficulty_weights(done)
    assert weights.tolist() == pytest.approx((raw * 8 / raw.sum()).tolist())
    cfg = load_config({"grpo": {"num_generations_per_prompt": 2, "difficulty_loss_weight": True}})
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0])
    rollouts = Rollouts.of(cfg, done, rewards, rewards, {})
    assert rollouts.weights.tolist() == pytest.approx(weights.tolist())
    stage = Advantages(advantage_estimator(cfg), ClippedPGSettings())
    plain, weighted = (StepWork(build_train_batch(done, torch.zeros(8)), rewards, weights=w) for w in (None, weights))
    stage(plain), stage(weighted)
    index = plain.batch.sequence_index
    assert weighted.batch.advantages.tolist() == pytest.approx((plain.batch.advantages * weights[index]).tolist())
    with pytest.raises(UserError, match="reads each example's 'difficulty' column as a number; an example has 'hard'"):
        difficulty_weights([completion("a", difficulty="hard")])
