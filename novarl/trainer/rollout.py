"""From completions and rewards to a TrainBatch, and the step's rollout metrics."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from novarl.types import Completion, TrainBatch


def build_train_batch(completions: Sequence[Completion], advantages: torch.Tensor, *, pad_token_id: int,
                      overlong_filtering: bool = False) -> TrainBatch:
    """Right-padded prompt + completion rows; loss on completion tokens only.

    With `overlong_filtering`, completions cut by max_new_tokens get no loss.
    """
    rows = [list(c.prompt.token_ids) + list(c.token_ids) for c in completions]
    width = max(len(r) for r in rows)
    size = len(rows)
    input_ids = torch.full((size, width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((size, width), dtype=torch.bool)
    loss_mask = torch.zeros((size, width), dtype=torch.bool)
    generator_logprobs = torch.zeros((size, width), dtype=torch.float32)
    for i, (row, c) in enumerate(zip(rows, completions)):
        start, end = len(c.prompt.token_ids), len(row)
        input_ids[i, :end] = torch.tensor(row)
        attention_mask[i, :end] = True
        trained = not (overlong_filtering and c.finish_reason == "length")
        loss_mask[i, start:end] = trained
        generator_logprobs[i, start:end] = torch.tensor(c.logprobs, dtype=torch.float32)
    batch = TrainBatch(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask,
                       advantages=advantages.float(), generator_logprobs=generator_logprobs)
    return with_global_counts(batch)


def with_global_counts(batch: TrainBatch) -> TrainBatch:
    """Set the token/sequence counts the loss divides by to this batch's own totals."""
    batch.global_valid_tokens = int(batch.loss_mask.sum())
    batch.global_valid_sequences = int(batch.loss_mask.any(dim=1).sum())
    return batch


def rollout_metrics(completions: Sequence[Completion], rewards: torch.Tensor, group_size: int) -> dict[str, float]:
    grouped = rewards.view(-1, group_size)
    lengths = torch.tensor([len(c.token_ids) for c in completions], dtype=torch.float32)
    return {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "groups_without_signal": float((grouped.std(dim=1) == 0).float().mean()) if group_size > 1 else 1.0,
        "completion_length_mean": float(lengths.mean()),
        "truncated_fraction": sum(c.finish_reason == "length" for c in completions) / len(completions),
        "tokens_generated": float(lengths.sum()),
        "tokens_total": float(lengths.sum() + sum(len(c.prompt.token_ids) for c in completions)),
    }


MISMATCH_WARNING = 0.05
"""Mean |p_generator / p_trainer - 1| above which the loop warns (once)."""


def logprob_mismatch(batch: TrainBatch) -> dict[str, float]:
    """|p_generator / p_trainer - 1| over loss tokens, mean and max: near 0 when the
    weight sync worked and both engines compute the same distribution."""
    mask = batch.loss_mask
    if batch.old_logprobs is None or not mask.any():
        return {"logprob_mismatch": 0.0, "logprob_mismatch_max": 0.0}
    error = (torch.exp(batch.generator_logprobs[mask] - batch.old_logprobs[mask]) - 1).abs()
    return {"logprob_mismatch": float(error.mean()), "logprob_mismatch_max": float(error.max())}


def mismatch_advice(mismatch: float) -> str:
    return (f"the generator's token probabilities differ from the trainer's by {mismatch:.3f} on average "
            f"(warning above {MISMATCH_WARNING}). Check that policy.generation.vllm_cfg.precision matches "
            "policy.precision, that top_p/top_k are off (they change the generator's probabilities), and that "
            "the weight sync reaches the generator (policy_version in the completions).")
