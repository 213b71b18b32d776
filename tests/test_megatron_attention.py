"""novarl's core attention for megatron-core without Transformer Engine (backends/megatron/
attention.py), alone on the CPU: a packed row is its sequences' own attention, and what it does
not do is refused. (Against megatron-core's DotProductAttention on tensor-parallel ranks:
tests/test_megatron_convert.py; through the whole backend, packed against padded rows:
tests/test_megatron_backend.py; torch's varlen kernel: tests/test_megatron_gpu.py.)"""

from __future__ import annotations

import pytest
import torch

from novarl.errors import NotAvailableYet
from tests.helpers import scalar_reads

pytest.importorskip("megatron.core")


def sdp_attention(attn_mask_type=None, **config):
    """SDPAttention as megatron-core's layer spec builds it: 4 query heads over 2 key/value heads of 16."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from novarl.backends.megatron.attention import SDPAttention

    shape = dict(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
                 attention_dropout=0.0)
    return SDPAttention(config=TransformerConfig(**{**shape, **config}), layer_number=1,
                        attn_mask_type=attn_mask_type or AttnMaskType.causal, attention_type="self",
                        cp_comm_type=None, softmax_scale=None, pg_collection=None)


def packed_row(lengths: list[int], slot_multiple: int, width: int, device: str = "cpu"):
    """Boundaries of a packed row as novarl lays it out (each sequence padded to its slot, the
    row's tail a sequence of its own) and the row positions of the real tokens."""
    from megatron.core.packed_seq_params import PackedSeqParams

    slots = [-(-n // slot_multiple) * slot_multiple for n in lengths]
    starts = torch.tensor([0, *slots]).cumsum(0)
    cu = torch.cat([starts, torch.tensor([width])]).to(device, torch.int32)
    real = torch.cat([torch.arange(n) + start for n, start in zip(lengths, starts.tolist())]).to(device)
    longest = int(cu.diff().max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                           cu_seqlens_kv_padded=cu, max_seqlen_q=longest, max_seqlen_kv=longest), real


LENGTHS, SLOT, WIDTH = [5, 3, 8], 4, 24
"""A packed row of 3 sequences in slots of multiples of 4, and a tail: 8 + 4 + 8 + 4 tokens."""


def packed_and_padded(attention, dtype: torch.dtype = torch.float32, device: str = "cpu") -> list[tuple]:
    """[packed, padded]: the real tokens' outputs [n, 64] and the q, k, v gradients [24, heads, 16]
    of a loss over them, from the packed row and from each sequence's real tokens run alone as
    a padded row of its own ([s, 1, heads, 16])."""
    packed, real = packed_row(LENGTHS, SLOT, WIDTH, device)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(WIDTH, heads, 16, generator=gen).to(device, dtype) for heads in (4, 2, 2))
    weights = torch.randn(len(real), 64, generator=gen).to(device)  # a loss that weighs every output
    results = []
    for layout in ("packed", "padded"):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        if layout == "packed":
            out = attention(*inputs, None, packed_seq_params=packed)[real]
        else:
            out = torch.cat([attention(*(t[rows][:, None] for t in inputs), None)[:, 0]
                             for rows in real.split(LENGTHS)])
        (out.float() * weights).sum().backward()
        results.append((out.detach(), *(t.grad for t in inputs)))
    return results


def test_a_packed_row_is_its_sequences_alone():
    """Outputs and gradients of the real tokens equal each sequence's own causal attention; the
    padding after each sequence (and the row's tail) gets no gradient: nothing real sees it."""
    (out, dq, dk, dv), (want, want_dq, want_dk, want_dv) = packed_and_padded(sdp_attention())
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    for got, expected in ((dq, want_dq), (dk, want_dk), (dv, want_dv)):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    _, real = packed_row(LENGTHS, SLOT, WIDTH)
    padding = torch.ones(WIDTH, dtype=torch.bool)
    padding[real] = False
    assert padding.any() and not dk[padding].any() and not dv[padding].any()


def test_what_it_does_not_do_is_refused():
    from megatron.core.transformer.enums import AttnMaskType

    with pytest.raises(NotAvailableYet) as err:
        sdp_attention(AttnMaskType.padding, context_parallel_size=2, window_size=(8, 0))
    for part in ("mask type padding (causal only)", "sliding-window attention", "context_parallel_size=2"):
        assert part in str(err.value)
    q, kv = torch.randn(3, 1, 4, 16), torch.randn(3, 1, 2, 16)
    with pytest.raises(ValueError, match="no attention bias"):
        sdp_attention()(q, kv, kv, None, attention_bias=torch.zeros(1, 4, 3, 3))
    with pytest.raises(ValueError, match="causal attention of 2 queries to 3 keys needs an explicit mask"):
        sdp_attention()(q[:2], kv, kv, None)


ROTATIONS = {"plain": {}, "interleaved": {"rotary_interleaved": True}, "latent": {"multi_latent_attention": True},
             "scaled": {"mscale": 1.25}}
"""megatron-core's rotation settings packed_rotary passes on: the config's, and the call's mscale."""


@pytest.mark.parametrize("rotation", sorted(ROTATIONS))
@pytest.mark.parametrize("whole_row", [False, True], ids=["per-sequence", "whole-row-frequencies"])
def test_packed_rows_rotate_as_megatron_core_does_without_reading_the_boundaries(whole_row, rotation):
    """backends/megatron/attention.py packed_rotary against megatron-core's unfused rotation of a packed row
    (an empty sequence and the row's tail included, a partial rotary dimension, each of its rotation
    settings): equal outputs, and no value read back to the host (megatron-core's reads the boundaries: on a
    GPU, a wait in every layer). The layer spec installs it in megatron-core's attention."""
    import copy

    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import attention as megatron_attention

    from novarl.backends.megatron.attention import packed_rotary
    from novarl.backends.megatron.model import layer_spec
    from novarl.distributed.local import ensure_single_process_group

    ensure_single_process_group()
    config = copy.copy(sdp_attention().config)
    settings = dict(ROTATIONS[rotation])
    mscale = settings.pop("mscale", 1.0)
    for name, value in settings.items():
        setattr(config, name, value)
    packed, _ = packed_row([5, 0, 3, 8], SLOT, WIDTH)
    cu = packed.cu_seqlens_q_padded
    angles = torch.outer(torch.arange(WIDTH if whole_row else packed.max_seqlen_q).float(),
                         1.0 / 10_000 ** (torch.arange(0, 8, 2).float() / 8))  # 8 of 16 dimensions rotated
    freqs = torch.cat([angles, angles], -1)[:, None, None, :]  # as megatron-core's RotaryEmbedding lays them out
    t = torch.randn(WIDTH, 4, 16, generator=torch.Generator().manual_seed(0))
    group = torch.distributed.group.WORLD
    with scalar_reads() as theirs_reads:
        theirs = rope_utils.apply_rotary_pos_emb(t, freqs, config, cu_seqlens=cu, mscale=mscale, cp_group=group)
    with scalar_reads() as ours_reads:
        ours = packed_rotary(t, freqs, config, cu_seqlens=cu, mscale=mscale, cp_group=group)
    assert torch.equal(ours, theirs)
    assert ours_reads.count == 0 and theirs_reads.count > 0
    padded = t[:8, None]  # padded rows ([s, b, heads, dim]) go to megatron-core's own
    assert torch.equal(packed_rotary(padded, freqs[:8], config, mscale=mscale, cp_group=group),
                       rope_utils.apply_rotary_pos_emb(padded, freqs[:8], config, mscale=mscale, cp_group=group))
    layer_spec(sdp_attention().config)
    assert megatron_attention.apply_rotary_pos_emb is packed_rotary
