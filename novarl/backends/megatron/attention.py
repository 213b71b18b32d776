"""Megatron-core's core attention without Transformer Engine: torch's SDPA and varlen kernels.

megatron-core's local layer spec computes attention with its `DotProductAttention`: scores
materialised by baddbmm, an explicit mask, softmax, then bmm; and it refuses packed rows
(`PackedSeqParams`). `SDPAttention` takes its place in the layer spec when Transformer Engine
is absent (model.py `layer_spec`); with Transformer Engine, its fused attention stays.

- padded rows [s, b, heads, dim]: causal `scaled_dot_product_attention` (torch's flash or
  memory-efficient kernels on CUDA), grouped query heads through `enable_gqa`; an explicit
  mask (True = masked out, megatron-core's convention) where one is given, as Megatron
  generation gives one for a prompt chunk against its KV cache;
- packed rows ("thd": [t, heads, dim] with the row's sequence boundaries): each sequence's
  causal attention to itself, through novarl's varlen attention (models/attention.py): torch's
  varlen flash kernel on CUDA in bf16/fp16, else causal SDPA over each sequence laid out as a
  padded row inside the attention only (the CPU, float32, dropout). Each sequence's queries and
  keys are rotated from its own position 0 before, by `packed_rotary` in place of megatron-core's
  unfused rotation (where Transformer Engine's fused one is off): the same values, without its
  host synchronisation (it reads the boundaries back from the GPU in every layer, twice).

What it does not do is refused when the layers are built: a mask type other than causal,
sliding windows, softmax offsets (off-by-one or learnable), cross attention, context
parallelism (Transformer Engine's attention alone splits sequences). This module imports
megatron-core (its base class); model.py imports it only where it builds the layers.
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from novarl.errors import NotAvailableYet
from novarl.models.attention import varlen_attention


class SDPAttention(MegatronModule):
    """A core attention for megatron-core's SelfAttention, built as its DotProductAttention is
    (the same keyword arguments, from the layer spec) and called as it is: query [sq, b, np, hn],
    key and value [sk, b, ng, hn] (ng divides np: grouped query heads) -> [sq, b, np * hn]; for
    a packed row ("thd"), query [t, np, hn], key and value [t, ng, hn] -> [t, np * hn]."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None) -> None:
        super().__init__(config=config)
        problems = []
        if attn_mask_type != AttnMaskType.causal:
            problems.append(f"the attention mask type {attn_mask_type.name} (causal only)")
        if attention_type != "self":
            problems.append(f"{attention_type} attention (self-attention only)")
        if config.window_size is not None:
            problems.append(f"sliding-window attention (window_size={config.window_size})")
        if config.softmax_type != "vanilla":
            problems.append(f"the {config.softmax_type} softmax")
        if config.context_parallel_size > 1:
            problems.append(f"context_parallel_size={config.context_parallel_size} (Transformer Engine's "
                            "attention alone splits sequences over context-parallel ranks)")
        if problems:
            raise NotAvailableYet("novarl's SDPA core attention for megatron-core (used without Transformer "
                                  "Engine) does not do " + "; ".join(problems) + ". Install transformer-engine "
                                  "on the GPU hosts for these.")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        # DotProductAttention's scale; apply_query_key_layer_scaling divides the scores by the layer
        # number and multiplies them back inside its softmax, which changes nothing here
        self.softmax_scale = softmax_scale if softmax_scale is not None else config.kv_channels ** -0.5
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: AttnMaskType | None = None,
                attention_bias: torch.Tensor | None = None, packed_seq_params=None) -> torch.Tensor:
        """attention_mask: bool, broadcastable to [b, np, sq, sk], True where a query must not see
        a key; None for causal attention (or, with attn_mask_type no_mask, which megatron-core's
        KV-cache decoding passes, for none). packed_seq_params: a packed row's boundaries."""
        if attention_bias is not None:
            raise ValueError("SDPAttention takes no attention bias")
        dropout = self.dropout if self.training else 0.0
        with self._dropout_rng(dropout):
            if packed_seq_params is not None:
                if attention_mask is not None:
                    raise ValueError("SDPAttention: a packed row takes its sequence boundaries, not a mask")
                return self._packed(query, key, value, packed_seq_params, dropout)
            return self._padded(query, key, value, attention_mask, attn_mask_type or self.attn_mask_type, dropout)

    def _padded(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                mask_type: AttnMaskType, dropout: float) -> torch.Tensor:
        queries, rows, heads, dim = query.shape
        causal = False
        if mask is not None:
            mask = ~mask  # SDPA's boolean mask: True where a query sees a key
        elif mask_type == AttnMaskType.causal and queries > 1:  # (one query: a decoding step, every key)
            if key.shape[0] != queries:
                raise ValueError(f"SDPAttention: causal attention of {queries} queries to {key.shape[0]} keys "
                                 "needs an explicit mask")
            causal = True
        elif mask_type not in (AttnMaskType.causal, AttnMaskType.no_mask):
            raise ValueError(f"SDPAttention: the attention mask type {mask_type.name} (causal or no_mask only)")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, dim]
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal, scale=self.softmax_scale,
            enable_gqa=key.shape[2] != heads)
        return out.permute(2, 0, 1, 3).reshape(queries, rows, heads * dim)

    def _packed(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, packed,
                dropout: float) -> torch.Tensor:
        """One packed row: the boundaries of its sequences as laid out (each with its padding, if
        any: a sequence's padding follows its tokens, which causal attention keeps them from seeing)."""
        if packed.qkv_format != "thd" or query.dim() != 3:
            raise ValueError(f"SDPAttention: packed rows in the thd format ([t, heads, dim]), not "
                             f"{packed.qkv_format} {tuple(query.shape)}")
        laid_out = packed.cu_seqlens_q_padded
        cu = packed.cu_seqlens_q if laid_out is None else laid_out
        cu_keys = packed.cu_seqlens_kv if packed.cu_seqlens_kv_padded is None else packed.cu_seqlens_kv_padded
        if cu_keys is not cu and not torch.equal(cu_keys, cu):
            raise ValueError("SDPAttention: a packed row's queries and keys must share their sequence boundaries")
        # max_seqlen_q is the longest unpadded sequence: computed from the laid-out boundaries if they differ
        longest = packed.max_seqlen_q if laid_out is None or laid_out is packed.cu_seqlens_q else None
        tokens, heads, dim = query.shape
        q, k, v = (t.transpose(0, 1)[None] for t in (query, key, value))  # [1, heads, t, dim]
        out, _ = varlen_attention(self, q, k, v, None, dropout=dropout, scaling=self.softmax_scale,
                                  cu_seq_lens_q=cu, max_length_q=longest)  # [1, t, heads, dim]
        return out.reshape(tokens, heads * dim)

    def _dropout_rng(self, dropout: float):
        """megatron-core's model-parallel RNG for attention dropout (as DotProductAttention forks
        it: each tensor-parallel rank drops its own heads' weights), when there is dropout."""
        if not dropout or self.config.sequence_parallel:
            return contextlib.nullcontext()
        from megatron.core import tensor_parallel

        return tensor_parallel.get_cuda_rng_tracker().fork()


def packed_rotary(t: torch.Tensor, freqs: torch.Tensor, config, cu_seqlens: torch.Tensor | None = None,
                  mscale: float = 1.0, cp_group=None, **more) -> torch.Tensor:
    """megatron-core's `apply_rotary_pos_emb` (rope_utils), its packed rows ("thd": t [T, heads, dim], the row's
    boundaries cu_seqlens) without reading the boundaries on the host: megatron-core's unfused path splits
    the row by `cu_seqlens.tolist()`, a wait for the GPU in each layer's queries and keys, which leaves the
    GPU idle while the host catches up. Here each token's position is found on the device (its sequence by
    searchsorted), then rotated by the same function as megatron-core's, on the same frequencies: equal
    results. Fused (apply_rope_fusion), context-parallel and padded rows go to megatron-core's own, and so does
    a call with arguments this megatron-core version adds (`more`)."""
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings import rope_utils

    group = cp_group if cp_group is not None else parallel_state.get_context_parallel_group()
    if cu_seqlens is None or config.apply_rope_fusion or group.size() > 1 or more:
        return rope_utils.apply_rotary_pos_emb(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=group,
                                               **more)
    tokens = torch.arange(t.shape[0], device=t.device)
    if freqs.size(0) == t.shape[0]:  # megatron-core's reading of frequencies of the whole row: a token's own
        positions = tokens
    else:  # each sequence from position 0
        cu = cu_seqlens.to(device=t.device, dtype=torch.long)
        positions = tokens - cu[torch.searchsorted(cu, tokens, right=True) - 1]
    return rope_utils._apply_rotary_pos_emb_bshd(
        t.unsqueeze(1), freqs[positions], rotary_interleaved=config.rotary_interleaved,
        multi_latent_attention=config.multi_latent_attention, mscale=mscale).squeeze(1)


def rotate_packed_rows_on_the_device() -> None:
    """megatron-core's self-attention rotates with `packed_rotary` (idempotent; this process's attention), where
    this megatron-core version has the functions it calls (0.16's names; another keeps its own rotation)."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import attention

    if hasattr(rope_utils, "_apply_rotary_pos_emb_bshd") and hasattr(attention, "apply_rotary_pos_emb"):
        attention.apply_rotary_pos_emb = packed_rotary
