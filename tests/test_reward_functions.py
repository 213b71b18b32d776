"""Reward functions as people write them: per sample or batched (TRL's convention), with the
data's columns, several with weights, extra metrics; and the math rewards (math-verify,
boxed answers, last numbers, a format reward)."""

from __future__ import annotations

import pytest

from novarl.config import load_config
from novarl.errors import UserError
from novarl.rewards.math import boxed_format, boxed_match, extract_boxed, last_number_match, math_verify
from novarl.rewards.scorer import RewardScorer
from novarl.types import Completion, Prompt


def completion(text: str, answer: str = "4", **columns) -> Completion:
    prompt = Prompt(text="2+2=", token_ids=[1], answer=answer, columns=columns)
    return Completion(prompt=prompt, token_ids=[2], logprobs=[0.0], text=text, finish_reason="stop", policy_version=0)


def test_a_per_sample_reward_gets_the_columns_it_names():
    def by_level(completion, answer, level, prompt=None):
        return float(completion == answer) * level + (0.5 if prompt == "2+2=" else 0.0)

    scores = RewardScorer.from_spec(by_level).score([completion("4", level=2), completion("5", level=3)])
    assert scores == [2.5, 0.5]

    def everything(completion, answer, **kwargs):
        return float(len(kwargs))

    assert RewardScorer.from_spec(everything).score([completion("4", level=2, source="x")]) == [3.0]  # prompt too


def test_a_batched_reward_is_called_once_with_lists():
    calls = []

    def accuracy(completions, answers, level, **kwargs):  # TRL: first parameter 'completions'
        calls.append((list(completions), list(answers), list(level), sorted(kwargs)))
        return [float(c == a) for c, a in zip(completions, answers)]

    scores = RewardScorer.from_spec(accuracy).score([completion("4", level=1), completion("3", level=2)])
    assert scores == [1.0, 0.0]
    assert calls == [(["4", "3"], ["4", "4"], [1, 2], ["prompts", "sources"])]  # sources: the data's prompts


def test_wrong_signatures_and_returns_say_what_novarl_calls():
    with pytest.raises(UserError, match=r"takes 1 positional parameter.*fn\(completion, answer, \.\.\.\).*"
                                        r"fn\(completions, \*\*kwargs\)"):
        RewardScorer.from_spec(lambda completion: 1.0)
    with pytest.raises(UserError, match=r"needs 'difficulty', which is neither 'prompt' nor a column of the data "
                                        r"\(columns: level\)"):
        RewardScorer.from_spec(lambda completion, answer, difficulty: 1.0).score([completion("4", level=1)])
    with pytest.raises(UserError, match=r"must return a list of 2 rewards, one per completion; it returned a list "
                                        r"of 1"):
        RewardScorer.from_spec(lambda completions, **kw: [1.0]).score([completion("4"), completion("5")])
    with pytest.raises(UserError, match=r"returned a dict without 'reward'"):
        RewardScorer.from_spec(lambda completion, answer: {"score": 1.0}).score([completion("4")])
    with pytest.raises(UserError, match=r"returned None \(NoneType\), not a finite number"):
        RewardScorer.from_spec(lambda completion, answer: None).score([completion("4")])


def test_several_rewards_are_weighted_and_each_logged_with_extra_metrics():
    def correct(completion, answer):
        return {"reward": float(completion == answer), "length": float(len(completion))}

    def short(completions, **kwargs):
        return [None if c == "skip" else float(len(c) < 3) for c in completions]  # None: does not apply

    scorer = RewardScorer.from_spec([correct, short], weights=[1.0, 0.5])
    assert scorer.score([completion("4"), completion("skip"), completion("four")]) == [1.5, 0.0, 0.0]
    metrics = scorer.take_metrics()
    assert metrics == {"reward/correct": pytest.approx(1 / 3), "reward/correct/length": 3.0, "reward/short": 0.5}
    assert scorer.take_metrics() == {}
    with pytest.raises(UserError, match=r"reward.weights has 1 weight\(s\) for 2 reward function\(s\)"):
        RewardScorer.from_spec([correct, short], weights=[1.0])


def test_the_config_names_several_rewards_by_name_with_weights():
    cfg = load_config({"reward": {"function": ["boxed_match", "boxed_format"], "weights": [1.0, 0.1]}})
    scorer = RewardScorer.from_spec(cfg.reward.function, weights=cfg.reward.weights)
    assert scorer.score([completion("so \\boxed{4}"), completion("\\boxed{5}"), completion("4")]) == \
        [pytest.approx(1.1), pytest.approx(0.1), 0.0]
    assert scorer.name == "boxed_match + 0.1 x boxed_format"


@pytest.mark.parametrize("text, answer, expected", [
    ("The sum is \\boxed{\\frac{1}{2}}.", "\\dfrac{1}{2}", 1.0),
    ("\\boxed{1,234}", "1234", 1.0),
    ("\\boxed{ 7 }", "7.0", 1.0),
    ("\\boxed{x^{2}} then \\boxed{3}", "3", 1.0),  # the last box
    ("\\boxed{3", "3", 0.0),  # not closed
    ("no box: 3", "3", 0.0),
])
def test_boxed_answers(text, answer, expected):
    assert boxed_match(text, answer) == expected


def test_last_number_and_format():
    assert extract_boxed("a \\boxed{b{c}} d") == "b{c}"
    assert last_number_match("so 12 + 30 = 42.", "#### 42") == 1.0
    assert last_number_match("it is -3.50", "-3.5") == 1.0
    assert last_number_match("it is 41", "42") == 0.0
    assert boxed_format("\\boxed{anything}", "") == 1.0 and boxed_format("\\boxed{}", "") == 0.0


def test_math_verify_checks_values_not_text():
    pytest.importorskip("math_verify")
    assert math_verify("Thus the answer is $\\boxed{\\frac{1}{2}}$.", "0.5") == 1.0
    assert math_verify("The answer is \\boxed{2\\sqrt{2}}", "\\sqrt{8}") == 1.0
    assert math_verify("The answer is \\boxed{3}", "4") == 0.0
    assert math_verify("I cannot tell", "4") == 0.0


def test_nemo_rl_math_environment_scores_with_math_verify():
    cfg = load_config({"env": {"math": {"num_workers": 8, "math_verify_impl": "hf_math_verify"}},
                       "data": {"default": {"env_name": "math"}}})
    assert cfg.reward.function == "math_verify"
    assert any("env.math" in w and "math_verify" in w for w in cfg.load_warnings)
    # a reward the config names itself wins
    cfg = load_config({"env": {"math": {"num_workers": 8}}, "reward": {"function": "boxed_match"}})
    assert cfg.reward.function == "boxed_match"
    # NeMo RL's other checker, DAPO's (tests/test_dapo_math.py)
    assert load_config({"env": {"math": {"math_verify_impl": "dapo_math_verify"}}}).reward.function == \
        "dapo_math_verify"


def test_validate_says_when_a_registered_reward_lacks_its_package(monkeypatch):
    from novarl.backends.contract.checks import check_config
    from novarl.rewards import registry

    monkeypatch.setitem(registry.NEEDS, "math_verify", ("novarl_no_such_package", "pip install 'novarl[math]'"))
    report = check_config(load_config({"reward": {"function": ["exact_match", "math_verify"]}}))
    assert [str(p) for p in report.problems] == ["reward.function='math_verify' needs the novarl-no-such-package "
                                                 "package: pip install 'novarl[math]'."]
