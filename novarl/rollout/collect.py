"""A step's rollouts: prompts -> completions -> rewards, scaled and shaped (NeMo RL's order),
and with DAPO's dynamic sampling, the groups that carry a signal gathered over several
generation rounds until the step is full."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from novarl.algorithms.shaping import difficulty_mask, groups_with_signal, scale_rewards, shape_rewards
from novarl.config.schema import NovaRLConfig
from novarl.errors import RunFailed
from novarl.rollout.environment import episode_environment
from novarl.rollout.episodes import check_failures, neutral_rewards
from novarl.rollout.batch import rollout_metrics
from novarl.types import Completion, Prompt, SamplingConfig

ROUND_SEED_STRIDE = 1_000_003
"""Round r of a step samples with seed grpo.seed + step + r x this (round 0: as without rounds)."""


@dataclass
class Rollouts:
    completions: list[Completion]
    """[S] the samples to train on, GRPO groups whole and consecutive."""
    rewards: torch.Tensor
    """[S] float32 their rewards, scaled and shaped: what the advantages are computed from."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Over everything generated this step: the task's rewards (reward_mean, ...), lengths,
    reward_shaped_mean when scaling or shaping is on, and dynamic sampling's counts."""
    trained: torch.Tensor | None = None
    """[S] bool: the samples that get a loss (grpo.difficulty_mask); None: all."""
    weights: torch.Tensor | None = None
    """[S] float32 each sample's policy-loss weight (grpo.difficulty_loss_weight); None: 1 each."""
    positive: torch.Tensor | None = None
    """[S] bool the samples whose reward (scaled and shaped, as NeMo RL's PPO reads it) is > 0: VAPO's
    NLL term trains on them (loss_fn.positive_example_nll_weight); None: no such term."""

    @classmethod
    def of(cls, cfg: NovaRLConfig, completions: list[Completion], raw: torch.Tensor, shaped: torch.Tensor,
           metrics: dict[str, float]) -> "Rollouts":
        """The samples with their shaped rewards; with grpo.difficulty_mask, those whose group's mean
        task reward (`raw`) is outside its thresholds marked untrained (difficulty_mask_ratio: the share kept);
        with VAPO's NLL term, the correct ones (`shaped` > 0) marked positive."""
        mask = cfg.grpo.difficulty_mask
        weights = difficulty_weights(completions) if cfg.grpo.difficulty_loss_weight else None
        positive = shaped > 0 if cfg.loss_fn.positive_example_nll_weight > 0 else None
        if not mask.enabled or cfg.grpo.num_generations_per_prompt <= 1:
            return cls(completions, shaped, metrics, weights=weights, positive=positive)
        trained = difficulty_mask(raw, cfg.grpo.num_generations_per_prompt, mask.low_threshold, mask.high_threshold)
        metrics["difficulty_mask_ratio"] = float(trained.float().mean())
        return cls(completions, shaped, metrics, trained, weights, positive)


def difficulty_weights(completions: list[Completion]) -> torch.Tensor:
    """[S] ROLL's difficulty loss weights: 0.5 + 1.5 x the example's `difficulty` (clamped to [0, 1]),
    scaled to mean 1; a UserError naming a value that is not a number."""
    from novarl.errors import UserError

    values = []
    for c in completions:
        given = c.prompt.columns.get("difficulty")
        try:
            values.append(float(given))  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise UserError(f"grpo.difficulty_loss_weight reads each example's 'difficulty' column as a number; "
                            f"an example has {given!r} (prompt {c.prompt.text[:80]!r}).") from None
    weights = 0.5 + 1.5 * torch.tensor(values, dtype=torch.float32).clamp(0.0, 1.0)
    return weights * (len(weights) / weights.sum())


class DynamicSamplingExhausted(RunFailed):
    """Dynamic sampling did not find enough groups with a signal within its rounds."""


def collect(cfg: NovaRLConfig, inputs, roles, step: int, timer) -> Rollouts:
    """Generate and score the step's samples. Without dynamic sampling: one round of
    grpo.num_prompts_per_step prompts. With it: rounds of num_prompts_per_step x batch_multiplier
    prompts, keeping the groups whose (unshaped) rewards differ, until num_prompts_per_step are
    kept (the first ones, in order); more than dynamic_sampling_max_gen_batches rounds stop the run."""
    grpo = cfg.grpo
    group, wanted = grpo.num_generations_per_prompt, grpo.num_prompts_per_step
    if not grpo.use_dynamic_sampling:
        completions, raw, _, shaped = _round(cfg, inputs, roles, step, 0, wanted, timer)
        return Rollouts.of(cfg, completions, raw, shaped, round_metrics(cfg, completions, raw, shaped))
    kept: list[Completion] = []
    kept_rewards: list[torch.Tensor] = []
    kept_raw: list[torch.Tensor] = []
    generated: list[Completion] = []
    generated_rewards: dict[str, list[torch.Tensor]] = {"raw": [], "shaped": []}
    per_round = math.ceil(wanted * grpo.batch_multiplier)
    rounds = 0
    while len(kept) < wanted * group:
        if rounds == grpo.dynamic_sampling_max_gen_batches:
            raise DynamicSamplingExhausted(
                f"dynamic sampling found {len(kept) // group} of the {wanted} prompt groups it needs (groups whose "
                f"rewards are not all equal) in {rounds} generation rounds of {per_round} prompts at step {step} "
                "(grpo.dynamic_sampling_max_gen_batches). The task may be too easy or too hard for the model: "
                "raise dynamic_sampling_max_gen_batches or batch_multiplier, or turn grpo.use_dynamic_sampling off.")
        completions, raw, scaled, shaped = _round(cfg, inputs, roles, step, rounds, per_round, timer)
        rounds += 1
        generated += completions
        generated_rewards["raw"].append(raw)
        generated_rewards["shaped"].append(shaped)
        # the signal is judged before shaping (NeMo RL's rule): a length penalty alone is not a task signal
        for g in groups_with_signal(scaled, group).nonzero().view(-1).tolist():
            kept += completions[g * group:(g + 1) * group]
            kept_rewards.append(shaped[g * group:(g + 1) * group])
            kept_raw.append(raw[g * group:(g + 1) * group])
    metrics = round_metrics(cfg, generated, torch.cat(generated_rewards["raw"]), torch.cat(generated_rewards["shaped"]))
    metrics.update(dynamic_sampling_rounds=float(rounds), groups_kept=float(len(kept) // group),
                   samples_discarded=float(len(kept) - wanted * group))
    return Rollouts.of(cfg, kept[:wanted * group], torch.cat(kept_raw)[:wanted * group],
                       torch.cat(kept_rewards)[:wanted * group], metrics)


def round_metrics(cfg: NovaRLConfig, completions: list[Completion], raw: torch.Tensor, shaped: torch.Tensor
             ) -> dict[str, float]:
    metrics = rollout_metrics(completions, raw, cfg.grpo.num_generations_per_prompt)
    if cfg.grpo.reward_scaling.enabled or cfg.grpo.reward_shaping.enabled:
        metrics["reward_shaped_mean"] = float(shaped.mean())
    if episode_environment(cfg) is not None:
        metrics["episode_turns_mean"] = sum(c.turns for c in completions) / len(completions)
        metrics["observation_tokens_mean"] = sum(b - a for c in completions for a, b in c.observed) / len(completions)
        metrics["episodes_failed_fraction"] = sum(c.failed is not None for c in completions) / len(completions)
        sampled = sum(len(c.token_ids) - sum(b - a for a, b in c.observed) for c in completions)
        metrics["sampled_tokens_per_turn_mean"] = sampled / max(sum(c.turns for c in completions), 1)
    return metrics


def _round(cfg: NovaRLConfig, inputs, roles, step: int, round_index: int, prompts_count: int, timer
           ) -> tuple[list[Completion], torch.Tensor, torch.Tensor, torch.Tensor]:
    """One generation round: (completions, the task's rewards, scaled, scaled and shaped). With an
    environment (inputs.episodes), each prompt is an episode of up to grpo.max_rollout_turns
    turns (rollout/episodes.py) and its reward the environment's."""
    prompts, sampling = draw_round(cfg, inputs, step, round_index, prompts_count)
    if inputs.episodes is None:
        with timer("generation"):
            completions = roles.generator.submit(prompts, sampling).result()
        return (completions, *score_round(cfg, inputs, completions))
    with timer("generation"):  # the environment's steps included
        completions, rewards = inputs.episodes.play(roles.generator, prompts, sampling)
    return (completions, *episode_rewards(cfg, inputs, completions, rewards, step))


def episode_rewards(cfg: NovaRLConfig, inputs, completions: list[Completion], rewards: list[float], step: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the environment's rewards, scaled, scaled and shaped) of a round's episodes: a failed one's
    neutral in its group (neutral_rewards); too many failed stop the run (check_failures)."""
    check_failures(completions, inputs.episodes.max_failed_fraction, f"at step {step}")
    rewards = neutral_rewards(completions, rewards, cfg.grpo.num_generations_per_prompt)
    return shape_round(cfg, completions, torch.tensor(rewards, dtype=torch.float32))


def draw_round(cfg: NovaRLConfig, inputs, step: int, round_index: int, prompts_count: int
               ) -> tuple[list[Prompt], SamplingConfig]:
    """The next prompts_count prompts of the sampler, each num_generations_per_prompt times, and the
    sampling of round `round_index` of `step` (its seed: grpo.seed + step + round x ROUND_SEED_STRIDE)."""
    grpo, gen = cfg.grpo, cfg.policy.generation
    prompts = [p for p in inputs.sampler.next_batch(prompts_count) for _ in range(grpo.num_generations_per_prompt)]
    sampling = SamplingConfig(max_new_tokens=gen.max_new_tokens, temperature=gen.temperature, top_p=gen.top_p,
                              top_k=gen.top_k, stop_token_ids=tuple(gen.stop_token_ids or ()),
                              stop_strings=tuple(gen.stop_strings or ()),
                              seed=grpo.seed + step + round_index * ROUND_SEED_STRIDE)
    return prompts, sampling


def score_round(cfg: NovaRLConfig, inputs, completions: list[Completion]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the task's rewards, scaled, scaled and shaped) of a round's completions."""
    return shape_round(cfg, completions, torch.tensor(inputs.scorer.score(completions), dtype=torch.float32))


def shape_round(cfg: NovaRLConfig, completions: list[Completion], raw: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the task's rewards, scaled, scaled and shaped) of a round's completions and their rewards."""
    grpo, gen = cfg.grpo, cfg.policy.generation
    scaled = scale_rewards(raw, grpo.reward_scaling)
    lengths = torch.tensor([len(c.token_ids) for c in completions])
    truncated = torch.tensor([c.finish_reason == "length" for c in completions])
    shaped = shape_rewards(scaled, lengths, truncated, grpo.reward_shaping, gen.max_new_tokens)
    return raw, scaled, shaped

