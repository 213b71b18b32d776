"""Greedy evaluation on held-out prompts."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from novarl.backends.protocols import GenerationBackend
from novarl.logging.console import info
from novarl.rewards.domains import DomainScorer
from novarl.rewards.scorer import RewardScorer
from novarl.rollout.episodes import PlaysEpisodes, check_failures
from novarl.types import Completion, Prompt, SamplingConfig


def evaluate(generator: GenerationBackend, prompts: Sequence[Prompt], scorer: RewardScorer | DomainScorer,
             max_new_tokens: int, *,
             batch_size: int = 256, samples_to_print: int = 0, episodes: PlaysEpisodes | None = None,
             stop_strings: tuple[str, ...] = (),
             keep: Callable[[list[Completion], list[float]], object] | None = None) -> dict[str, float]:
    """Greedy completions of every prompt; accuracy = fraction whose reward is >= 1 (exact).
    Every batch is submitted before any is collected, each shared among the engines. With
    `episodes`, greedy episodes instead (a batch at a time), rewarded by their environment.
    keep: given every sample and its reward (the run writes a few to its folder)."""
    greedy = SamplingConfig(max_new_tokens=max_new_tokens, temperature=0.0, stop_strings=stop_strings)
    extras: dict[str, float] = {}
    if episodes is not None:
        completions, rewards = [], []
        for start in range(0, len(prompts), batch_size):
            played, won = episodes.play(generator, prompts[start:start + batch_size], greedy)
            completions += played
            rewards += won
        extras = {**episodes.take_metrics(), "episode_turns_mean": sum(c.turns for c in completions) / len(completions),
                  **check_failures(completions, episodes.max_failed_fraction, "in the evaluation")}
    else:
        rollouts = [generator.submit(prompts[start:start + batch_size], greedy)
                    for start in range(0, len(prompts), batch_size)]
        completions = [c for rollout in rollouts for c in rollout.result()]
        rewards = scorer.score(completions)
        extras = scorer.take_metrics()  # the reward functions' own metrics, over the evaluation set
    if keep is not None:
        keep(completions, rewards)
    for c, r in list(zip(completions, rewards))[:samples_to_print]:
        info(f"  {c.prompt.text!r} -> {c.text!r} (answer {c.prompt.answer!r}, reward {r:g})")
    return {
        "accuracy": sum(r >= 1.0 for r in rewards) / len(rewards),
        "reward": sum(rewards) / len(rewards),
        "num_samples": float(len(rewards)),
        **extras,
    }
