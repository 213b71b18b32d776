"""Rewards before the advantages: NeMo RL's reward scaling and reward shaping, pure functions
over a step's rewards [S] (in this order, as NeMo RL applies them), and DAPO's group filter."""

from __future__ import annotations

import torch

from novarl.config.schema import RewardScalingConfig, RewardShapingConfig


def scale_rewards(rewards: torch.Tensor, cfg: RewardScalingConfig) -> torch.Tensor:
    """grpo.reward_scaling: each reward clamped to [source_min, source_max], then mapped linearly
    onto [target_min, target_max]. Unchanged when not enabled."""
    if not cfg.enabled:
        return rewards
    clamped = rewards.float().clamp(cfg.source_min, cfg.source_max)
    return cfg.target_min + (clamped - cfg.source_min) / (cfg.source_max - cfg.source_min) * \
        (cfg.target_max - cfg.target_min)


def shape_rewards(rewards: torch.Tensor, completion_lengths: torch.Tensor, truncated: torch.Tensor,
                  cfg: RewardShapingConfig, max_new_tokens: int) -> torch.Tensor:
    """grpo.reward_shaping. With stop_properly_penalty_coef: the rewards of completions cut by the
    length limit (truncated [S] bool) multiplied by it. Otherwise DAPO's overlong penalty: a
    completion of L tokens (completion_lengths [S]) longer than E = max_response_length -
    overlong_buffer_length loses (L - E) / overlong_buffer_length x overlong_buffer_penalty.
    max_response_length None: max_new_tokens. Unchanged when not enabled."""
    if not cfg.enabled:
        return rewards
    rewards = rewards.float()
    if cfg.stop_properly_penalty_coef is not None:
        return torch.where(truncated, rewards * cfg.stop_properly_penalty_coef, rewards)
    expected = (cfg.max_response_length or max_new_tokens) - cfg.overlong_buffer_length
    excess = completion_lengths.float() - expected
    penalty = (-excess / cfg.overlong_buffer_length * cfg.overlong_buffer_penalty).clamp(max=0)
    return rewards + penalty


def difficulty_mask(rewards: torch.Tensor, group_size: int, low: float, high: float) -> torch.Tensor:
    """[S] bool: the samples whose group's mean task reward is strictly between `low` and `high`
    (ROLL's difficulty mask: the others, too easy or too hard, get no loss)."""
    mean = rewards.float().view(-1, group_size).mean(dim=1)
    return ((mean > low) & (mean < high)).repeat_interleave(group_size)


def groups_with_signal(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[P] bool: the prompt groups whose rewards are not all equal (DAPO's dynamic sampling keeps
    these; the others have advantage 0 under a group baseline and train nothing)."""
    grouped = rewards.float().view(-1, group_size)
    return (grouped != grouped[:, :1]).any(dim=1)
