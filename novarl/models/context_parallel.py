"""Context parallelism for the DTensor backend (`policy.dtensor_cfg.context_parallel_size`, cp):
each sequence of a micro-batch is split over the cp ranks of its data-parallel group, so that
no rank holds a long sequence's activations whole.

Layout (load-balanced, as Megatron-core lays packed sequences out for its context parallelism):
every sequence of the row (a packed row's sequences, or each padded row) is padded to a multiple
of 2 x cp and cut into 2 x cp chunks; rank r keeps chunks r and 2cp - 1 - r of every sequence, so
that each rank's share of causal attention work is the same. Everything but attention is per
token and runs on the rank's tokens alone (at their own position ids, so rotary embeddings are
those of the whole sequence).

Attention (`CP_ATTENTION`, registered with transformers' AttentionInterface): each rank's keys and
values are all-gathered over the cp group (the collective's backward sums the gradients back to
their rank) and put back in the row's order; each of the rank's query chunks attends causally to
its sequence's keys up to its own end (on CUDA a bottom-right-aligned causal mask, which SDPA's
flash and memory-efficient kernels take as a flag; on the CPU, where SDPA would build that mask and
the scores with it, placeholder queries for the keys before the chunk make it top-left causal
attention: more compute, memory linear in the sequence). So the attention is exact, and a rank
holds the row's keys and values (not its activations) whole: the all-gather form of context
parallelism (Megatron's cp_comm_type all_gather, Llama 3's), not ring attention.

The layout, `shard_rows` and `ContextShard.gather_identical_loss` also serve Megatron's context
parallelism (backends/training/megatron.py), whose attention is Transformer Engine's.

Logprobs: each rank scores its positions' next tokens (through the picking head, models/logprob_head.py,
where the model has one: without the logits over the vocabulary); the scores are all-gathered (summing
gradients on the way back) and read per token as without cp. Every cp rank then computes the same
loss, so each parameter's gradient is cp times its share; FSDP2, sharding over the dp x cp ranks,
averages over all of them, which gives back the data-parallel mean.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from novarl.types import to_device

CP_ATTENTION = "novarl_context_parallel"
_registered = False


@dataclass(frozen=True)
class ContextShard:
    """One cp rank's share of a micro-batch's flattened rows (T tokens)."""

    group: dist.ProcessGroup
    local: torch.Tensor
    """[n] int64 the flat row positions this rank holds, in its order (n = T / cp)."""
    restore: torch.Tensor
    """[T] int64 where each flat position is in the cp ranks' shares laid end to end."""
    chunks: tuple[tuple[int, int, int], ...]
    """Per local chunk: (its first local index, its first flat position, the flat position its
    sequence starts at). Each chunk is `chunk` tokens long."""
    chunk_sizes: tuple[int, ...]

    def gather(self, local: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's `local` ([..., n, ...] along dim) in the row's order ([..., T, ...]); the
        backward sums each rank's gradient back to its own share."""
        from torch.distributed import _functional_collectives as funcol

        # (torch 2.13's name; older ones have only all_gather_tensor_autograd, which 2.13 says is deprecated)
        gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
        gathered = gather(local.movedim(dim, 0).contiguous(), gather_dim=0, group=self.group)
        return gathered.index_select(0, self.restore).movedim(0, dim)


    def gather_identical_loss(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's 1-D `local` in the row's order, for a loss every cp rank computes alike:
        the backward hands each rank its own share's gradient as it is (not summed over the
        ranks), so that gradients summed over the cp ranks (Megatron's data-parallel reduction,
        which spans them) are the loss's."""
        return _GatherOwnShare.apply(local, self)


class _GatherOwnShare(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, shard: ContextShard) -> torch.Tensor:
        ctx.local = shard.local
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(shard.group))]
        dist.all_gather(parts, local.contiguous(), group=shard.group)
        return torch.cat(parts).index_select(0, shard.restore)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.index_select(0, ctx.local), None


def shard_rows(bounds: Sequence[int], group: dist.ProcessGroup, device: torch.device) -> ContextShard:
    """This rank's share of rows whose sequences are bounded by `bounds` (cu_seqlens as host ints,
    k + 1 flat positions; every sequence's length a multiple of 2 x cp), its index maps on `device`.
    Host ints: the micro-batch loop never waits on the device for them."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    pieces = balanced_chunks(bounds, size)
    flat = [torch.cat([torch.arange(first, first + n) for first, _, n in mine]) if mine
            else torch.zeros(0, dtype=torch.long) for mine in pieces]
    total = int(bounds[-1])
    restore = torch.empty(total, dtype=torch.long)
    restore[torch.cat(flat)] = torch.arange(total)
    offsets = [0]
    for _, _, n in pieces[rank]:
        offsets.append(offsets[-1] + n)
    chunks = tuple((offset, first, start) for offset, (first, start, _) in zip(offsets, pieces[rank]))
    return ContextShard(group, to_device(flat[rank], device), to_device(restore, device), chunks,
                        tuple(n for _, _, n in pieces[rank]))


def balanced_chunks(bounds: Sequence[int], size: int) -> list[list[tuple[int, int, int]]]:
    """Per cp rank, its chunks of the row as (first flat position, its sequence's start, length):
    chunks r and 2 x size - 1 - r of every sequence (each a multiple of 2 x size long)."""
    cu = [int(b) for b in bounds]
    pieces: list[list[tuple[int, int, int]]] = [[] for _ in range(size)]
    for start, end in zip(cu[:-1], cu[1:]):
        if (end - start) % (2 * size):
            raise ValueError(f"context parallelism over {size} ranks needs sequences of a multiple of {2 * size} "
                             f"tokens; one has {end - start}")
        chunk = (end - start) // (2 * size)
        if chunk:
            for r in range(size):
                pieces[r] += [(start + piece * chunk, start, chunk) for piece in (r, 2 * size - 1 - r)]
    return pieces


def use_context_parallel_attention(model: torch.nn.Module) -> str:
    """Switch a loaded causal LM to CP_ATTENTION; the architectures it computes exactly are
    models/attention.py's plain causal ones (refused otherwise, naming the setting)."""
    from novarl.errors import UserError
    from novarl.models.architectures import PLAIN_CAUSAL

    config = model.config
    sliding = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    if config.model_type not in PLAIN_CAUSAL or sliding:
        raise UserError(f"policy.dtensor_cfg.context_parallel_size > 1: novarl's context-parallel attention computes "
                        f"plain causal attention ({', '.join(PLAIN_CAUSAL)} without a sliding window); this model is "
                        f"'{config.model_type}'{' with a sliding window' if sliding else ''}. Set "
                        "context_parallel_size=1.")
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(CP_ATTENTION, context_parallel_attention)
        _registered = True
    model.set_attn_implementation(CP_ATTENTION)
    return CP_ATTENTION


def context_parallel_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                               value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                               scaling: float | None = None, novarl_context: ContextShard | None = None,
                               **kwargs) -> tuple[torch.Tensor, None]:
    """query [1, H, n, D] and key/value [1, Hkv, n, D] of this rank's tokens -> ([1, n, H, D], None):
    each query chunk against its sequence's gathered keys and values up to the chunk's end."""
    from torch.nn.attention.bias import causal_lower_right

    if novarl_context is None or attention_mask is not None:
        raise ValueError(f"{CP_ATTENTION} attention takes a context shard (novarl_context) and no mask")
    shard = novarl_context
    keys, values = shard.gather(key, 2), shard.gather(value, 2)
    gqa = query.shape[1] != key.shape[1]
    dropout = dropout if module.training else 0.0
    outputs = []
    for (at, first, start), chunk in zip(shard.chunks, shard.chunk_sizes):
        end = first + chunk
        q, k, v = query[:, :, at:at + chunk], keys[:, :, start:end], values[:, :, start:end]
        if query.device.type == "cuda":  # flash and memory-efficient kernels take the mask as a flag
            outputs.append(torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=causal_lower_right(chunk, end - start), dropout_p=dropout, scale=scaling,
                enable_gqa=gqa))
            continue
        # elsewhere a bottom-right mask would be built (chunk x keys) and the scores with it: instead,
        # placeholder queries for the keys before the chunk make it top-left causal attention, which
        # SDPA computes without either (their outputs are dropped)
        before = first - start
        padded = torch.cat([q.new_zeros(q.shape[0], q.shape[1], before, q.shape[3]), q], dim=2)
        out = torch.nn.functional.scaled_dot_product_attention(padded, k, v, dropout_p=dropout, is_causal=True,
                                                               scale=scaling, enable_gqa=gqa)
        outputs.append(out[:, :, before:])
    out = torch.cat(outputs, dim=2) if outputs else query.new_zeros(query.shape)
    return out.transpose(1, 2).contiguous(), None
