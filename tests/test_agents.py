"""Agents of the user's play episodes through the run's OpenAI-compatible endpoint (issue 33): an
agent written against the real `openai` package plays 2-turn episodes, and the run trains on exactly
the tokens the engine sampled (with its logprobs) and the messages the agent added between turns,
rendered once; requests without the run's token are refused; a rewritten history starts a new
segment; an agent that fails is counted, without loss."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
import torch

from novarl.backends.generation.hf import HFGeneration
from novarl.models.loading import load_tokenizer, resolve_model_path
from novarl.rollout.agents import AgentEpisodes, load_agent
from novarl.rollout.endpoint import RenderPrompt
from novarl.rollout.episodes import ContentTokens
from novarl.types import Prompt, SamplingConfig
from tests.helpers.agents import AGAIN
from tests.helpers.recording import Recording

pytest.importorskip("openai")


@pytest.fixture(scope="module")
def tiny():
    path = resolve_model_path("tiny-arith")
    tokenizer = load_tokenizer(path)
    generator = Recording(HFGeneration(path, tokenizer, torch.device("cpu"), max_seq_length=48))
    texts = ["12+34=", "5+7=", "40+2=", "9+1="]
    prompts = [Prompt(t, tokenizer(t)["input_ids"], answer=str(eval(t[:-1])), index=i, source=t)
               for i, t in enumerate(texts) for _ in range(2)]
    return tokenizer, generator, prompts


def agents(tokenizer, spec: str, max_turns: int = 2) -> AgentEpisodes:
    return AgentEpisodes(load_agent("agent", spec), tokenizer, ContentTokens(tokenizer), RenderPrompt(tokenizer, None),
                         model="tiny-arith", max_turns=max_turns, max_tokens=48, max_failed_fraction=0.5, workers=4)


SAMPLING = SamplingConfig(max_new_tokens=4, temperature=1.0, seed=5)


def test_an_openai_agent_plays_two_turns_and_trains_on_exactly_what_was_sampled(tiny):
    from novarl.rollout.batch import build_train_batch

    tokenizer, generator, prompts = tiny
    played = agents(tokenizer, "tests.helpers.agents:two_turns")
    try:
        completions, rewards = played.play(generator, prompts, SAMPLING)
        metrics = played.take_metrics()
    finally:
        played.shutdown()
    assert [c.turns for c in completions] == [2] * len(prompts) and all(c.failed is None for c in completions)
    assert set(rewards) <= {0.1, 1.0} and metrics["agent_requests"] == 2 * len(prompts)
    sampled = [(sent, c.token_ids, c.logprobs) for turn in generator.turns for sent, c in turn]
    observation = tokenizer(AGAIN, add_special_tokens=False)["input_ids"]
    for prompt, episode in zip(prompts, completions):
        assert episode.prompt.token_ids == prompt.token_ids  # the agent's first message, rendered as the run's are
        (a, b), = episode.observed
        assert episode.token_ids[a:b] == observation and episode.logprobs[a:b] == [0.0] * len(observation)
        tokens, logprobs = episode.token_ids, episode.logprobs  # each turn: what the engine sampled from the
        assert (prompt.token_ids, tokens[:a], logprobs[:a]) in sampled  # exact sequence so far, and its logprobs
        assert ([*prompt.token_ids, *tokens[:b]], tokens[b:], logprobs[b:]) in sampled
    batch = build_train_batch(completions, torch.tensor(rewards))
    assert int(batch.loss_mask.sum()) == sum(len(c.token_ids) - len(observation) for c in completions)


def test_the_endpoint_refuses_requests_without_the_runs_token_and_listens_on_loopback(tiny):
    tokenizer, generator, prompts = tiny
    played = agents(tokenizer, "tests.helpers.agents:two_turns")
    endpoint = played.serving(generator)
    try:
        assert endpoint.address[0] == "127.0.0.1"
        session = endpoint.open(0, prompts[0], SAMPLING)
        url = endpoint.base_url(session) + "/chat/completions"
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "1+1="}]}).encode()
        for headers in ({}, {"Authorization": "Bearer not-the-token"}):
            request = urllib.request.Request(url, body, {"Content-Type": "application/json", **headers})
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=30)
            assert refused.value.code == 401
        assert endpoint.close(session).turns == 0  # nothing was generated for the refused requests
        request = urllib.request.Request(url, body, {"Content-Type": "application/json",
                                                     "Authorization": f"Bearer {endpoint.token}"})
        with pytest.raises(urllib.error.HTTPError) as closed:  # the session is over
            urllib.request.urlopen(request, timeout=30)
        assert closed.value.code == 404
        assert played.take_metrics()["agent_refused"] == 3
    finally:
        played.shutdown()


def test_a_rewritten_history_and_failing_agents_are_counted(tiny):
    tokenizer, generator, prompts = tiny
    rewriting = agents(tokenizer, "tests.helpers.agents:rewrites")
    try:
        completions, _ = rewriting.play(generator, prompts[:2], SAMPLING)
        assert rewriting.take_metrics()["agent_rewrites"] == 2
    finally:
        rewriting.shutdown()
    for completion in completions:  # the last segment: the second question, rendered whole, and its answer
        assert completion.observed == () and completion.turns == 2 and completion.failed is None
        assert completion.prompt.token_ids == tokenizer(AGAIN + completion.prompt.source)["input_ids"]
        (first,) = completion.segments  # the first: the first question and its answer
        assert first.prompt.token_ids == tokenizer(completion.prompt.source)["input_ids"] and first.token_ids
        assert len(first.logprobs) == len(first.token_ids) and first.turns == 1
    check_segments_train_with_their_episodes_advantage(completions)
    failing = agents(tokenizer, "tests.helpers.agents:raises_on_odd")
    try:
        completions, rewards = failing.play(generator, prompts, SAMPLING)
    finally:
        failing.shutdown()
    odd = [int(p.answer) % 2 == 1 for p in prompts]
    assert [c.failed is not None for c in completions] == odd
    assert all("raised RuntimeError: the agent lost its way" in c.failed for c, o in zip(completions, odd) if o)
    silent = agents(tokenizer, "tests.helpers.agents:says_nothing")
    try:
        (completion,), _ = silent.play(generator, prompts[:1], SAMPLING)
    finally:
        silent.shutdown()
    assert "returned 'not a number', not a finite number" in completion.failed
    assert completion.token_ids == [] and completion.turns == 0


def check_segments_train_with_their_episodes_advantage(completions):
    """Each segment becomes a sequence of its own, before its episode's last, with the episode's GRPO
    advantage on every loss token; a step's optimizer steps keep an episode's sequences together; a
    round's segments survive a checkpoint (rollouts.pt)."""
    from novarl.algorithms.advantages import AdvantageSettings
    from novarl.algorithms.estimators import PerSequence, StepRewards
    from novarl.rollout.async_rollouts import pack_round, segment_of, unpack_round
    from novarl.rollout.batch import build_train_batch, with_segments
    from novarl.trainer.stages import sample_chunks

    sequences, episodes = with_segments(completions)
    assert episodes.tolist() == [0, 0, 1, 1]
    assert sequences == [completions[0].segments[0], completions[0], completions[1].segments[0], completions[1]]
    batch = build_train_batch(sequences, torch.zeros(4))
    rewards = torch.tensor([1.0, 0.0])
    advantages = PerSequence("grpo", 2, AdvantageSettings())(StepRewards(batch, rewards, episodes=episodes))
    per_sequence = [set(advantages.advantages[batch.sequence_index == s][batch.loss_mask[batch.sequence_index == s]]
                        .tolist()) for s in range(4)]
    assert per_sequence[0] == per_sequence[1] and per_sequence[2] == per_sequence[3]
    assert next(iter(per_sequence[0])) > 0 > next(iter(per_sequence[2]))  # the rewarded episode's, both segments
    assert sample_chunks(4, 1, episodes) == [(0, 2), (2, 4)]
    saved = unpack_round(pack_round(3, completions, [1.0, 0.0]))["completions"]
    assert [[segment_of(r, c.prompt) for r in s["segments"]] for s, c in zip(saved, completions)] == \
        [list(c.segments) for c in completions]


def test_a_run_trains_an_agent_named_in_the_config(tmp_path):
    from novarl.cli import BUNDLED_RECIPE
    from novarl.config import load_config
    from novarl.trainer.api import GRPOTrainer
    from tests.helpers import HF, train_steps

    cfg = load_config(BUNDLED_RECIPE, overrides=[
        HF, "env.agent.agent=tests.helpers.agents:rewrites_on_odd", "grpo.max_rollout_turns=2",
        "policy.max_seq_length=32",
        "logger.progress_bar=false", "grpo.val_at_start=false", "grpo.val_period=0", "grpo.val_at_end=false",
        "grpo.max_num_steps=2", "grpo.num_prompts_per_step=4", "policy.train_micro_batch_size=16",
        f"logger.log_dir={tmp_path}"])
    steps = train_steps(GRPOTrainer(cfg).train().output_dir)
    assert sorted(steps) == [1, 2]
    for step in steps.values():
        samples = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
        assert step["episode_turns_mean"] == 2.0 and step["agent_requests"] == 2 * samples
        assert step["agent_rewrites"] > 0  # the odd examples' episodes: two segments, both trained
        assert step["logprob_mismatch"] < 0.05  # trained on what was sampled
