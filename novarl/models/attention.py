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

On CUDA (bf16/fp16, torch 2.10+) packed rows go to torch's variable-length flash kernel instead
(`flash_varlen`): no padding, no gather; with shared prompts each completion's queries attend to
its prompt's keys gathered before its own (`SharedKeys`). Everywhere else the padded-rows path
computes the same attention (tested against each other). NOVARL_PACKED_ATTENTION=padded_sdpa chooses
the padded-rows path on CUDA too. (cuDNN's varlen kernel, called through torch's private op, was tried and
removed: on an H100 its gradients did not match per-sequence attention, relative error 1.1.)

It is used for architectures whose attention is plain causal softmax attention
(no sliding window, no logit soft-capping); others keep their own attention and
pack through the T x T mask, and flash-attention reads the same keywords.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from novarl.models.architectures import PLAIN_CAUSAL
from novarl.types import to_device

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


@dataclass(frozen=True)
class SharedKeys:
    """A packed row with shared prompts as a varlen kernel takes it: attention row a's queries are
    the row's tokens whose output it gives (a group's first row: its prompt and completion; the
    others: their completion), consecutive in the packed row; its keys are the prompt's and its
    completion's, gathered. Its queries are its last keys, so causal attention aligned at the
    bottom right (flash-attention's, for fewer queries than keys) is each completion's attention
    to its prompt and itself."""

    index: torch.Tensor
    """[K] int64 the row positions of every attention row's keys, row after row."""
    cu_queries: torch.Tensor
    """[A + 1] int32 boundaries of each attention row's queries in the packed row."""
    cu_keys: torch.Tensor
    """[A + 1] int32 boundaries of each attention row's keys in `index`."""
    longest_queries: int
    longest_keys: int

    def to(self, device: torch.device) -> "SharedKeys":
        """On `device`, copies queued without waiting (as ModelInputs.to)."""
        return SharedKeys(*(to_device(t, device) for t in (self.index, self.cu_queries, self.cu_keys)),
                          self.longest_queries, self.longest_keys)


def varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     cu_seq_lens_q: torch.Tensor | None = None, max_length_q: int | None = None,
                     novarl_attention_rows: torch.Tensor | None = None,
                     novarl_attention_take: torch.Tensor | None = None,
                     novarl_shared_keys: SharedKeys | None = None, novarl_piece_length: int | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """query [B, H, T, D], key and value [B, Hkv, T, D] -> ([B, T, H, D], None).

    With cu_seq_lens_q ([k + 1] boundaries of one packed row, B = 1): each sequence attends
    causally to itself; where its pieces all hold novarl_piece_length tokens (and KERNEL_ENV chooses no
    kernel), as T / that many padded rows side by side, through SDPA's causal kernel (measured faster than
    the varlen one on an H100: cuDNN's, 75 against 126 ms a step). With novarl_attention_rows ([A, L] row
    positions) and _take ([T]): each attention row (a shared prompt and one completion) is causal attention
    over those positions, and position t's output is the flattened [A * L] output at take[t] (packed rows
    with shared prompts, backends/training/batching.py). Without: causal attention over each right-padded row."""
    if attention_mask is not None:
        raise ValueError(f"{VARLEN} attention takes right-padded rows without a mask, or packed boundaries")
    gqa = query.shape[1] != key.shape[1]
    dropout = dropout if module.training else 0.0
    if novarl_attention_rows is None and cu_seq_lens_q is None:
        return _causal_rows(query, key, value, dropout, scaling).contiguous(), None
    if novarl_piece_length is not None and novarl_attention_rows is None and ASKED is None:
        return _side_by_side(query, key, value, novarl_piece_length, dropout, scaling), None
    kernel = varlen_kernel(query, dropout)
    if kernel is not None and novarl_attention_rows is None:
        cu = cu_seq_lens_q.to(device=query.device, dtype=torch.int32)
        longest = int(max_length_q) if max_length_q is not None else int(cu.diff().max())
        return kernel(query, key, value, cu, cu, longest, longest, scaling), None
    if kernel is not None and novarl_shared_keys is not None:
        keys = novarl_shared_keys
        gathered = [t.index_select(2, keys.index) for t in (key, value)]  # a prompt's keys once per row
        return kernel(query, *gathered, keys.cu_queries, keys.cu_keys, keys.longest_queries, keys.longest_keys,
                      scaling), None
    if novarl_attention_rows is None:
        novarl_attention_rows, novarl_attention_take = sequence_rows(cu_seq_lens_q, max_length_q, query.shape[2])
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


def _causal_rows(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout: float,
                 scaling: float | None) -> torch.Tensor:
    """Causal SDPA over right-padded rows: query [B, H, L, D], key and value [B, Hkv, L, D] -> [B, L, H, D]."""
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, dropout_p=dropout, is_causal=True,
                                                           scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2)


def _side_by_side(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, length: int, dropout: float,
                  scaling: float | None) -> torch.Tensor:
    """A packed row [1, H, T, D] of pieces of `length` tokens each, as T / length causal rows: [1, T, H, D]."""
    _to_say("side_by_side", query, dropout)
    rows = query.shape[2] // length

    def split(t: torch.Tensor) -> torch.Tensor:  # [1, H, T, D] -> [rows, H, length, D]
        return t[0].unflatten(1, (rows, length)).transpose(0, 1)

    out = _causal_rows(split(query), split(key), split(value), dropout, scaling)  # [rows, length, H, D]
    return out.reshape(1, query.shape[2], query.shape[1], query.shape[3])


PACKED_KERNELS = ("flash_varlen", "padded_sdpa")
KERNEL_ENV = "NOVARL_PACKED_ATTENTION"
"""Chooses packed rows' attention kernel on CUDA among PACKED_KERNELS (unset: flash_varlen where torch
has it, else padded_sdpa)."""
ASKED: str | None = os.environ.get(KERNEL_ENV) or None
"""KERNEL_ENV as this process started with it: read once, so that compiled layers see a constant."""


def varlen_kernel(query: torch.Tensor, dropout: float):
    """The variable-length kernel packed rows' attention runs on: on CUDA in bf16/fp16 without
    dropout, torch's flash kernel (`torch.nn.attention.varlen`, torch 2.10+); a packed row's
    attention then costs its sequences' own work, with no padding and no gather. None elsewhere
    (the CPU, float32, an older torch, or NOVARL_PACKED_ATTENTION=padded_sdpa): the padded-rows
    path below, which computes the same attention. On CUDA each path is said in the log the first
    time it runs (say_attention_path)."""
    global packed_kernel
    name = _packed_choice(query, dropout)
    packed_kernel = name
    _to_say(name, query, dropout)
    return flash_varlen if name == "flash_varlen" else None


def _packed_choice(query: torch.Tensor, dropout: float) -> str:
    if not (query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and not dropout) or ASKED == "padded_sdpa":
        return "padded_sdpa"
    return "flash_varlen" if _flash_varlen() is not None else "padded_sdpa"


packed_kernel: str | None = None
"""What this process's latest packed attention ran: one of PACKED_KERNELS."""
_unsaid: tuple | None = None
"""The attention path the latest packed pass took, for say_attention_path: (path, on CUDA, dtype, dropout)."""
_said: set[str] = set()


def _to_say(path: str, query: torch.Tensor, dropout: float) -> None:
    """Note the path for the log, which say_attention_path says after the pass: a log call inside a compiled
    layer would be a graph break; a global's store is not (the compiled layer replays it)."""
    global _unsaid
    _unsaid = (path, query.is_cuda, query.dtype, bool(dropout))


def say_attention_path() -> None:
    """Say in the log, once each, which path packed attention took on CUDA (and a KERNEL_ENV that names no
    kernel). Called after each model pass (backends/training/rows.py run_model, megatron_model.py _run_model);
    the CPU's path is the only one it has, not said."""
    global _unsaid
    if _unsaid is None:
        return
    (path, cuda, dtype, dropout), _unsaid = _unsaid, None
    from novarl.logging.console import info

    if ASKED is not None and ASKED not in PACKED_KERNELS and ASKED not in _said:
        _said.add(ASKED)
        info(f"warning: {KERNEL_ENV}={ASKED!r} is not a packed attention kernel ({', '.join(PACKED_KERNELS)}): "
             "not used")
    if not cuda or path in _said:
        return
    _said.add(path)
    info("packed attention: " + {
        "flash_varlen": "torch's flash varlen kernel (torch.nn.attention.varlen)",
        "side_by_side": "rows whose pieces are all alike as padded rows side by side (SDPA)",
    }.get(path, "causal SDPA over each sequence's padded row (" + (
        f"{KERNEL_ENV}=padded_sdpa" if ASKED == "padded_sdpa" else
        f"no varlen kernel for {str(dtype).removeprefix('torch.')}{' with dropout' if dropout else ''} "
        f"in torch {torch.__version__}") + ")"))


def _flash_varlen():
    """torch.nn.attention.varlen.varlen_attn and the names of its keyword arguments, or None."""
    global _varlen_api
    if _varlen_api is None:
        try:
            import inspect

            from torch.nn.attention.varlen import varlen_attn
        except ImportError:
            _varlen_api = False
        else:
            _varlen_api = (varlen_attn, set(inspect.signature(varlen_attn).parameters))
    return _varlen_api or None


_varlen_api = None


def flash_varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_queries: torch.Tensor,
                 cu_keys: torch.Tensor, longest_queries: int, longest_keys: int, scaling: float | None) -> torch.Tensor:
    """query [1, H, Tq, D], key and value [1, Hkv, Tk, D], boundaries [k + 1] int32 of the k
    sequences' queries and keys -> [1, Tq, H, D]: causal attention of each sequence's queries to
    its keys, aligned at the bottom right (its queries are its last keys); torch's varlen kernel."""
    varlen_attn, keywords = _flash_varlen()
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, D]
    options: dict = {"scale": scaling}
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in keywords:
            options["enable_gqa"] = True
        else:
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    if "window_size" in keywords:
        options["window_size"] = (-1, 0)
    else:
        options["is_causal"] = True
    out = varlen_attn(q.contiguous(), k.contiguous(), v.contiguous(), cu_queries, cu_keys, longest_queries,
                      longest_keys, **options)
    return out[None]


def sequence_rows(cu_seqlens: torch.Tensor, longest: int | None, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For a packed row's boundaries [k + 1] and its length T (cu_seqlens[-1]): the attention rows [k, L]
    (each sequence's positions, then whatever follows it: at the end of a causal row nothing real attends
    to it) and take [T] (where each position's output is in the flattened [k * L] rows). With the longest
    sequence L given, nothing is read back from the boundaries' device."""
    cu = cu_seqlens.long()
    lengths = cu.diff()
    longest = int(longest) if longest is not None else int(lengths.max())
    rows = (cu[:-1, None] + torch.arange(longest, device=cu.device)).clamp(max=total - 1)
    sequence = torch.repeat_interleave(torch.arange(len(lengths), device=cu.device), lengths, output_size=total)
    take = sequence * longest + torch.arange(total, device=cu.device) - cu[sequence]
    return rows, take
