"""What a training backend computes for each token, defined once.

A backend runs its model and applies the head passed with the call (backends/protocols.py
`forward(batch, head)`, `forward_backward(batch, loss, head)`):
- `Logprobs(temperature)`: the token's logprob under the logits divided by the sampling
  temperature, in float32, so that the ratio the loss takes is between the distributions the
  engines sampled from (the policy's head and the reference's);
- `Values()`: the token's value, a critic's scalar output (models/critic.py) read at the
  position the token is emitted from.
Every backend's logprobs come from `scaled_logits` / `token_scores` (Megatron's
vocabulary-parallel cross entropy and the chunked head take the scaled logits alone), and every
training precision left unset comes from `training_precision`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch


@dataclass(frozen=True)
class Logprobs:
    """Each token's logprob at `temperature` (0 at each sequence's first token)."""

    temperature: float = 1.0


@dataclass(frozen=True)
class Values:
    """Each token's value from a critic's scalar head, read at its predecessor's position (0 at
    each sequence's first token)."""


Head = Union[Logprobs, Values]


def check_head(head: Head, *, value_head: bool, model: str) -> None:
    """Refuse a head the model cannot apply: logprobs from a critic's scalar head, or values from
    a language model's vocabulary head (a caller's mistake, not the user's)."""
    if not isinstance(head, (Logprobs, Values)):
        raise TypeError(f"{model}: a head is Logprobs(temperature) or Values(), not {head!r}")
    if isinstance(head, Values) != value_head:
        has = "a scalar value head" if value_head else "a vocabulary head"
        raise TypeError(f"{model} has {has}: it computes {'Values()' if value_head else 'Logprobs(...)'}, "
                        f"not {head!r}")


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
