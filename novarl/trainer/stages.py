"""A step's work after generation, as stages: old logprobs -> reference -> values -> advantages
-> updates (each pass: the critic's, then the actor's).

Each stage is present when its role is (`build_stages`): no reference without a KL penalty, no
values or critic update without a critic, no separate old-logprob forward where the training
forward gives them. Every advantage estimator is one `AdvantageEstimator`
(algorithms/estimators.py) returning per-token advantages; each update has its own loss and
settings (the actor's loss_fn, the critic's value_loss_fn). GRPO, REINFORCE++, RLOO, DAPO and PPO
are choices of estimator, loss and roles, not separate loops."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

import torch

from novarl.algorithms.advantages import ADVANTAGE_ESTIMATORS, AdvantageSettings, GAESettings
from novarl.algorithms.estimators import (AdvantageEstimator, Clipped, GeneralizedAdvantages, PerSequence,
                                          StepRewards)
from novarl.algorithms.losses import ClippedPGSettings, LossFn, ValueLossSettings, aggregation, clamped_kl, value_loss
from novarl.backends.protocols import ReferenceBackend, TrainingBackend
from novarl.config.schema import NovaRLConfig
from novarl.models.scores import Head, Logprobs, Values
from novarl.rollout.batch import logprob_mismatch
from novarl.trainer.setup import Roles, RunInputs, critic_global_batch_size
from novarl.types import TrainBatch


@dataclass
class StepWork:
    """What a step's stages read and write."""

    batch: TrainBatch
    """The step's samples; the stages fill in its old and reference logprobs, advantages, returns."""
    rewards: torch.Tensor
    """[S] one reward per sample."""
    policy_trains: bool = True
    """False during the critic's warm-up (grpo.policy_training_start_step)."""
    values: torch.Tensor | None = None
    """[N] the critic's values before the update."""
    weights: torch.Tensor | None = None
    """[S] each sample's policy-loss weight (grpo.difficulty_loss_weight): its advantages are scaled by it
    (the clipped objective is linear in a positive scale of the advantage); None: 1 each."""
    episodes: torch.Tensor | None = None
    """[sequences] the sample each sequence of the batch belongs to, where a sample is several (an
    agent's rewritten history, trains_segments); None: one sequence a sample."""
    flagged: dict[str, torch.Tensor] = field(default_factory=dict)
    """[N] bool by what was wrong: the tokens of the turns found wrong (rollout/batch.py flagged_turns)."""
    metrics: dict[str, float] = field(default_factory=dict)


class Stage(Protocol):
    phase: str | None
    """The step's timer phase it counts in (time_<phase>), None: not timed."""

    def __call__(self, work: StepWork) -> None: ...


def policy_head(cfg: NovaRLConfig) -> Logprobs:
    """The policy's and the reference's head: logprobs at the sampling temperature, so that the
    loss's ratio is between the distributions the engines sampled from."""
    return Logprobs(cfg.policy.generation.temperature)


def advantage_estimator(cfg: NovaRLConfig) -> AdvantageEstimator:
    """grpo.adv_estimator as one estimator: GAE with a critic, else the named per-sequence one
    (REINFORCE++ with the KL in the reward where loss_fn.use_kl_in_reward); the rewards clipped
    to +-grpo.reward_clip first and the advantages to [advantage_clip_low, advantage_clip_high]."""
    grpo, estimator, loss = cfg.grpo, cfg.grpo.adv_estimator, cfg.loss_fn
    kl_coef = loss.reference_policy_kl_penalty
    inner: AdvantageEstimator
    if cfg.value is not None:
        inner = GeneralizedAdvantages(
            GAESettings(gamma=estimator.gae_gamma, lam=estimator.gae_lambda, lam_value=estimator.gae_lambda_value,
                        lam_policy=estimator.gae_lambda_policy, length_adaptive_alpha=estimator.length_adaptive_alpha,
                        normalize=estimator.normalize_advantages),
            kl_coef=kl_coef, reads_kl=loss.use_kl_in_reward)
    else:
        ADVANTAGE_ESTIMATORS.get(estimator.name)  # a name it does not know: refused before the first step
        settings = AdvantageSettings(normalize_rewards=grpo.normalize_rewards,
                                     use_leave_one_out_baseline=grpo.use_leave_one_out_baseline,
                                     minus_baseline=estimator.minus_baseline)
        inner = PerSequence(estimator.name, grpo.num_generations_per_prompt, settings,
                            kl_coef if loss.use_kl_in_reward else None)
    return Clipped(inner, grpo.reward_clip, grpo.advantage_clip_low, grpo.advantage_clip_high)


def trains_segments(cfg: NovaRLConfig) -> bool:
    """Whether an agent's earlier segments (Completion.segments) train, each as a sequence with its
    episode's advantage: with a per-sequence estimator (GRPO, RLOO, REINFORCE++ without the KL in the
    reward). GAE and the KL in the reward are per token over one sequence: the last segment alone."""
    return cfg.value is None and not cfg.loss_fn.use_kl_in_reward


def one_forward_fewer(cfg: NovaRLConfig, inputs: RunInputs) -> bool:
    """The old logprobs come from the training forward (detached) when the generated batch gets
    exactly one optimizer step: the policy has not changed since it generated (synchronous
    GRPO), so a separate forward before training would compute the same numbers. Not where the
    advantages need them first (the KL in the reward, PPO), nor where sequences are masked by them
    before training (grpo.seq_logprob_error_threshold)."""
    return inputs.batches.optimizer_steps_per_step == 1 and cfg.grpo.ppo_epochs == 1 \
        and not cfg.loss_fn.use_kl_in_reward and cfg.value is None and cfg.grpo.seq_logprob_error_threshold is None


# ------------------------------------------------------------------ the forwards
@dataclass
class OldLogprobs:
    """The policy's logprobs before the update (the ratio's pi_old); skipped where the training
    forward gives them (one_forward_fewer) and the policy trains this step (the loss then measures
    the weight sync's check). With them, the check (logprob_mismatch) over every sequence, before any
    stage masks some."""

    policy: TrainingBackend
    head: Head
    from_training_forward: bool
    phase: str | None = "logprobs"

    def __call__(self, work: StepWork) -> None:
        if not self.from_training_forward or not work.policy_trains:
            work.batch.old_logprobs = self.policy.forward(work.batch, self.head)
            work.metrics.update(logprob_mismatch(work.batch))


@dataclass
class LogprobErrorMask:
    """NeMo RL's grpo.seq_logprob_error_threshold: a sequence whose mean over its loss tokens of
    exp(|log p_generator - log p_old|) (the engine's logprobs against the trainer's before the update)
    exceeds the threshold gets no loss this step, and the step's counts leave it out. Metrics (NeMo RL's
    names): that error's max, mean and min over the sequences with loss tokens, before and after the
    masking, how many were masked, and the share of those that were correct (reward >= 1)."""

    threshold: float
    phase: str | None = None

    def __call__(self, work: StepWork) -> None:
        batch = work.batch
        assert batch.old_logprobs is not None  # OldLogprobs ran its forward (one_forward_fewer is False)
        mask = batch.loss_mask
        error = torch.exp((batch.generator_logprobs - batch.old_logprobs).abs()) * mask
        tokens = batch.sequence_sum(mask.float())
        valid = tokens > 0
        per_sequence = batch.sequence_sum(error.float()) / tokens.clamp(min=1)
        masked = valid & (per_sequence > self.threshold)
        kept = valid & ~masked
        rewards = work.rewards if work.episodes is None else work.rewards[work.episodes]
        work.metrics.update(**_spread("seq_mult_prob_error", per_sequence[valid]),
                            **_spread("seq_mult_prob_error_after_mask", per_sequence[kept]),
                            num_masked_seqs_by_logprob_error=float(masked.sum()),
                            masked_correct_pct=float((rewards[masked.cpu()] >= 1).float().mean()) if masked.any()
                            else 0.0)
        if masked.any():
            batch.loss_mask = mask & ~masked.to(mask.device)[batch.sequence_index.to(mask.device)]
            batch.with_own_counts()


def _spread(name: str, values: torch.Tensor) -> dict[str, float]:
    """max_<name>, mean_<name>, min_<name> of `values` (0 each where there are none)."""
    if not values.numel():
        return {f"{kind}_{name}": 0.0 for kind in ("max", "mean", "min")}
    return {f"max_{name}": float(values.max()), f"mean_{name}": float(values.mean()),
            f"min_{name}": float(values.min())}


@dataclass
class ReferenceLogprobs:
    """The frozen reference's logprobs (the KL penalty, in the loss or in the reward)."""

    reference: ReferenceBackend
    head: Head
    phase: str | None = "logprobs"

    def __call__(self, work: StepWork) -> None:
        work.batch.reference_logprobs = self.reference.forward(work.batch, self.head)


@dataclass
class CriticValues:
    """The critic's value of each token before the update (PPO)."""

    critic: TrainingBackend
    phase: str | None = "logprobs"

    def __call__(self, work: StepWork) -> None:
        work.values = self.critic.forward(work.batch, Values()).float().cpu()


@dataclass
class Advantages:
    """The step's per-token advantages (and the critic's targets) from its estimator; with the KL
    in the reward, each loss token's KL to the reference first (loss_fn's estimator and clamps)."""

    estimator: AdvantageEstimator
    kl: ClippedPGSettings
    phase: str | None = None

    def __call__(self, work: StepWork) -> None:
        batch, token_kl = work.batch, None
        if self.estimator.reads_kl:
            assert batch.old_logprobs is not None and batch.reference_logprobs is not None  # the forwards ran
            token_kl = clamped_kl(batch.old_logprobs, batch.reference_logprobs, self.kl) * batch.loss_mask
            work.metrics["kl_to_reference"] = float(token_kl.sum() / batch.loss_mask.sum().clamp(min=1))
        out = self.estimator(StepRewards(batch, work.rewards, work.values, token_kl, work.episodes))
        weights = work.weights if work.weights is None or work.episodes is None else work.weights[work.episodes]
        batch.advantages = out.advantages if weights is None else \
            out.advantages * weights.to(out.advantages.device)[batch.sequence_index]
        if out.returns is not None:
            assert work.values is not None  # GAE read them
            batch.returns, batch.old_values = out.returns, work.values
            work.metrics.update(critic_metrics(batch, work.values, out.returns))


@dataclass
class AdvantageOverwrites:
    """NeMo RL's grpo.invalid_tool_call_advantage and malformed_thinking_advantage: the tokens of a turn
    found wrong (StepWork.flagged) get that advantage instead of the estimator's (a turn both invalid and
    malformed gets the invalid-tool-call one, as NeMo RL's order has it)."""

    values: dict[str, float]
    """What a turn was found wrong for ("malformed_thinking", "invalid_tool_call") -> its advantage, applied
    in this order (a later one wins)."""
    phase: str | None = None

    def __call__(self, work: StepWork) -> None:
        for flag, value in self.values.items():
            tokens = work.flagged.get(flag)
            if tokens is not None and bool(tokens.any()):
                advantages = work.batch.advantages
                work.batch.advantages = torch.where(tokens.to(advantages.device), torch.tensor(
                    value, dtype=advantages.dtype, device=advantages.device), advantages)


def critic_metrics(batch: TrainBatch, values: torch.Tensor, returns: torch.Tensor) -> dict[str, float]:
    """The critic before this step's update, over the loss tokens: its mean value, the returns'
    mean, and the variance of the returns it explains (1 - Var(R - V) / Var(R); NeMo RL's
    critic/explained_var)."""
    mask = batch.loss_mask.cpu()
    v, r = values[mask], returns[mask]
    if not len(r):
        return {}
    explained = 1 - float((r - v).var(unbiased=False)) / max(float(r.var(unbiased=False)), 1e-8)
    return {"critic/values_mean": float(v.mean()), "critic/returns_mean": float(r.mean()),
            "critic/explained_var": explained}


# ------------------------------------------------------------------ the updates
@dataclass
class Update:
    """One role's optimizer steps over the batch (train_on_batch), its metrics under `prefix`;
    the actor's skipped during the critic's warm-up."""

    role: TrainingBackend
    head: Head
    loss: LossFn
    global_batch_size: int
    prefix: str = ""
    actor: bool = True
    skip_zero_advantage: bool = False
    token_level: bool = True

    def __call__(self, work: StepWork) -> dict[str, float]:
        if self.actor and not work.policy_trains:
            return {}
        trained = train_on_batch(self.role, self.head, work.batch, self.loss, self.global_batch_size,
                                 skip_zero_advantage=self.skip_zero_advantage, token_level=self.token_level,
                                 episodes=work.episodes)
        return {f"{self.prefix}{name}": value for name, value in trained.items()}


@dataclass
class Updates:
    """grpo.ppo_epochs passes over the step's batch, each running the updates in order (the critic's
    first, as NeMo RL and verl do); metrics averaged over the passes, token counts added up,
    maxima (`_max`) the largest."""

    updates: list[Update]
    epochs: int
    phase: str | None = "training"

    def __call__(self, work: StepWork) -> None:
        passes = []
        for _ in range(self.epochs):
            metrics: dict[str, float] = {}
            for update in self.updates:
                metrics.update(update(work))
            passes.append(metrics)
        averaged = {name: max(p[name] for p in passes) if name.endswith("_max")
                    else sum(p[name] for p in passes) / (1 if "tokens_" in name else len(passes)) for name in passes[0]}
        work.metrics = {**averaged, **work.metrics}  # the step's own (the KL in the reward's) over the loss's


def build_stages(cfg: NovaRLConfig, inputs: RunInputs, roles: Roles, loss_fn: LossFn) -> list[Stage]:
    """The run's stages, in order, each present when its role is."""
    head, estimator, loss = policy_head(cfg), advantage_estimator(cfg), cfg.loss_fn
    stages: list[Stage] = [OldLogprobs(roles.policy, head, one_forward_fewer(cfg, inputs))]
    if cfg.grpo.seq_logprob_error_threshold is not None:
        stages.append(LogprobErrorMask(cfg.grpo.seq_logprob_error_threshold))
    if roles.reference is not None:
        stages.append(ReferenceLogprobs(roles.reference, head))
    updates = []
    if roles.critic is not None:
        stages.append(CriticValues(roles.critic))
        settings = ValueLossSettings(scale=cfg.value_loss_fn.scale, cliprange=cfg.value_loss_fn.cliprange)
        updates.append(Update(roles.critic, Values(), partial(value_loss, settings=settings),
                              critic_global_batch_size(cfg, inputs), prefix="critic/", actor=False))
    kl = ClippedPGSettings(kl_estimator=loss.kl_estimator, kl_input_clamp_value=loss.kl_input_clamp_value,
                           kl_output_clamp_value=loss.kl_output_clamp_value)
    stages.append(Advantages(estimator, kl))
    overwrites = {flag: value for flag, value in (("malformed_thinking", cfg.grpo.malformed_thinking_advantage),
                                                  ("invalid_tool_call", cfg.grpo.invalid_tool_call_advantage))
                  if value is not None}
    if overwrites:
        stages.append(AdvantageOverwrites(overwrites))
    updates.append(Update(roles.policy, head, loss_fn, inputs.batches.global_batch_size,
                          skip_zero_advantage=zero_advantage_trains_nothing(cfg),
                          token_level=aggregation(loss) == "token-mean"))
    stages.append(Updates(updates, cfg.grpo.ppo_epochs))
    return stages


def train_on_batch(role: TrainingBackend, head: Head, batch: TrainBatch, loss_fn: LossFn, global_batch_size: int, *,
                   skip_zero_advantage: bool = False, token_level: bool = True,
                   episodes: torch.Tensor | None = None) -> dict[str, float]:
    """One optimizer step of the role (the policy or the critic, its scores under `head`) per
    `global_batch_size` samples (a sample's sequences together: `episodes`, StepWork's); metrics
    averaged over those steps.
    skip_zero_advantage: leave out of each step the samples the loss gives no gradient (see
    `with_signal`); the step's loss divides by the same token count, so nothing changes but
    the compute, and the loss's metrics are means over the tokens trained on."""
    totals: dict[str, float] = {"samples_trained_fraction": 0.0}
    chunks = sample_chunks(len(batch), global_batch_size, episodes)
    for start, stop in chunks:
        chunk = batch.slice(start, stop).with_own_counts()
        trained, scale = with_signal(chunk, token_level) if skip_zero_advantage else (chunk, 1.0)
        metrics = role.forward_backward(trained, loss_fn, head)
        metrics = {name: value * scale if _mean_share(name) else value for name, value in metrics.items()}
        metrics.update(role.optim_step(), samples_trained_fraction=len(trained) / len(chunk))
        for name, value in metrics.items():  # counts add up, maxima are the largest, the rest is averaged
            if name.endswith("_max"):
                totals[name] = max(totals.get(name, value), value)
            else:
                totals[name] = totals.get(name, 0.0) + (value if name.startswith("tokens_") else value / len(chunks))
    return totals


def sample_chunks(sequences: int, size: int, episodes: torch.Tensor | None = None) -> list[tuple[int, int]]:
    """[start, stop) of each optimizer step's sequences: `size` samples each, a sample being one
    sequence, or the sequences `episodes` gives it (nondecreasing sample indices)."""
    if episodes is None:
        return [(start, min(start + size, sequences)) for start in range(0, sequences, size)]
    cuts = torch.searchsorted(episodes, torch.arange(0, int(episodes[-1]) + 1, size)).tolist() + [sequences]
    return list(zip(cuts[:-1], cuts[1:]))


def zero_advantage_trains_nothing(cfg: NovaRLConfig) -> bool:
    """A sample whose every advantage is 0 (a GRPO group whose rewards are all equal) adds 0 to
    the clipped policy loss and to its gradient, whatever its ratio, unless a KL penalty or VAPO's
    NLL term (which do not depend on the advantage) is part of the loss."""
    loss = cfg.loss_fn
    return loss.loss == "clipped_pg" and (loss.reference_policy_kl_penalty == 0 or loss.use_kl_in_reward) \
        and cfg.value is None and loss.positive_example_nll_weight == 0  # PPO's advantages are per token, rarely 0


def with_signal(chunk: TrainBatch, token_level: bool = True) -> tuple[TrainBatch, float]:
    """The samples of an optimizer step that give the loss a gradient (a non-zero advantage on
    a loss token), the step's counts kept; and the factor that turns the loss's metrics from
    shares of the step's mean into means over what was trained (by tokens or by sequences, as
    the loss averages). With none, one sample stays, so that the optimizer steps on gradients
    of 0 as it would have."""
    signal = chunk.sequence_sum(((chunk.advantages != 0) & chunk.loss_mask).long()) > 0
    kept = signal.nonzero().view(-1)
    if len(kept) == len(chunk):
        return chunk, 1.0
    trained = chunk.select(kept if len(kept) else torch.zeros(1, dtype=torch.long))
    tokens = int(trained.loss_mask.sum())
    sequences = int((trained.sequence_sum(trained.loss_mask.long()) > 0).sum())
    if token_level:
        return trained, chunk.global_valid_tokens / max(tokens, 1)
    return trained, chunk.global_valid_sequences / max(sequences, 1)


def _mean_share(name: str) -> bool:
    """A loss metric reported as a share of the step's mean (not the loss, a max or a count)."""
    return name != "loss" and not name.endswith("_max") and not name.startswith("tokens_")
