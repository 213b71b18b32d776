"""Advantage estimators: rewards of a step -> one advantage per sequence.

Rewards arrive flat, [N] with N = prompts x generations, grouped by prompt:
sequences g*G .. g*G+G-1 answer prompt g. Each estimator returns [N] float32.
"""

from __future__ import annotations

import torch

from novarl.algorithms.registry import Registry

ADVANTAGE_ESTIMATORS: Registry = Registry("advantage estimator", "grpo.advantage_estimator")


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    normalize_rewards: bool = True,
    use_leave_one_out_baseline: bool = False,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Group-relative advantages (GRPO).

    baseline: the group's mean reward, or with `use_leave_one_out_baseline` the
    mean of the other G-1 rewards (RLOO). With `normalize_rewards` the centred
    reward is divided by the group's standard deviation (unbiased, + eps). A group
    whose rewards are all equal gets advantage 0: it carries no signal.
    """
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of {group_size}")
    grouped = rewards.float().view(-1, group_size)
    if use_leave_one_out_baseline and group_size > 1:
        baseline = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    else:
        baseline = grouped.mean(dim=1, keepdim=True)
    centred = grouped - baseline
    if normalize_rewards and group_size > 1:
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)
