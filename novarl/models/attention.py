"""Attention for the training forwards: packed rows at the cost of their sequences.

transformers runs a packed row (position ids restarting at each sequence) with
SDPA or eager attention by building a block-diagonal T x T mask: correct, but the
row's attention costs T^2 however short its sequences, which on a CPU makes
packing slower than padding. `VARLEN` is an attention implementation registered
with transformers (its AttentionInterface) that takes the row's sequence
boundaries (`cu_seq_lens_q`, the same keyword flash-attention's varlen kernel
reads), lays the sequences out as padded rows inside the attention only, and runs
causal SDPA on them: each sequence attends to itself at the cost of its own
length, and everything around the attention (projections, MLP, logits) computes
on the packed tokens alone. Without boundaries it is causal SDPA on right-padded
rows: the padding comes after every real token, so no mask is needed (and none
is built: transformers makes masks only for implementations it knows).

It is used for architectures whose attention is plain causal softmax attention
(no sliding window, no logit soft-capping); others keep their own attention and
pack through the T x T mask, and flash-attention reads the same keywords.
"""

from __future__ import annotations

import torch

from novarl.plan.model_shape import PLAIN_CAUSAL

VARLEN = "novarl_varlen"
READS_BOUNDARIES = (VARLEN, "flash_attention_2", "flash_attention_3")
"""Implementations that take the packed row's boundaries as cu_seq_lens_* / max_length_* keywords;
VARLEN alone also takes shared-prompt attention rows."""

_registered = False


def use_varlen_attention(model: torch.nn.Module) -> str | None:
    """Switch a loaded Hugging Face causal LM to VARLEN when its attention is plain causal
    attention computed by SDPA or eager. The implementation now in use if it reads packed rows'
    boundaries (VARLEN, or flash-attention already), else None."""
    config = model.config
    implementation = getattr(config, "_attn_implementation", None)
    if implementation in READS_BOUNDARIES:
        return implementation
    sliding = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    if implementation not in ("sdpa", "eager") or config.model_type not in PLAIN_CAUSAL or sliding:
        return None
    _register()
    model.set_attn_implementation(VARLEN)
    return VARLEN


def _register() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(VARLEN, varlen_attention)
        _registered = True


def varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     cu_seq_lens_q: torch.Tensor | None = None, max_length_q: int | None = None,
                     novarl_attention_rows: torch.Tensor | None = None,
                     novarl_attention_take: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """query [B, H, T, D], key and value [B, Hkv, T, D] -> ([B, T, H, D], None).

    With cu_seq_lens_q ([k + 1] boundaries of one packed row, B = 1): each sequence attends
    causally to itself. With novarl_attention_rows ([A, L] row positions) and _take ([T]): each
    attention row (a shared prompt and one completion) is causal attention over those positions,
    and position t's output is the flattened [A * L] output at take[t] (packed rows with shared
    prompts, backends/training/batching.py). Without: causal attention over each right-padded row."""
    if attention_mask is not None:
        raise ValueError(f"{VARLEN} attention takes right-padded rows without a mask, or packed boundaries")
    gqa = query.shape[1] != key.shape[1]
    dropout = dropout if module.training else 0.0
    if novarl_attention_rows is None and cu_seq_lens_q is None:
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, dropout_p=dropout, is_causal=True,
                                                               scale=scaling, enable_gqa=gqa)
        return out.transpose(1, 2).contiguous(), None
    if novarl_attention_rows is None:
        novarl_attention_rows, novarl_attention_take = sequence_rows(cu_seq_lens_q, max_length_q)
    rows = novarl_attention_rows.to(query.device)
    take = novarl_attention_take.to(query.device)

    def gather(t: torch.Tensor) -> torch.Tensor:  # [1, H, T, D] -> [A, H, L, D]
        # index_select, whose backward adds rows with index_add: a prompt's keys feed several rows
        tokens = t[0].transpose(0, 1).reshape(t.shape[2], -1)  # [T, H * D]
        picked = tokens.index_select(0, rows.view(-1)).view(*rows.shape, t.shape[1], t.shape[3])
        return picked.transpose(1, 2)

    out = torch.nn.functional.scaled_dot_product_attention(gather(query), gather(key), gather(value),
                                                           dropout_p=dropout, is_causal=True, scale=scaling,
                                                           enable_gqa=gqa)
    flat = out.transpose(1, 2).reshape(-1, out.shape[1] * out.shape[3])  # [A * L, H * D]
    return flat.index_select(0, take).view(1, len(take), out.shape[1], out.shape[3]), None


def sequence_rows(cu_seqlens: torch.Tensor, longest: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """For a packed row's boundaries [k + 1]: the attention rows [k, L] (each sequence's
    positions, then whatever follows it: at the end of a causal row nothing real attends to it)
    and take [T] (where each position's output is in the flattened [k * L] rows)."""
    cu = cu_seqlens.long()
    lengths = cu.diff()
    longest = int(longest) if longest is not None else int(lengths.max())
    total = int(cu[-1])
    rows = (cu[:-1, None] + torch.arange(longest, device=cu.device)).clamp(max=total - 1)
    sequence = torch.repeat_interleave(torch.arange(len(lengths), device=cu.device), lengths)
    take = sequence * longest + torch.arange(total, device=cu.device) - cu[sequence]
    return rows, take
