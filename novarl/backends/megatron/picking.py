"""Megatron-core's output layer computing the following tokens' logprobs without the full logits.

Megatron's GPT model returns vocab-parallel logits [b, s, V/tp]; the backend then took their
float32 copy and megatron-core's vocab-parallel cross entropy, which keeps the softmax for the
backward: for a micro-batch of 8,192 tokens of a 151,936-entry vocabulary, 2.5 GB of bf16 logits,
5 GB of float32 ones and 5 GB of softmax, and as much again for their gradients (micro-batches of 4
such rows did not fit an 80 GB H100). Without tensor parallelism the output layer holds the whole
vocabulary, so it can do what models/logprob_head.py's PickingHead does for Hugging Face models:
while a request is set, the layer (the same ColumnParallelLinear, its class swapped: the same
weights and state-dict names, a tied embedding's weight passed in as Megatron passes it) returns
each position's logprob of its following token, [s, b], computed chunk by chunk with each chunk's
logits recomputed in the backward. The model transposes that to [b, s] as it does logits. Megatron
pads the vocabulary to a multiple of 128: the padding's rows are never a token and take no part
(the weight is cut to the real vocabulary, whose gradient's padding rows stay 0).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from novarl.models.logprob_head import chunked_logprobs


def use_picking_output(layer: Any, vocab_size: int, rows: int | None, fused: bool) -> None:
    """Make a Megatron output layer (a ColumnParallelLinear on a tensor-parallel group of one) able
    to pick: `rows` rows of logits at once (None: chunk_rows of the vocabulary), fused: the chunk
    steps compiled (models/logprob_head.py)."""
    layer.__class__ = _picking_class(type(layer))
    layer.picking = (vocab_size, rows, fused)
    layer.request = None


@contextmanager
def picking(layer: Any, following: torch.Tensor, temperature: float) -> Iterator[None]:
    """While inside: the layer returns [s, b] float32 logprobs at `temperature` of following [b, s]
    (each position's next token) instead of logits [s, b, V]."""
    layer.request = (following.t().reshape(-1), temperature)
    try:
        yield
    finally:
        layer.request = None


def _picking_class(base: type) -> type:
    """`base` (megatron-core's ColumnParallelLinear) with a forward that picks: made once per class."""
    if base in _CLASSES.values():
        return base
    if base not in _CLASSES:
        _CLASSES[base] = _subclass(base)
    return _CLASSES[base]


_CLASSES: dict[type, type] = {}


def _subclass(base: Any) -> type:
    class PickingOutputLayer(base):
        """A Megatron output layer that, inside `picking(...)`, returns the following tokens' logprobs."""

        picking: tuple[int, int | None, bool]
        request: tuple[torch.Tensor, float] | None

        def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None, *args, **kwargs):
            if self.request is None:
                return super().forward(input_, weight, *args, **kwargs)
            targets, temperature = self.request
            vocab_size, rows, fused = self.picking
            whole = self.weight if weight is None else weight
            s, b, hidden = input_.shape
            picked = chunked_logprobs(input_.reshape(-1, hidden), whole[:vocab_size], targets, temperature, rows,
                                      fused)
            return picked.view(s, b), None

    return PickingOutputLayer
