"""Megatron-core's output layer computing the following tokens' logprobs without the full logits.

Megatron's GPT model returns vocab-parallel logits [b, s, V/tp]; the backend then took their
float32 copy and megatron-core's vocab-parallel cross entropy, which keeps the softmax for the
backward: for a micro-batch of 8,192 tokens of a 151,936-entry vocabulary, 2.5 GB of bf16 logits,
5 GB of float32 ones and 5 GB of softmax (each / tp), and as much again for their gradients
(micro-batches of 4 such rows did not fit an 80 GB H100). The output layer does instead what
models/logprob_head.py's PickingHead does for Hugging Face models: while a request is set, the layer
(the same ColumnParallelLinear, its class swapped: the same weights and state-dict names, a tied
embedding's weight passed in as Megatron passes it) returns each position's logprob of its following
token, [s, b], computed chunk by chunk (models/logprob_head.py: the logits kept for the backward where
they are small, else recomputed there). The model transposes that to [b, s] as it does logits. Under
tensor parallelism each rank computes its part of the vocabulary's, combined over the tensor-parallel
group (chunked_logprobs' `vocab`), its input taken as the layer takes it (gathered from the sequence's
parts under sequence parallelism, and kept so for the backward, where megatron-core's own layer keeps
its part and gathers it again; the input's gradient summed over the group). Megatron pads the
vocabulary to a multiple of 128 x tp: the padding's rows are never a token and take no part (each
rank's weight is cut to the real vocabulary, whose gradient's padding rows stay 0).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import cast

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

from novarl.models.logprob_head import chunked_logprobs


class PickingOutputLayer(ColumnParallelLinear):
    """A Megatron output layer that, inside `picking(...)`, returns the following tokens' logprobs."""

    picking_sizes: tuple[int, int | None, bool]
    """(the real vocabulary, rows of logits at once or None, the chunk steps compiled)."""
    request: tuple[torch.Tensor, float] | None = None

    def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None, *args, **kwargs):
        if self.request is None:
            return super().forward(input_, weight, *args, **kwargs)
        targets, temperature = self.request
        vocab_size, rows, fused = self.picking_sizes
        part = self.weight if weight is None else weight  # this rank's rows of the (padded) vocabulary
        first, vocab = 0, None
        if self.tp_group.size() > 1:
            input_ = (gather_from_sequence_parallel_region(input_, group=self.tp_group) if self.sequence_parallel
                      else copy_to_tensor_model_parallel_region(input_, group=self.tp_group))
            first = self.tp_group.rank() * self.output_size_per_partition
            vocab = (self.tp_group, first)
        s, b, hidden = input_.shape
        real = part[:max(0, min(len(part), vocab_size - first))]
        picked = chunked_logprobs(input_.reshape(-1, hidden), real, targets, temperature, rows, fused, vocab)
        return picked.view(s, b), None


def use_picking_output(layer: torch.nn.Module, vocab_size: int, rows: int | None, fused: bool) -> bool:
    """Make a Megatron output layer (megatron-core's ColumnParallelLinear) able to pick: `rows` rows of
    logits at once (None: chunk_rows of this rank's part of the vocabulary), fused: the chunk steps compiled
    (models/logprob_head.py). False (left as it is) for any other layer."""
    if type(layer) is not ColumnParallelLinear:
        return False
    layer.__class__ = PickingOutputLayer
    cast(PickingOutputLayer, layer).picking_sizes = (vocab_size, rows, fused)
    return True


@contextmanager
def picking(layer: PickingOutputLayer, following: torch.Tensor, temperature: float) -> Iterator[None]:
    """While inside: the layer returns [s, b] float32 logprobs at `temperature` of following [b, s]
    (each position's next token) instead of logits [s, b, V]."""
    layer.request = (following.t().reshape(-1), temperature)
    try:
        yield
    finally:
        layer.request = None
