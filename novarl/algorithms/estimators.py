"""Every advantage estimator behind one interface: a step's rewards -> one advantage per token.

An `AdvantageEstimator` takes `StepRewards` (the step's batch, one reward per sample, and where it
reads them the critic's values and each token's KL to the reference) and returns
`TokenAdvantages` ([N] advantages, and for PPO the critic's targets). The estimators of
advantages.py that give one advantage per sequence (grpo, rloo, reinforce_plus_plus) put it on
the sequence's tokens (`PerSequence`); REINFORCE++ with the KL in the reward and PPO's GAE work
per token. Reward and advantage clipping wrap any of them (`Clipped`). What an estimator reads
besides the rewards it declares (`reads_values`, `reads_kl`): the trainer's stages compute those
first (trainer/stages.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import torch

from novarl.algorithms.advantages import (ADVANTAGE_ESTIMATORS, AdvantageSettings, GAESettings, ppo_advantages,
                                          reinforce_plus_plus_with_kl)
from novarl.types import TrainBatch


@dataclass(frozen=True)
class StepRewards:
    """What an estimator may read of a step."""

    batch: TrainBatch
    """The step's samples: their layout (sequence_index, position_ids, loss_mask)."""
    rewards: torch.Tensor
    """[S] one reward per sample, grouped by prompt (num_generations_per_prompt a group)."""
    values: torch.Tensor | None = None
    """[N] the critic's value of each token before the update (PPO)."""
    token_kl: torch.Tensor | None = None
    """[N] each loss token's KL of the policy to the reference (loss_fn.use_kl_in_reward)."""
    episodes: torch.Tensor | None = None
    """[S] the sample (index in rewards) each sequence of the batch belongs to, where a sample is
    several sequences (an agent's rewritten history: rollout/batch.py with_segments); None: one each.
    Per-sequence estimators only (trains_segments)."""


@dataclass(frozen=True)
class TokenAdvantages:
    advantages: torch.Tensor
    """[N] float32, one per token of the batch (0 off the loss tokens where the estimator says so)."""
    returns: torch.Tensor | None = None
    """[N] the critic's targets (PPO), else None."""


class AdvantageEstimator(Protocol):
    """A step's rewards -> per-token advantages."""

    @property
    def reads_values(self) -> bool:
        """It needs StepRewards.values: the critic's forward runs first."""
        ...

    @property
    def reads_kl(self) -> bool:
        """It needs StepRewards.token_kl: the policy's and the reference's forwards run first."""
        ...

    def __call__(self, step: StepRewards) -> TokenAdvantages: ...


@dataclass(frozen=True)
class PerSequence:
    """grpo, rloo or reinforce_plus_plus (advantages.py, by name): one advantage per sequence,
    weighing each sequence by its loss tokens where the estimator does, on each of its tokens.
    With kl_coef (REINFORCE++ only, loss_fn.use_kl_in_reward): each token's return less kl_coef x
    its KL to the reference, whitened over the step's loss tokens."""

    name: str
    group_size: int
    settings: AdvantageSettings
    kl_coef: float | None = None

    @property
    def reads_values(self) -> bool:
        return False

    @property
    def reads_kl(self) -> bool:
        return self.kl_coef is not None

    def __call__(self, step: StepRewards) -> TokenAdvantages:
        batch = step.batch
        if self.kl_coef is not None:
            assert step.token_kl is not None and step.episodes is None  # reads_kl: the stages computed it
            return TokenAdvantages(reinforce_plus_plus_with_kl(step.rewards, self.group_size, self.settings,
                                                               step.token_kl, batch.sequence_index, batch.loss_mask,
                                                               self.kl_coef))
        estimate = ADVANTAGE_ESTIMATORS.get(self.name)
        tokens = batch.sequence_sum(batch.loss_mask.long())
        if step.episodes is None:
            return TokenAdvantages(estimate(step.rewards, self.group_size, self.settings, tokens)[batch.sequence_index])
        episodes = step.episodes.to(tokens.device)  # a sample's loss tokens: its sequences' together
        per_sample = estimate(step.rewards, self.group_size, self.settings,
                              torch.zeros(len(step.rewards), dtype=tokens.dtype, device=tokens.device)
                              .index_add_(0, episodes, tokens))
        return TokenAdvantages(per_sample[episodes][batch.sequence_index])


@dataclass(frozen=True)
class GeneralizedAdvantages:
    """PPO's GAE over each completion with the critic's values (advantages.py ppo_advantages):
    the advantages and the critic's targets. With kl_coef > 0 and the KL read
    (loss_fn.use_kl_in_reward), kl_coef x each token's KL comes off its reward."""

    settings: GAESettings
    kl_coef: float = 0.0
    reads_kl: bool = False

    @property
    def reads_values(self) -> bool:
        return True

    def __call__(self, step: StepRewards) -> TokenAdvantages:
        batch = step.batch
        assert step.values is not None and step.episodes is None  # reads_values: the stages computed them
        mask = batch.to_rows(batch.loss_mask.cpu()).bool()
        kl = batch.to_rows(step.token_kl.float().cpu()) if step.token_kl is not None else None
        advantages, returns = ppo_advantages(step.rewards, batch.to_rows(step.values.float().cpu()), mask,
                                             self.settings, kl, self.kl_coef)
        where = batch.sequence_index.cpu(), batch.position_ids.cpu()
        return TokenAdvantages(advantages[where], returns[where])


@dataclass(frozen=True)
class Clipped:
    """An estimator with the rewards clipped to +-reward_clip before it (ROLL's reward_clip) and
    its advantages clipped to [low, high] after it (NeMo RL's advantage_clip_low/high); None: no
    clip. The critic's targets are not clipped."""

    estimator: AdvantageEstimator
    reward_clip: float | None = None
    low: float | None = None
    high: float | None = None

    @property
    def reads_values(self) -> bool:
        return self.estimator.reads_values

    @property
    def reads_kl(self) -> bool:
        return self.estimator.reads_kl

    def __call__(self, step: StepRewards) -> TokenAdvantages:
        if self.reward_clip is not None:
            step = dataclasses.replace(step, rewards=step.rewards.clamp(-self.reward_clip, self.reward_clip))
        out = self.estimator(step)
        if self.low is not None or self.high is not None:
            out = dataclasses.replace(out, advantages=out.advantages.clamp(min=self.low, max=self.high))
        return out
