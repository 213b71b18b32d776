"""Hugging Face <-> Megatron-core weights for Llama-family models (Llama, Qwen2, Qwen3, Mistral)
and the Mixture-of-Experts layers of Mixtral, Qwen2-MoE and Qwen3-MoE (router + per-expert MLPs,
whole on every tensor-parallel rank, cut by expert-parallel rank, then by expert-tensor-parallel
rank, at load time; Qwen2-MoE's gated shared expert split like a dense MLP).

Pure tensor work: nothing here imports megatron-core, so conversion runs (and is
tested) anywhere; megatron-core checks the result when it loads it.

Megatron's GPTModel names and layouts (the local layer spec; the Transformer
Engine spec fuses the two pre-norms into the linear layers that follow them,
`fused_norms=True`):

    embedding.word_embeddings.weight          [V, h]      vocab-parallel (rows)
    decoder.layers.i.input_layernorm.weight   [h]         replicated
        (TE: decoder.layers.i.self_attention.linear_qkv.layer_norm_weight)
    decoder.layers.i.self_attention.linear_qkv.weight [(nq + 2 nkv) d, h]
        column-parallel; rows grouped per KV group g: the group's nq/nkv query
        heads, then its key head, then its value head (Qwen2 adds the bias, same rows)
    decoder.layers.i.self_attention.linear_proj.weight [h, nq d]   row-parallel
    decoder.layers.i.self_attention.q_layernorm.weight [d]  (and k_layernorm; Qwen3) replicated
    decoder.layers.i.pre_mlp_layernorm.weight [h]
        (TE: decoder.layers.i.mlp.linear_fc1.layer_norm_weight)
    decoder.layers.i.mlp.linear_fc1.weight    [2 f, h]    column-parallel; [gate; up]
        on each tensor-parallel rank (so the full tensor is [gate_0; up_0; gate_1; ...])
    decoder.layers.i.mlp.linear_fc2.weight    [h, f]      row-parallel
    decoder.final_layernorm.weight            [h]
    output_layer.weight                       [V, h]      vocab-parallel; absent when tied

The vocabulary is padded with zero rows to a multiple of the tensor-parallel size
(`padded_vocab_size`); converting back drops the padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from novarl.errors import UserError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen2_moe", "qwen3_moe")
MOE_MODEL_TYPES = {"mixtral": "num_local_experts", "qwen2_moe": "num_experts", "qwen3_moe": "num_experts"}
"""Mixture-of-Experts model types, and their config's name for the experts per layer."""
EXPERTS = ".mlp.experts.local_experts."
"""Megatron's per-expert MLPs (SequentialMLP): decoder.layers.i.mlp.experts.local_experts.j.linear_fc1/2."""


@dataclass(frozen=True)
class LayerShape:
    """What the conversion needs to know of a Hugging Face config."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tied: bool
    qkv_bias: bool
    num_experts: int = 0
    """Mixture-of-Experts: experts per layer (0: a dense MLP); ffn_hidden_size is each expert's."""
    experts_per_token: int = 0
    qk_norm: bool = False
    """Qwen3: an RMSNorm over each query and key head (Megatron's qk_layernorm)."""
    shared_expert_size: int = 0
    """Qwen2-MoE: a shared expert of this MLP size beside the routed ones, scaled by a sigmoid gate."""
    router_pre_softmax: bool = False
    """The routing weights are the softmax over every expert, top-k of them kept as they are (Qwen
    MoE without norm_topk_prob); else the softmax over the top-k logits (Mixtral; Qwen with it)."""

    @classmethod
    def from_hf_config(cls, config) -> "LayerShape":
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UserError(f"Megatron conversion supports model types {', '.join(SUPPORTED_MODEL_TYPES)}; "
                            f"this model is '{model_type}'.")
        heads, moe, qwen_moe = config.num_attention_heads, model_type in MOE_MODEL_TYPES, model_type.endswith("_moe")
        if qwen_moe and (getattr(config, "mlp_only_layers", None) or getattr(config, "decoder_sparse_step", 1) != 1):
            raise UserError(f"Megatron conversion maps every layer of a {model_type} model as a Mixture-of-Experts "
                            f"layer; this one has dense layers (mlp_only_layers={config.mlp_only_layers}, "
                            f"decoder_sparse_step={config.decoder_sparse_step}).")
        return cls(num_layers=config.num_hidden_layers, hidden_size=config.hidden_size, num_heads=heads,
                   num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                   head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                   ffn_hidden_size=config.moe_intermediate_size if qwen_moe else config.intermediate_size,
                   vocab_size=config.vocab_size, tied=bool(getattr(config, "tie_word_embeddings", False)),
                   qkv_bias=(model_type == "qwen2" or bool(getattr(config, "qkv_bias", False))
                             or bool(getattr(config, "attention_bias", False))),
                   num_experts=getattr(config, MOE_MODEL_TYPES[model_type]) if moe else 0,
                   experts_per_token=config.num_experts_per_tok if moe else 0,
                   qk_norm=model_type in ("qwen3", "qwen3_moe"),
                   shared_expert_size=config.shared_expert_intermediate_size if model_type == "qwen2_moe" else 0,
                   router_pre_softmax=qwen_moe and not config.norm_topk_prob)

    def padded_vocab_size(self, tensor_parallel_size: int) -> int:
        return -(-self.vocab_size // tensor_parallel_size) * tensor_parallel_size

    def check_tensor_parallel(self, tp: int) -> None:
        if tp < 1 or self.num_kv_heads % tp or self.num_heads % tp or self.ffn_hidden_size % tp:
            raise UserError(f"tensor_parallel_size={tp} must divide the {self.num_heads} attention heads, the "
                            f"{self.num_kv_heads} key/value heads and the MLP size {self.ffn_hidden_size}.")


# ------------------------------------------------------------ whole tensors
def hf_to_megatron(hf: dict[str, torch.Tensor], shape: LayerShape, *, tensor_parallel_size: int = 1,
                   fused_norms: bool = False) -> dict[str, torch.Tensor]:
    """The full (unsharded) Megatron state dict for a Hugging Face one, laid out for
    `tensor_parallel_size` ranks: fc1 holds each rank's [gate; up] in turn, and the
    vocabulary is padded to a multiple of it; `shard` cuts it into the ranks' parts."""
    tp = tensor_parallel_size
    shape.check_tensor_parallel(tp)
    names = _names(fused_norms, moe=shape.num_experts > 0)
    out = {"embedding.word_embeddings.weight": _pad_vocab(hf["model.embed_tokens.weight"], shape, tp),
           "decoder.final_layernorm.weight": hf["model.norm.weight"]}
    if not shape.tied:
        out["output_layer.weight"] = _pad_vocab(hf["lm_head.weight"], shape, tp)
    for i in range(shape.num_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[dst + names["input_norm"]] = hf[src + "input_layernorm.weight"]
        out[dst + names["mlp_norm"]] = hf[src + "post_attention_layernorm.weight"]
        attn = src + "self_attn."
        out[dst + "self_attention.linear_qkv.weight"] = _fuse_qkv(
            hf[attn + "q_proj.weight"], hf[attn + "k_proj.weight"], hf[attn + "v_proj.weight"], shape)
        if shape.qkv_bias:
            out[dst + "self_attention.linear_qkv.bias"] = _fuse_qkv(
                hf[attn + "q_proj.bias"], hf[attn + "k_proj.bias"], hf[attn + "v_proj.bias"], shape)
        out[dst + "self_attention.linear_proj.weight"] = hf[attn + "o_proj.weight"]
        if shape.qk_norm:
            out[dst + "self_attention.q_layernorm.weight"] = hf[attn + "q_norm.weight"]
            out[dst + "self_attention.k_layernorm.weight"] = hf[attn + "k_norm.weight"]
        if shape.num_experts:
            out.update(_experts_to_megatron(hf, src, dst, shape, tp))
            continue
        out.update(_mlp_to_megatron(hf, src + "mlp.", dst + "mlp.", tp))
    return out


def megatron_to_hf(mc: dict[str, torch.Tensor], shape: LayerShape, *, tensor_parallel_size: int = 1,
                   fused_norms: bool = False) -> dict[str, torch.Tensor]:
    """The Hugging Face state dict for a full Megatron one (the inverse of hf_to_megatron)."""
    tp = tensor_parallel_size
    names = _names(fused_norms, moe=shape.num_experts > 0)
    embed = mc["embedding.word_embeddings.weight"][:shape.vocab_size]
    out = {"model.embed_tokens.weight": embed, "model.norm.weight": mc["decoder.final_layernorm.weight"],
           "lm_head.weight": embed if shape.tied else mc["output_layer.weight"][:shape.vocab_size]}
    for i in range(shape.num_layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[dst + "input_layernorm.weight"] = mc[src + names["input_norm"]]
        out[dst + "post_attention_layernorm.weight"] = mc[src + names["mlp_norm"]]
        attn = dst + "self_attn."
        q, k, v = _split_qkv(mc[src + "self_attention.linear_qkv.weight"], shape)
        out.update({attn + "q_proj.weight": q, attn + "k_proj.weight": k, attn + "v_proj.weight": v})
        if shape.qkv_bias:
            q, k, v = _split_qkv(mc[src + "self_attention.linear_qkv.bias"], shape)
            out.update({attn + "q_proj.bias": q, attn + "k_proj.bias": k, attn + "v_proj.bias": v})
        out[attn + "o_proj.weight"] = mc[src + "self_attention.linear_proj.weight"]
        if shape.qk_norm:
            out[attn + "q_norm.weight"] = mc[src + "self_attention.q_layernorm.weight"]
            out[attn + "k_norm.weight"] = mc[src + "self_attention.k_layernorm.weight"]
        if shape.num_experts:
            out.update(_experts_to_hf(mc, src, dst, shape, tp))
            continue
        out.update(_mlp_to_hf(mc, src + "mlp.", dst + "mlp.", tp))
    return out


# ---------------------------------------------------- tensor-parallel shards
COLUMN_PARALLEL = ("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "word_embeddings.weight",
                   "output_layer.weight")
ROW_PARALLEL = ("linear_proj.weight", "linear_fc2.weight")


def shard(mc: dict[str, torch.Tensor], *, rank: int, tensor_parallel_size: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s part of a full Megatron state dict: column-parallel tensors split by
    rows (qkv by whole KV groups, each group's rows being contiguous; fc1 into that rank's
    [gate; up]), row-parallel by columns, the rest replicated."""
    return {name: _part(name, tensor, rank, tensor_parallel_size) for name, tensor in mc.items()}


def unshard(shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The full Megatron state dict from every tensor-parallel rank's part, in rank order."""
    first = shards[0]
    return {name: _join(name, [s[name] for s in shards]) for name in first}


def _part(name: str, tensor: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    dim = _parallel_dim(name)
    return tensor if dim is None else tensor.chunk(tp, dim=dim)[rank].clone()


def _join(name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    dim = _parallel_dim(name)
    return parts[0] if dim is None else torch.cat(parts, dim=dim)


def _parallel_dim(name: str) -> int | None:
    if EXPERTS in name:  # whole on every tensor-parallel rank; expert_tensor_part cuts them at load time
        return None
    if name.endswith(COLUMN_PARALLEL):
        return 0
    if name.endswith(ROW_PARALLEL):
        return 1
    return None


def shards_to_hf(parts: list[tuple[int, int, dict[str, torch.Tensor]]], shape, *, tensor_parallel_size: int,
                 fused_norms: bool, experts: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Hugging Face weights from every (tensor-parallel rank, pipeline stage, that rank's
    state dict with global layer numbers): each stage's shards joined, then converted.
    `experts`: every expert's weights (global layer and expert numbers), gathered apart
    because expert-parallel ranks hold different experts."""
    stages: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
    for tp_rank, pp_rank, state in parts:
        stages.setdefault(pp_rank, {})[tp_rank] = state
    full: dict[str, torch.Tensor] = dict(experts or {})
    for pp_rank in sorted(stages):
        by_tp = stages[pp_rank]
        full.update(unshard([by_tp[r] for r in range(tensor_parallel_size)]))
    return megatron_to_hf(full, shape, tensor_parallel_size=tensor_parallel_size, fused_norms=fused_norms)


def experts_of_rank(state: dict[str, torch.Tensor], *, rank: int, expert_parallel_size: int,
                    num_experts: int) -> dict[str, torch.Tensor]:
    """`state` with only expert-parallel rank `rank`'s experts, numbered from 0 as its
    layers name them (the rest of the state kept)."""
    per_rank = num_experts // expert_parallel_size
    return _renumber_experts(state, lambda j: j - rank * per_rank if j // per_rank == rank else None)


def experts_to_global(state: dict[str, torch.Tensor], *, rank: int, expert_parallel_size: int,
                      num_experts: int) -> dict[str, torch.Tensor]:
    """The inverse of experts_of_rank for one rank's experts."""
    per_rank = num_experts // expert_parallel_size
    return _renumber_experts(state, lambda j: j + rank * per_rank)


def expert_tensor_part(state: dict[str, torch.Tensor], *, rank: int,
                       expert_tensor_parallel_size: int) -> dict[str, torch.Tensor]:
    """`state` with each expert's MLP cut to expert-tensor-parallel rank `rank`'s part, as a
    dense MLP is over tensor-parallel ranks: fc1 column-parallel, each rank its [gate; up]
    rows; fc2 row-parallel, split by columns (the rest kept)."""
    etp = expert_tensor_parallel_size
    if etp == 1:
        return state
    out = {}
    for name, tensor in state.items():
        if EXPERTS in name and name.endswith("linear_fc1.weight"):
            gate, up = tensor.chunk(2)
            tensor = torch.cat([gate.chunk(etp)[rank], up.chunk(etp)[rank]])
        elif EXPERTS in name and name.endswith("linear_fc2.weight"):
            tensor = tensor.chunk(etp, dim=1)[rank].clone()
        out[name] = tensor
    return out


def join_expert_tensor_parts(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The inverse of expert_tensor_part: whole experts from every expert-tensor-parallel
    rank's part, in rank order."""
    if len(parts) == 1:
        return parts[0]
    out = {}
    for name in parts[0]:
        pieces = [part[name] for part in parts]
        if EXPERTS in name and name.endswith("linear_fc1.weight"):
            halves = [piece.chunk(2) for piece in pieces]
            out[name] = torch.cat([torch.cat([gate for gate, _ in halves]), torch.cat([up for _, up in halves])])
        elif EXPERTS in name and name.endswith("linear_fc2.weight"):
            out[name] = torch.cat(pieces, dim=1)
        else:
            out[name] = pieces[0]
    return out


def experts_file(ep_rank: int, pp_rank: int, etp_rank: int = 0, etp_size: int = 1) -> str:
    """A Megatron checkpoint's file of one expert-parallel rank's experts on one stage (one
    expert-tensor-parallel rank's part of them where experts are split)."""
    return f"experts_ep{ep_rank}_pp{pp_rank}.pt" if etp_size == 1 else \
        f"experts_ep{ep_rank}_etp{etp_rank}_pp{pp_rank}.pt"


def _renumber_experts(state: dict[str, torch.Tensor], new_index) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in state.items():
        if EXPERTS not in name:
            out[name] = tensor
            continue
        head, tail = name.split(EXPERTS)
        index, rest = tail.split(".", 1)
        renumbered = new_index(int(index))
        if renumbered is not None:
            out[f"{head}{EXPERTS}{renumbered}.{rest}"] = tensor
    return out


# ------------------------------------------------------------------ helpers
def _mlp_to_megatron(hf: dict[str, torch.Tensor], src: str, dst: str, tp: int) -> dict:
    """A gated MLP (gate_proj, up_proj, down_proj under `src`) as Megatron's fc1 (each
    tensor-parallel rank's [gate; up] in turn) and fc2, under `dst`."""
    gate, up = hf[src + "gate_proj.weight"], hf[src + "up_proj.weight"]
    return {dst + "linear_fc1.weight": torch.cat([torch.cat(pair) for pair in zip(gate.chunk(tp), up.chunk(tp))]),
            dst + "linear_fc2.weight": hf[src + "down_proj.weight"]}


def _mlp_to_hf(mc: dict[str, torch.Tensor], src: str, dst: str, tp: int) -> dict:
    pairs = [chunk.chunk(2) for chunk in mc[src + "linear_fc1.weight"].chunk(tp)]
    return {dst + "gate_proj.weight": torch.cat([gate for gate, _ in pairs]),
            dst + "up_proj.weight": torch.cat([up for _, up in pairs]),
            dst + "down_proj.weight": mc[src + "linear_fc2.weight"]}


def _experts_to_megatron(hf: dict[str, torch.Tensor], src: str, dst: str, shape: LayerShape, tp: int) -> dict:
    """The router and stacked experts ([E, 2f, h] gate;up and [E, h, f] down) as Megatron's
    router and per-expert MLPs; Qwen2-MoE's shared expert and its gate as Megatron's."""
    out = {dst + "mlp.router.weight": hf[src + "mlp.gate.weight"]}
    gate_up, down = hf[src + "mlp.experts.gate_up_proj"], hf[src + "mlp.experts.down_proj"]
    for j in range(shape.num_experts):
        out[f"{dst}mlp.experts.local_experts.{j}.linear_fc1.weight"] = gate_up[j]
        out[f"{dst}mlp.experts.local_experts.{j}.linear_fc2.weight"] = down[j]
    if shape.shared_expert_size:
        out.update(_mlp_to_megatron(hf, src + "mlp.shared_expert.", dst + "mlp.shared_experts.", tp))
        out[dst + "mlp.shared_experts.gate_weight"] = hf[src + "mlp.shared_expert_gate.weight"]
    return out


def _experts_to_hf(mc: dict[str, torch.Tensor], src: str, dst: str, shape: LayerShape, tp: int) -> dict:
    experts = range(shape.num_experts)
    out = {dst + "mlp.gate.weight": mc[src + "mlp.router.weight"],
           dst + "mlp.experts.gate_up_proj": torch.stack(
               [mc[f"{src}mlp.experts.local_experts.{j}.linear_fc1.weight"] for j in experts]),
           dst + "mlp.experts.down_proj": torch.stack(
               [mc[f"{src}mlp.experts.local_experts.{j}.linear_fc2.weight"] for j in experts])}
    if shape.shared_expert_size:
        out.update(_mlp_to_hf(mc, src + "mlp.shared_experts.", dst + "mlp.shared_expert.", tp))
        out[dst + "mlp.shared_expert_gate.weight"] = mc[src + "mlp.shared_experts.gate_weight"]
    return out
def _names(fused_norms: bool, moe: bool = False) -> dict[str, str]:
    if fused_norms:  # a Mixture-of-Experts layer keeps its MLP norm apart (no single fc1 to fuse into)
        return {"input_norm": "self_attention.linear_qkv.layer_norm_weight",
                "mlp_norm": "pre_mlp_layernorm.weight" if moe else "mlp.linear_fc1.layer_norm_weight"}
    return {"input_norm": "input_layernorm.weight", "mlp_norm": "pre_mlp_layernorm.weight"}


def _pad_vocab(weight: torch.Tensor, shape: LayerShape, tp: int) -> torch.Tensor:
    pad = shape.padded_vocab_size(tp) - weight.shape[0]
    return torch.cat([weight, weight.new_zeros(pad, *weight.shape[1:])]) if pad else weight


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: LayerShape) -> torch.Tensor:
    """[q; k; v] (HF) -> per KV group [its query heads; its key; its value] (Megatron)."""
    groups, d = shape.num_kv_heads, shape.head_dim
    per_group = shape.num_heads // groups
    rest = q.shape[1:]
    q = q.reshape(groups, per_group * d, *rest)
    k = k.reshape(groups, d, *rest)
    v = v.reshape(groups, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _split_qkv(qkv: torch.Tensor, shape: LayerShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, d = shape.num_kv_heads, shape.head_dim
    per_group = shape.num_heads // groups
    rest = qkv.shape[1:]
    grouped = qkv.reshape(groups, (per_group + 2) * d, *rest)
    q, k, v = grouped.split([per_group * d, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)
