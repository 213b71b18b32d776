"""Evaluation on held-out prompts: one greedy completion of each, or grpo.val_num_generations_per_prompt
sampled ones (pass@k)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from novarl.backends.protocols import GenerationBackend
from novarl.config.schema import NovaRLConfig
from novarl.logging.console import info
from novarl.rewards.domains import DomainScorer
from novarl.rewards.scorer import RewardScorer
from novarl.rollout.episodes import PlaysEpisodes, check_failures
from novarl.types import Completion, Prompt, SamplingConfig


@dataclass(frozen=True)
class EvalSampling:
    """How an evaluation samples: `sampling` for each of a prompt's num_generations_per_prompt completions."""

    sampling: SamplingConfig
    num_generations_per_prompt: int
    """Completions of each prompt (grpo.val_num_generations_per_prompt); 1: one greedy completion."""
    label: str
    """How, for people: "greedy", or "4 samples a prompt at temperature 0.7"."""

    @property
    def accuracy_name(self) -> str:
        """What its accuracy is called: "greedy accuracy", or "accuracy (4 samples a prompt at temperature 0.7)"."""
        return "greedy accuracy" if self.num_generations_per_prompt == 1 else f"accuracy ({self.label})"


def evaluation_sampling(cfg: NovaRLConfig) -> EvalSampling:
    """The run's evaluation sampling: greedy for one completion a prompt; for k > 1, k samples at
    policy.generation.val_temperature / val_top_p / val_top_k (each unset: the training sampling's),
    seeded by grpo.seed. Both stop where training's sampling does (stop strings and token ids)."""
    gen, k = cfg.policy.generation, cfg.grpo.val_num_generations_per_prompt
    greedy = SamplingConfig(max_new_tokens=gen.max_new_tokens, temperature=0.0,
                            stop_token_ids=tuple(gen.stop_token_ids or ()), stop_strings=tuple(gen.stop_strings or ()))
    if k == 1:
        return EvalSampling(greedy, 1, "greedy")
    sampling = dataclasses.replace(greedy, seed=cfg.grpo.seed,
                                   temperature=gen.temperature if gen.val_temperature is None else gen.val_temperature,
                                   top_p=gen.top_p if gen.val_top_p is None else gen.val_top_p,
                                   top_k=gen.top_k if gen.val_top_k is None else gen.val_top_k)
    label = f"{k} samples a prompt at temperature {sampling.temperature:g}"
    label += f", top_p {sampling.top_p:g}" if sampling.top_p < 1 else ""
    label += f", top_k {sampling.top_k}" if sampling.top_k is not None else ""
    return EvalSampling(sampling, k, label)


def evaluate(generator: GenerationBackend, prompts: Sequence[Prompt], scorer: RewardScorer | DomainScorer,
             how: EvalSampling, *,
             batch_size: int = 256, samples_to_print: int = 0, episodes: PlaysEpisodes | None = None,
             keep: Callable[[list[Completion], list[float]], object] | None = None) -> dict[str, float]:
    """`how.num_generations_per_prompt` completions (k) of every prompt, a prompt's k consecutive,
    scored. Every batch of batch_size completions is submitted before any is collected, each shared
    among the engines; a sample's random stream is seeded by its position in the evaluation, whatever
    the batches. With `episodes`, episodes instead (a batch at a time), rewarded by their environment.
    keep: given every sample and its reward (the run writes a few to its folder).

    A sample is correct when its reward is >= 1 (exact; NeMo RL counts > 0: the same for 0/1
    rewards). Metrics: accuracy, the share of all samples correct; reward, their mean reward;
    num_samples; for k > 1 also pass_k, the share of prompts with at least one correct sample, and
    num_prompts; then the reward functions' own metrics (or the episodes') over the evaluation."""
    samples = [p for p in prompts for _ in range(how.num_generations_per_prompt)]
    batches = [(samples[start:start + batch_size], dataclasses.replace(how.sampling, seed_offset=start))
               for start in range(0, len(samples), batch_size)]
    if episodes is not None:
        completions, rewards = [], []
        for batch, sampling in batches:
            played, won = episodes.play(generator, batch, sampling)
            completions += played
            rewards += won
        extras = {**episodes.take_metrics(), "episode_turns_mean": sum(c.turns for c in completions) / len(completions),
                  **check_failures(completions, episodes.max_failed_fraction, "in the evaluation")}
    else:
        rollouts = [generator.submit(batch, sampling) for batch, sampling in batches]
        completions = [c for rollout in rollouts for c in rollout.result()]
        rewards = scorer.score(completions)
        extras = scorer.take_metrics()  # the reward functions' own metrics, over the evaluation set
    if keep is not None:
        keep(completions, rewards)
    for c, r in list(zip(completions, rewards))[:samples_to_print]:
        info(f"  {c.prompt.text!r} -> {c.text!r} (answer {c.prompt.answer!r}, reward {r:g})")
    return {**correct_shares(rewards, how.num_generations_per_prompt), **extras}


def correct_shares(rewards: Sequence[float], num_generations_per_prompt: int) -> dict[str, float]:
    """accuracy, reward, num_samples and, for several samples a prompt, pass_k and num_prompts of
    `rewards` ([num_prompts x num_generations_per_prompt], a prompt's samples consecutive): see `evaluate`."""
    correct = [r >= 1.0 for r in rewards]
    shares = {"accuracy": sum(correct) / len(correct), "reward": sum(rewards) / len(rewards),
              "num_samples": float(len(rewards))}
    if num_generations_per_prompt > 1:
        per_prompt = [any(correct[start:start + num_generations_per_prompt])
                      for start in range(0, len(correct), num_generations_per_prompt)]
        shares.update(pass_k=sum(per_prompt) / len(per_prompt), num_prompts=float(len(per_prompt)))
    return shares


def describe(result: Mapping[str, float], how: EvalSampling, *, source: str = "held-out") -> str:
    """An evaluation's result in words: "held-out accuracy 35.0% (greedy)", or "held-out accuracy
    35.0% (4 samples a prompt at temperature 0.7), pass@4 60.0%" (source: where the prompts came from)."""
    words = f"{source} accuracy {100 * result['accuracy']:.1f}% ({how.label})"
    if how.num_generations_per_prompt > 1:
        words += f", pass@{how.num_generations_per_prompt} {100 * result['pass_k']:.1f}%"
    return words
