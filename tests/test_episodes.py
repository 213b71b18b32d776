"""Multi-turn episodes train on exactly the tokens the engine sampled and the observations' tokens
as rendered once (issue 33): turn by turn, the training batch's tokens are sampled + observed, the
loss is on the sampled ones only, the stored logprobs are the engine's, and the model itself scores
those tokens as the engine did (it generated each turn from exactly that sequence)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
import torch

from novarl.backends.generation.hf import HFGeneration
from novarl.models.loading import load_causal_lm, load_tokenizer, resolve_model_path, token_logprobs
from novarl.rollout.environment import Environment, EnvStep, ScoredOnce
from novarl.rollout.episodes import ContentTokens, play
from novarl.rollout.batch import build_train_batch, rollout_metrics
from novarl.types import Prompt, SamplingConfig
from tests.helpers.recording import Recording

TURNS = 3


class AskAgain:
    """Answers each turn with " again:" and 0.25, ending after `turns` turns with 1.0 (episodes of
    an odd data index end after the first turn: uneven lengths)."""

    def step(self, conversation, metadata: Mapping[str, Any]) -> EnvStep:
        turns = sum(m["role"] == "assistant" for m in conversation)
        if turns == metadata["turns"]:
            return EnvStep(reward=1.0, done=True)
        return EnvStep(reward=0.25, done=False, observation={"role": "user", "content": " again:"},
                       metadata={**metadata, "seen": turns})


@pytest.fixture(scope="module")
def played():
    path = resolve_model_path("tiny-arith")
    tokenizer = load_tokenizer(path)
    generator = Recording(HFGeneration(path, tokenizer, torch.device("cpu"), max_seq_length=64))
    prompts = [Prompt(text, tokenizer(text)["input_ids"], index=i, columns={"turns": 1 if i % 2 else TURNS})
               for i, text in enumerate(["12+34=", "5+7=", "40+2=", "99+1="])]
    sampling = SamplingConfig(max_new_tokens=4, temperature=1.0, seed=11)
    completions, rewards = play(generator, prompts, sampling, AskAgain(), ContentTokens(tokenizer), max_turns=TURNS)
    return path, tokenizer, generator, prompts, completions, rewards


def test_the_environment_protocol_is_what_the_episodes_call():
    assert isinstance(AskAgain(), Environment) and isinstance(ScoredOnce(lambda text, row: 0.0), Environment)


def test_each_turn_starts_from_exactly_the_tokens_sampled_and_observed(played):
    _, tokenizer, generator, prompts, completions, rewards = played
    observation = tokenizer(" again:", add_special_tokens=False)["input_ids"]
    assert [c.turns for c in completions] == [TURNS, 1, TURNS, 1]
    assert rewards == [0.25 * (TURNS - 1) + 1.0, 1.0, 0.25 * (TURNS - 1) + 1.0, 1.0]
    assert len(generator.turns) == TURNS and [len(t) for t in generator.turns] == [4, 2, 2]  # finished ones leave
    for e in (0, 2):
        episode = completions[e]
        expected, spans, logprobs = [], [], []
        for turn in range(TURNS):
            sent, sampled = generator.turns[turn][e // 2 if turn else e]
            assert sent == [*prompts[e].token_ids, *expected]  # the engine continued the exact sequence
            expected += sampled.token_ids
            logprobs += sampled.logprobs
            if turn < TURNS - 1:
                spans.append((len(expected), len(expected) + len(observation)))
                expected += observation
                logprobs += [0.0] * len(observation)
        assert episode.token_ids == expected and list(episode.observed) == spans and episode.logprobs == logprobs


def test_the_batch_trains_on_the_sampled_tokens_with_the_engines_logprobs(played):
    path, _, _, prompts, completions, rewards = played
    batch = build_train_batch(completions, torch.tensor(rewards))
    model = load_causal_lm(path)
    for s, (prompt, episode) in enumerate(zip(prompts, completions)):
        start, end = int(batch.cu_seqlens[s]), int(batch.cu_seqlens[s + 1])
        ids = batch.input_ids[start:end]
        assert ids.tolist() == [*prompt.token_ids, *episode.token_ids]
        sampled = torch.ones(len(episode.token_ids), dtype=torch.bool)
        for a, b in episode.observed:
            sampled[a:b] = False
        mask = batch.loss_mask[start:end]
        assert mask.tolist() == [False] * len(prompt.token_ids) + sampled.tolist()
        stored = batch.generator_logprobs[start:end]
        assert stored[mask].tolist() == pytest.approx([lp for lp, on in zip(episode.logprobs, sampled) if on])
        with torch.no_grad():  # the model scores the sampled tokens as the engine did
            ours = token_logprobs(model(input_ids=ids[None]).logits, ids[None])[0]
        torch.testing.assert_close(ours[mask], stored[mask], rtol=1e-4, atol=1e-4)
    metrics = rollout_metrics(completions, torch.tensor(rewards), 2)
    observed = sum(b - a for c in completions for a, b in c.observed)
    assert metrics["tokens_generated"] == sum(len(c.token_ids) for c in completions) - observed > 0


QWEN_LIKE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""A chat template of Qwen's shape: role headers, an end-of-turn marker and a newline after each message."""


@pytest.mark.parametrize("turn, ended_with", [("46<|im_end|>", "<|im_end|>"), ("<action>up</action>", None)],
                         ids=["ended-on-its-end-of-turn-token", "cut-by-a-stop-string"])
def test_an_observation_is_what_the_template_renders_after_the_turn(turn, ended_with):
    """Prompt + sampled turn + observation is the template's own rendering of the whole
    conversation, whether the turn ended on the end-of-turn token or was cut by a stop string."""
    from novarl.rollout.episodes import TemplateTokens

    tokenizer = load_tokenizer(resolve_model_path("tiny-arith"))
    tokens = TemplateTokens(tokenizer, QWEN_LIKE)
    user, tool = {"role": "user", "content": "12+34="}, {"role": "tool", "content": "<tool_response>46</tool_response>"}
    prompt = tokenizer.apply_chat_template([user], chat_template=QWEN_LIKE, tokenize=False, add_generation_prompt=True)
    answer = turn.removesuffix("<|im_end|>")
    whole = tokenizer.apply_chat_template([user, {"role": "assistant", "content": answer}, tool],
                                          chat_template=QWEN_LIKE, tokenize=False, add_generation_prompt=True)
    assert prompt + turn + tokens.text(tool, ended_with) == whole
