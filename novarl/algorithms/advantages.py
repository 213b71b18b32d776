"""Advantage estimators: rewards of a step -> one advantage per sequence.

Rewards arrive flat, [S] with S = prompts x generations, grouped by prompt:
sequences g*G .. g*G+G-1 answer prompt g. Each estimator takes the rewards, the
group size and `AdvantageSettings` (NeMo RL's `grpo.adv_estimator` keys), and the
number of loss tokens of each sequence ([S], for estimators that weigh sequences by
their tokens), and returns [S] float32 advantages, each repeated over its sequence's
tokens by the trainer.

Names are NeMo RL's (`grpo`, `reinforce_plus_plus`) where it has them, verl's
(`rloo`) where it does not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from novarl.algorithms.registry import Registry

ADVANTAGE_ESTIMATORS: Registry = Registry("advantage estimator", "grpo.adv_estimator.name")


@dataclass(frozen=True)
class AdvantageSettings:
    normalize_rewards: bool = True
    """grpo: divide group-centred rewards by the group's standard deviation."""
    use_leave_one_out_baseline: bool = False
    """grpo: the baseline of a sample is the mean of the other G-1 rewards of its group."""
    minus_baseline: bool = True
    """reinforce_plus_plus: subtract the group's mean reward before normalising over the batch."""
    eps: float = 1e-6


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of {group_size}")
    return rewards.float().view(-1, group_size)


def group_baseline(grouped: torch.Tensor, leave_one_out: bool) -> torch.Tensor:
    """[P, G] per-sample baselines: the group's mean, or the mean of the other G-1 rewards."""
    group_size = grouped.shape[1]
    if leave_one_out and group_size > 1:
        return (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    return grouped.mean(dim=1, keepdim=True).expand_as(grouped)


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo_advantages(rewards: torch.Tensor, group_size: int, settings: AdvantageSettings = AdvantageSettings(),
                    token_counts: torch.Tensor | None = None) -> torch.Tensor:
    """Group-relative advantages (GRPO).

    baseline: the group's mean reward, or with `use_leave_one_out_baseline` the
    mean of the other G-1 rewards (RLOO). With `normalize_rewards` the centred
    reward is divided by the group's standard deviation (unbiased, + eps). A group
    whose rewards are all equal gets advantage 0: it carries no signal.
    """
    grouped = _grouped(rewards, group_size)
    centred = grouped - group_baseline(grouped, settings.use_leave_one_out_baseline)
    if settings.normalize_rewards and group_size > 1:
        centred = centred / (grouped.std(dim=1, keepdim=True) + settings.eps)
    return centred.reshape(-1)


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo_advantages(rewards: torch.Tensor, group_size: int, settings: AdvantageSettings = AdvantageSettings(),
                    token_counts: torch.Tensor | None = None) -> torch.Tensor:
    """REINFORCE leave-one-out (verl's `rloo`): each reward minus the mean of the other G-1
    rewards of its group, not normalised."""
    grouped = _grouped(rewards, group_size)
    if group_size < 2:
        raise ValueError("rloo needs at least 2 generations per prompt (grpo.num_generations_per_prompt)")
    return (grouped - group_baseline(grouped, leave_one_out=True)).reshape(-1)


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus")
def reinforce_plus_plus_advantages(rewards: torch.Tensor, group_size: int,
                                   settings: AdvantageSettings = AdvantageSettings(),
                                   token_counts: torch.Tensor | None = None) -> torch.Tensor:
    """REINFORCE++ (NeMo RL's `reinforce_plus_plus`): the reward, minus the group's mean with
    `minus_baseline` (REINFORCE++-baseline), then normalised over the whole step: zero mean and
    unit variance over its loss tokens (each sequence weighs as many tokens as it trains;
    token_counts [S], all 1 when not given), the variance floored at 1e-8."""
    advantages = reinforce_returns(rewards, group_size, settings)
    return whiten(advantages, torch.ones_like(advantages) if token_counts is None else token_counts.float())


def reinforce_returns(rewards: torch.Tensor, group_size: int, settings: AdvantageSettings) -> torch.Tensor:
    """[S] REINFORCE++'s returns before the step's normalisation: the reward, minus its group's
    mean with minus_baseline."""
    grouped = _grouped(rewards, group_size)
    return (grouped - group_baseline(grouped, False) if settings.minus_baseline else grouped).reshape(-1)


def whiten(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Zero mean and unit variance under `weights` (a count or a 0/1 mask per value), the variance
    floored at 1e-8: all equal values become 0."""
    total = weights.sum().clamp(min=1)
    mean = (values * weights).sum() / total
    variance = ((values - mean) ** 2 * weights).sum() / total
    return (values - mean) * variance.clamp(min=1e-8).rsqrt()


def reinforce_plus_plus_with_kl(rewards: torch.Tensor, group_size: int, settings: AdvantageSettings,
                                token_kl: torch.Tensor, sequence_index: torch.Tensor, loss_mask: torch.Tensor,
                                kl_coef: float) -> torch.Tensor:
    """[N] per-token REINFORCE++ advantages with the KL in the reward (loss_fn.use_kl_in_reward):
    each token's return (its sequence's, see reinforce_returns) minus kl_coef x its KL to the
    reference (token_kl [N]), whitened over the step's loss tokens (loss_mask [N]).
    sequence_index [N]: the sequence of each token."""
    returns = reinforce_returns(rewards, group_size, settings)[sequence_index] - kl_coef * token_kl
    return whiten(returns, loss_mask.float()) * loss_mask


def gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
        lam: float | torch.Tensor = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over rows of completion tokens (PPO with a critic).

    token_rewards, values, mask: [S, T], a row per sequence, its completion's tokens contiguous
    (mask False before and after them: a prompt, padding). values[s, t]: the critic's estimate
    before token t. Per row:
        delta_t = r_t + gamma v_{t+1} - v_t   (v after the last token: 0)
        A_t = delta_t + gamma lam A_{t+1}
    lam: one lambda, or one per row [S] (VAPO's length-adaptive lambda).
    Returns (advantages, returns = advantages + values), [S, T] float32, 0 where mask is False."""
    lam = torch.as_tensor(lam, dtype=torch.float32, device=values.device)
    if not bool(((lam >= 0) & (lam <= 1)).all()) or not 0 <= gamma <= 1:
        raise ValueError(f"GAE needs gamma and lambda in [0, 1] (gamma={gamma}, lambda={lam.tolist()})")
    mask = mask.float()
    rewards, values = token_rewards.float() * mask, values.float() * mask
    advantages = torch.zeros_like(values)
    running = torch.zeros(values.shape[0], dtype=values.dtype, device=values.device)
    next_value = torch.zeros_like(running)
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = (delta + gamma * lam * running) * mask[:, t]
        advantages[:, t] = running
        next_value = values[:, t]
    return advantages, (advantages + values) * mask


@dataclass(frozen=True)
class GAESettings:
    """NeMo RL's grpo.adv_estimator keys for name: gae (PPO with a critic)."""

    gamma: float = 1.0
    lam: float = 0.95
    lam_value: float | None = None
    """VAPO's decoupled GAE: the lambda of the critic's returns; None: lam."""
    lam_policy: float | None = None
    """The lambda of the policy's advantages; None: lam."""
    length_adaptive_alpha: float = 0.0
    """VAPO: the policy's lambda for a completion of l tokens is 1 - 1/(alpha l); 0: off."""
    normalize: bool = True
    """Whiten the advantages over the loss tokens."""


def terminal_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[S, T] each row's reward (rewards [S]) on its last token where mask [S, T] is True, 0
    elsewhere (a row without such a token gets none)."""
    last = mask.shape[1] - 1 - mask.long().flip(1).argmax(dim=1)
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    rows = mask.any(dim=1).nonzero().view(-1)
    out[rows, last[rows]] = rewards.float().to(mask.device)[rows]
    return out


def ppo_advantages(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, settings: GAESettings,
                   token_kl: torch.Tensor | None = None, kl_coef: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's advantages and the critic's targets, NeMo RL's GAE estimator (`gae`): each completion's
    reward on its last token, minus kl_coef x each token's KL to the reference when given
    (loss_fn.use_kl_in_reward; token_kl [S, T]), then GAE with the critic's values [S, T] over
    the completion tokens (mask [S, T]). With a decoupled lambda (lam_value, lam_policy or the
    length-adaptive one) GAE runs twice: returns with lam_value, advantages with the policy's.
    The advantages are whitened over the mask with `normalize`. Returns (advantages, returns)
    [S, T], 0 where mask is False."""
    token_rewards = terminal_rewards(rewards, mask)
    if token_kl is not None:
        token_rewards = token_rewards - kl_coef * token_kl.float() * mask
    lam_value = settings.lam if settings.lam_value is None else settings.lam_value
    if settings.length_adaptive_alpha > 0:
        lengths = mask.float().sum(dim=1)
        lam_policy = (1 - 1 / (settings.length_adaptive_alpha * lengths).clamp(min=1)).clamp(0, 1)
    else:
        lam_policy = settings.lam if settings.lam_policy is None else settings.lam_policy
    advantages, returns = gae(token_rewards, values, mask, settings.gamma, lam_value)
    if not isinstance(lam_policy, float) or lam_policy != lam_value:
        advantages, _ = gae(token_rewards, values, mask, settings.gamma, lam_policy)
    if settings.normalize:
        advantages = whiten(advantages, mask.float()) * mask
    return advantages, returns
