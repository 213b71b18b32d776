"""The LLM judge's reward (novarl/rollout/judge.py; ROLL's LLMJudgeRewardWorker): its engine's answers
equal a direct call of the same model, its parsers, its templates."""

from __future__ import annotations

import pytest
import torch

from novarl.config import load_config
from novarl.config.sections.data import RewardConfig
from novarl.errors import ConfigError, UserError
from novarl.models.bundled import BUNDLED_MODELS
from novarl.rollout.judge import judge_prompt, parse_answer
from novarl.rewards.scorer import RewardScorer
from novarl.types import Completion, Prompt


@pytest.mark.parametrize("answer, parser, reward", [
    ("YES", "yes_no", 1.0), ("No, it does not.", "yes_no", 0.0), ("Yes. Well, no.", "yes_no", 1.0),
    ("I cannot tell", "yes_no", None), ("nothing", "yes_no", None), ("not sure", "yes_no", None),
    ("Good.\nScore: 7", "score", 0.7), ("score: 12", "score", 1.0), ("Score: none", "score", None),
])
def test_the_parsers_read_the_judges_answers(answer, parser, reward):
    assert parse_answer(answer, parser) == reward


def test_templates():
    assert "Question:\n2+2\n" in judge_prompt("yes_no", "2+2", "4", "4") and "Reference answer:\n4" in \
        judge_prompt("yes_no", "2+2", "4", "4")
    assert judge_prompt("Q {question} A {response} R {reference}", "q", "a", None) == "Q q A a R "
    with pytest.raises(UserError, match="a template takes {question}, {response} and {reference} only"):
        judge_prompt("{response} {nope}", "q", "a", "r")
    with pytest.raises(ConfigError, match="a template of your own must place the {response}"):
        load_config(overrides=["reward.judge.prompt=grade {question}"])


def completion(question: str, text: str, answer: str) -> Completion:
    return Completion(Prompt(f"<{question}>", [1], answer, source=[{"role": "user", "content": question}]),
                      [1], [0.0], text, "stop", 0)


def test_the_judges_answers_and_rewards_equal_a_direct_call_of_the_same_model():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    template = "{question}{response}="
    settings = RewardConfig(function="llm_judge", judge={
        "model_name": "tiny-arith", "prompt": template, "max_new_tokens": 4, "max_model_len": 64, "batch_size": 2})
    scorer = RewardScorer.from_spec("llm_judge", settings=settings)
    done = [completion("12+30=", "42", "42"), completion("7+8=", "16", "15"), completion("1+1=", "2", "2")]
    rewards = scorer.score(done)
    metrics = scorer.take_metrics()

    path = BUNDLED_MODELS["tiny-arith"]
    model, tokenizer = AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    direct = []
    with torch.no_grad():
        for c in done:
            ids = tokenizer(template.format(question=c.prompt.source[0]["content"], response=c.text),
                            add_special_tokens=False, return_tensors="pt")["input_ids"]
            out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
            direct.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    judge = scorer.terms[0].fn
    prompts = judge.prompts([c.prompt.source[0]["content"] for c in done], [c.text for c in done],
                            [c.prompt.answer for c in done])
    assert judge.answers(prompts) == direct
    expected = [parse_answer(text, "yes_no") for text in direct]
    assert rewards == [0.0 if value is None else value for value in expected]
    assert metrics["reward/llm_judge/unparsable"] == pytest.approx(sum(v is None for v in expected) / len(done))
    with pytest.raises(UserError, match="reward.judge.model_name, which is not set"):
        RewardScorer.from_spec("llm_judge", settings=RewardConfig(function="llm_judge"))
