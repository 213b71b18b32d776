"""Policy losses: (logprobs of a micro-batch, the micro-batch) -> (loss, metrics).

Contract for every loss: the returned loss is this micro-batch's share of the
step's loss, so that summing it over all micro-batches of all data-parallel
ranks gives the loss of the whole step. Token-level averaging therefore divides
by `batch.global_valid_tokens` (the step's loss-mask tokens), never by the
micro-batch's own count; the same holds for every metric returned, so metrics
are summed, not averaged, across micro-batches and ranks.

Losses are token-level: logprobs and every batch field are [n], the micro-batch's
tokens end to end (see novarl/types.py), whatever layout the backend computed them
in (packed, dynamically batched or padded). Per-sequence quantities are sums over
`batch.sequence_sum`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from novarl.algorithms.kl import KL_ESTIMATORS
from novarl.algorithms.registry import Registry
from novarl.types import TrainBatch

LossFn = Callable[[torch.Tensor, TrainBatch], tuple[torch.Tensor, dict[str, torch.Tensor]]]
POLICY_LOSSES: Registry = Registry("policy loss", "loss_fn.loss")


@dataclass(frozen=True)
class ClippedPGSettings:
    ratio_clip_min: float = 0.2
    ratio_clip_max: float = 0.2
    ratio_clip_c: float | None = None
    reference_policy_kl_penalty: float = 0.0
    kl_estimator: str = "k3"
    aggregation: str = "token-mean"
    """loss_fn.loss_agg_mode (see `_reduce`)."""
    aggregation_norm: int = 1
    """seq-mean-token-sum-norm's constant divisor (policy.generation.max_new_tokens)."""
    disable_ppo_ratio: bool = False
    use_importance_sampling_correction: bool = False
    truncation: str | None = None
    """loss_fn.truncated_importance_sampling_type: tis, icepop, seq-mask-tis (see importance_weights)."""
    truncation_max: float | None = None
    truncation_min: float | None = None
    sequence_level_importance_ratios: bool = False
    use_on_policy_kl_approximation: bool = False
    kl_input_clamp_value: float | None = None
    kl_output_clamp_value: float | None = None
    force_on_policy_ratio: bool = False
    """NeMo RL's: the ratio is 1 in value and the gradient of log p, never clipped (see policy_ratios)."""
    use_cispo: bool = False
    """CISPO: -sg(clipped ratio) A log p per token (see clipped_pg_loss)."""
    positive_example_nll_weight: float = 0.0
    """VAPO's mu: the weight of the correct samples' mean NLL (see positive_example_nll)."""


@POLICY_LOSSES.register("clipped_pg")
def clipped_pg_loss(
    logprobs: torch.Tensor, batch: TrainBatch, settings: ClippedPGSettings = ClippedPGSettings()
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO/GRPO clipped surrogate with an optional KL penalty to a reference.

    logprobs: [n] current policy logprobs (with grad). Per token t with
    ratio r = exp(logprobs - old_logprobs) and its advantage A (per token):
        loss_t = -min(r A, clip(r, 1 - ratio_clip_min, 1 + ratio_clip_max) A)
    with dual clipping (A < 0): loss_t = min(loss_t, -ratio_clip_c A); plus
    reference_policy_kl_penalty * KL_t when a reference is given. With
    disable_ppo_ratio (REINFORCE, NeMo RL's key) loss_t = -A log p_t, no ratio, no clip.
    With force_on_policy_ratio (NeMo RL's key) loss_t = -r A with r forced to 1 (see
    policy_ratios): the gradient is -A grad log p_t, unclipped, whatever disable_ppo_ratio and
    sequence_level_importance_ratios say; the importance weights then use this forward's
    logprobs as pi_old. With use_cispo (CISPO, MiniMax-M1) loss_t = -sg(clip(r, ...)) A log p_t: the
    clipped ratio, detached, weighs the REINFORCE gradient, so clipped tokens keep theirs.
    Aggregated over the step as `settings.aggregation` says (see `_reduce`); with
    positive_example_nll_weight mu (VAPO), plus mu x the correct samples' mean NLL
    (`positive_example_nll`, over their tokens whatever the aggregation, as NeMo RL's).
    """
    mask = batch.loss_mask.float()
    # None: the policy has not changed since generation and this is the batch's only optimizer
    # step, so the old logprobs are this forward's own, detached (one policy forward fewer);
    # a forced ratio takes them from this forward too (NeMo RL's), whatever the batch holds
    old_logprobs = logprobs.detach() if batch.old_logprobs is None or settings.force_on_policy_ratio \
        else batch.old_logprobs
    advantages = batch.advantages.float()
    log_ratio, ratio, clipped = policy_ratios(logprobs, old_logprobs, batch, settings)
    if settings.force_on_policy_ratio:
        token_loss = -ratio * advantages
    elif settings.use_cispo:
        token_loss = -advantages * clipped.detach() * logprobs
    elif settings.disable_ppo_ratio:
        token_loss = -advantages * logprobs
    else:
        token_loss = -torch.minimum(ratio * advantages, clipped * advantages)
    if settings.ratio_clip_c is not None:
        dual = torch.minimum(token_loss, -settings.ratio_clip_c * advantages)
        token_loss = torch.where(advantages < 0, dual, token_loss)
    is_metrics = {}
    if settings.use_importance_sampling_correction:
        # Correct for samples from a generator whose weights lag the policy's.
        weights, is_metrics = importance_weights(old_logprobs, batch, settings)
        token_loss = token_loss * weights

    kl = torch.zeros_like(token_loss)
    if settings.reference_policy_kl_penalty > 0 and batch.reference_logprobs is not None:
        kl = clamped_kl(logprobs, batch.reference_logprobs, settings)
        if settings.use_on_policy_kl_approximation:  # the samples came from the generator (NeMo RL's weight)
            kl = kl * torch.nan_to_num(torch.exp(logprobs - batch.generator_logprobs).detach(),
                                       nan=0.0, posinf=0.0, neginf=0.0)
        token_loss = token_loss + settings.reference_policy_kl_penalty * kl

    reduce = partial(_reduce, mask=mask, batch=batch, mode=settings.aggregation, norm=settings.aggregation_norm)
    # the metrics are means (over tokens, or per sequence then over sequences), whatever the loss sums
    mean = partial(_reduce, mask=mask, batch=batch,
                   mode="token-mean" if settings.aggregation == "token-mean" else "seq-mean-token-mean")
    with torch.no_grad():
        clipped_out = ((ratio - clipped).abs() > 1e-8).float()
        metrics = {
            "clip_fraction": mean(clipped_out),
            "ratio_mean": mean(ratio),
            "kl_to_old": mean(-log_ratio),
            "kl_to_reference": mean(kl),
            "approx_entropy": mean(approx_entropy(logprobs, batch)),
        }
        if batch.old_logprobs is None:  # the generator-vs-trainer check, from this forward
            metrics.update(mismatch_metrics(old_logprobs, batch))
        metrics.update(is_metrics)
    loss = reduce(token_loss)
    if settings.positive_example_nll_weight > 0:
        nll = positive_example_nll(logprobs, batch)
        metrics["nll_loss"] = nll.detach()
        loss = loss + settings.positive_example_nll_weight * nll
    metrics["loss"] = loss.detach()
    return loss, metrics


def positive_example_nll(logprobs: torch.Tensor, batch: TrainBatch) -> torch.Tensor:
    """VAPO's positive-example NLL: this micro-batch's share of the mean of -log p over the loss
    tokens of the step's correct samples (batch.positive), which divides by their count in the
    whole step (batch.global_positive_tokens; NeMo RL divides by the micro-batch's own count, so
    its term grows with the number of micro-batches). 0 (with a gradient of 0) without any."""
    positive = batch.positive_mask().float()
    return -(logprobs * positive).sum() / max(batch.global_positive_tokens, 1)


def policy_ratios(logprobs: torch.Tensor, old_logprobs: torch.Tensor, batch: TrainBatch,
                  settings: ClippedPGSettings) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[n] each (log_ratio, ratio, clipped ratio) of the micro-batch's tokens, 0 / 1 off the loss
    mask: ratio = exp(logprobs - old_logprobs), or with sequence_level_importance_ratios (GSPO)
    its sequence's mean log-ratio on each token; clipped to [1 - ratio_clip_min, 1 + ratio_clip_max].
    With force_on_policy_ratio (NeMo RL's ClippedPGLossFn) ratio = exp(logprobs - logprobs.detach()):
    1 in value, with the gradient of logprobs, and the clipped ratio is the ratio itself (no
    clipping, no sequence ratio): the update of a batch trained once by the policy that sampled
    it, without the numerical noise of a ratio of two forwards."""
    mask = batch.loss_mask.float()
    if settings.force_on_policy_ratio:
        log_ratio = (logprobs - logprobs.detach()) * mask
        ratio = torch.exp(log_ratio)
        return log_ratio, ratio, ratio
    log_ratio = (logprobs - old_logprobs) * mask
    if settings.sequence_level_importance_ratios:  # GSPO: the sequence's mean log-ratio on each token
        per_seq = batch.sequence_sum(log_ratio) / batch.sequence_sum(mask).clamp(min=1)
        log_ratio = per_seq[batch.sequence_index.to(per_seq.device)]
    ratio = torch.exp(log_ratio)
    return log_ratio, ratio, ratio.clamp(1 - settings.ratio_clip_min, 1 + settings.ratio_clip_max)


def importance_weights(old_logprobs: torch.Tensor, batch: TrainBatch, settings: ClippedPGSettings
                       ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """[n] detached importance weights pi_old / pi_generator of the micro-batch's tokens (NeMo RL's
    importance-sampling correction): per token exp(old - generator), or with
    sequence_level_importance_ratios each sequence's exp(sum over its loss tokens), on its tokens;
    inf and nan become 0. Truncated as settings.truncation says:
      tis           clamped to [truncation_min (0 if None), truncation_max];
      icepop        tokens whose weight is outside [truncation_min, truncation_max] get 0;
      seq-mask-tis  sequences whose geometric-mean ratio exp(mean log(old / generator)) is outside
                    it get 0 on every token; the others keep their token weights as they are.
    Metrics, as shares of the step's mean (summed over micro-batches): is_weight_mean (over loss
    tokens), is_weight_max, is_oob_ratio (the tokens, or for seq-mask-tis the sequences, out of
    bounds)."""
    mask = batch.loss_mask.float()
    raw = torch.where(batch.loss_mask, (old_logprobs - batch.generator_logprobs).detach().float(),
                      torch.zeros((), device=old_logprobs.device))
    index = batch.sequence_index.to(raw.device)
    # a non-finite ratio gets weight 0 (its sequence too, with sequence ratios), as in NeMo RL
    weights = torch.exp(batch.sequence_sum(raw))[index] if settings.sequence_level_importance_ratios \
        else torch.exp(raw)
    weights = torch.nan_to_num(weights, nan=0.0, posinf=0.0, neginf=0.0)
    log_ratio = torch.nan_to_num(raw, nan=0.0, posinf=0.0, neginf=0.0)  # for seq-mask-tis's geometric mean
    tokens = max(batch.global_valid_tokens, 1)
    metrics: dict[str, torch.Tensor] = {}
    high, low = settings.truncation_max, settings.truncation_min
    if settings.truncation == "tis":
        low = 0.0 if low is None else low
        metrics["is_oob_ratio"] = (((weights > high) | (weights < low)).float() * mask).sum() / tokens
        weights = weights.clamp(low, high)
    elif settings.truncation == "icepop":
        kept = (weights >= low) & (weights <= high)
        metrics["is_oob_ratio"] = ((~kept).float() * mask).sum() / tokens
        weights = torch.where(kept, weights, torch.zeros_like(weights))
    elif settings.truncation == "seq-mask-tis":
        counts = batch.sequence_sum(mask)
        geometric = torch.exp(batch.sequence_sum(log_ratio) / counts.clamp(min=1))
        kept = ((geometric >= low) & (geometric <= high)).float()
        has_tokens = (counts > 0).float()
        metrics["is_oob_ratio"] = ((1 - kept) * has_tokens).sum() / max(batch.global_valid_sequences, 1)
        weights = weights * kept[index]
    metrics["is_weight_mean"] = (weights * mask).sum() / tokens
    masked = weights * mask
    metrics["is_weight_max"] = masked.max() if masked.numel() else masked.sum()
    return weights, metrics


def clamped_kl(logprobs: torch.Tensor, reference_logprobs: torch.Tensor, settings: ClippedPGSettings) -> torch.Tensor:
    """The configured KL estimator, with NeMo RL's clamps: the log-ratio log q - log p to
    [-kl_input_clamp_value, kl_input_clamp_value] before the estimator (no gradient where it
    is clamped), the estimate to [-kl_output_clamp_value, kl_output_clamp_value] after."""
    if settings.kl_input_clamp_value is not None:
        bound = settings.kl_input_clamp_value
        reference_logprobs = logprobs + (reference_logprobs - logprobs).clamp(-bound, bound)
    kl = KL_ESTIMATORS.get(settings.kl_estimator)(logprobs, reference_logprobs)
    if settings.kl_output_clamp_value is not None:
        kl = kl.clamp(-settings.kl_output_clamp_value, settings.kl_output_clamp_value)
    return kl


def approx_entropy(logprobs: torch.Tensor, batch: TrainBatch) -> torch.Tensor:
    """[n] each token's share of the policy's entropy estimated from the sampled tokens (NeMo RL's
    approx_entropy): -(pi / pi_generator) log pi, whose mean over tokens the generator sampled is
    E_pi[-log pi], the entropy per token, without the logits over the vocabulary. 0 where the weight
    is not finite."""
    weight = torch.nan_to_num(torch.exp(logprobs.detach() - batch.generator_logprobs), nan=0.0, posinf=0.0)
    return -weight * logprobs.detach()


def mismatch_metrics(trainer_logprobs: torch.Tensor, batch: TrainBatch) -> dict[str, torch.Tensor]:
    """|p_generator / p_trainer - 1| over the loss tokens: this micro-batch's share of the step's
    mean ("logprob_mismatch", summed over micro-batches and ranks) and its max
    ("logprob_mismatch_max": a name ending in _max is reduced by max, see training/rows.py)."""
    error = (torch.exp(batch.generator_logprobs - trainer_logprobs) - 1).abs() * batch.loss_mask
    return {"logprob_mismatch": error.sum() / max(batch.global_valid_tokens, 1),
            "logprob_mismatch_max": error.max() if error.numel() else error.sum()}


def _reduce(values: torch.Tensor, *, mask: torch.Tensor, batch: TrainBatch, mode: str = "token-mean",
            norm: int = 1) -> torch.Tensor:
    """This micro-batch's share of the step's loss (see the module docstring), by loss_agg_mode:
    token-mean: over all loss tokens of the step; seq-mean-token-mean: each sequence's mean, then
    over the step's sequences; seq-mean-token-sum: each sequence's sum, then over sequences;
    seq-mean-token-sum-norm (Dr. GRPO): each sequence's sum / `norm`, then over sequences."""
    if mode == "token-mean":
        return (values * mask).sum() / max(batch.global_valid_tokens, 1)
    per_sequence = batch.sequence_sum(values * mask)
    if mode == "seq-mean-token-mean":
        per_sequence = per_sequence / batch.sequence_sum(mask).clamp(min=1)
    elif mode == "seq-mean-token-sum-norm":
        per_sequence = per_sequence / norm
    elif mode != "seq-mean-token-sum":
        raise ValueError(f"loss_fn.loss_agg_mode='{mode}' is not a known aggregation")
    return per_sequence.sum() / max(batch.global_valid_sequences, 1)


def aggregation(loss_cfg) -> str:
    """loss_fn.loss_agg_mode, or what NeMo RL's token_level_loss means (token-mean, or
    seq-mean-token-mean)."""
    return loss_cfg.loss_agg_mode or ("token-mean" if loss_cfg.token_level_loss else "seq-mean-token-mean")


def make_loss(loss_cfg, max_new_tokens: int = 1) -> LossFn:
    """The configured loss (a `novarl.config.schema.LossConfig`) as a LossFn; max_new_tokens:
    the constant seq-mean-token-sum-norm divides by."""
    settings = ClippedPGSettings(
        ratio_clip_min=loss_cfg.ratio_clip_min,
        ratio_clip_max=loss_cfg.ratio_clip_max,
        ratio_clip_c=loss_cfg.ratio_clip_c,
        # with the KL in the reward (REINFORCE++), it is in the advantages, not the loss
        reference_policy_kl_penalty=0.0 if loss_cfg.use_kl_in_reward else loss_cfg.reference_policy_kl_penalty,
        kl_estimator=loss_cfg.kl_estimator,
        aggregation=aggregation(loss_cfg),
        aggregation_norm=max_new_tokens,
        disable_ppo_ratio=loss_cfg.disable_ppo_ratio,
        use_importance_sampling_correction=loss_cfg.use_importance_sampling_correction,
        truncation=loss_cfg.truncated_importance_sampling_type,
        truncation_max=loss_cfg.truncated_importance_sampling_ratio,
        truncation_min=loss_cfg.truncated_importance_sampling_ratio_min,
        sequence_level_importance_ratios=loss_cfg.sequence_level_importance_ratios,
        use_on_policy_kl_approximation=loss_cfg.use_on_policy_kl_approximation,
        kl_input_clamp_value=loss_cfg.kl_input_clamp_value,
        kl_output_clamp_value=loss_cfg.kl_output_clamp_value,
        force_on_policy_ratio=loss_cfg.force_on_policy_ratio,
        use_cispo=loss_cfg.use_cispo,
        positive_example_nll_weight=loss_cfg.positive_example_nll_weight,
    )
    return partial(POLICY_LOSSES.get(loss_cfg.loss), settings=settings)


@dataclass(frozen=True)
class ValueLossSettings:
    """NeMo RL's value_loss_fn keys."""

    scale: float = 1.0
    """The value loss's weight."""
    cliprange: float | None = 0.2
    """Values move at most this far from the values the batch was generated with; None: no clip."""


def value_loss(values: torch.Tensor, batch: TrainBatch, settings: ValueLossSettings = ValueLossSettings()
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A critic's loss (a LossFn): scale x the clipped value loss (clipped_value_loss) averaged over
    the step's loss tokens. values [n]: the critic's now; batch.returns and batch.old_values [n]: the
    GAE returns and the values before the update."""
    if batch.returns is None or batch.old_values is None:
        raise ValueError("value_loss needs the batch's returns and old_values (set by the step for PPO's critic)")
    mask = batch.loss_mask.float()
    returns, old_values = batch.returns.float(), batch.old_values.float()
    token_loss = clipped_value_loss(values, old_values, returns, settings.cliprange)
    reduce = partial(_reduce, mask=mask, batch=batch)
    loss = settings.scale * reduce(token_loss)
    with torch.no_grad():
        clipped = ((values - old_values).abs() > settings.cliprange).float() if settings.cliprange is not None \
            else torch.zeros_like(values)
        metrics = {"value_loss": loss.detach(), "value_clip_fraction": reduce(clipped), "value_mean": reduce(values),
                   "value_error": reduce((values - returns).abs())}
    return loss, metrics


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       clip: float | None) -> torch.Tensor:
    """[...] per-token PPO value loss: 0.5 max((v - R)^2, (v_clipped - R)^2), v_clipped = old_values
    + clip(v - old_values, -clip, clip); without `clip`, 0.5 (v - R)^2."""
    loss = (values - returns) ** 2
    if clip is not None:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        loss = torch.maximum(loss, (clipped - returns) ** 2)
    return 0.5 * loss
