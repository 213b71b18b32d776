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


def logprob_mismatch(batch: TrainBatch) -> float:
    """Mean |p_generator / p_trainer - 1| over loss tokens: near 0 when the weight sync worked."""
    mask = batch.loss_mask
    if batch.old_logprobs is None or not mask.any():
        return 0.0
    ratio = torch.exp(batch.generator_logprobs[mask] - batch.old_logprobs[mask])
    return float((ratio - 1).abs().mean())
