"""A token's score, defined once: its logprob under the logits divided by the sampling
temperature, in float32, so that the ratio the loss takes is between the distributions the
engines sampled from. Every backend's logprobs come from these two functions (Megatron's
vocabulary-parallel cross entropy and the chunked head take the scaled logits alone), and
every training precision left unset comes from `training_precision`."""

from __future__ import annotations

import torch


def scaled_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """float32 logits divided by the sampling temperature."""
    logits = logits.float()
    return logits / temperature if temperature != 1.0 else logits


def token_scores(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """[...] float32 log softmax(logits / temperature)[target] for logits [..., V] and targets [...]."""
    rows = scaled_logits(logits, temperature)
    return rows.gather(-1, targets[..., None]).squeeze(-1) - torch.logsumexp(rows, dim=-1)


def training_precision(precision: str | None, *, on_gpu: bool) -> str:
    """policy.precision, or where it is unset: bfloat16 on a GPU, float32 on the CPU."""
    return precision or ("bfloat16" if on_gpu else "float32")
