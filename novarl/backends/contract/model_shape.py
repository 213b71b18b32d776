"""The shape of a decoder-only language model, and its parameter count, without
loading weights: from a Hugging Face `config.json` (a dict, a local folder, or
the local Hugging Face cache), or an assumed Llama-like shape for a bare count
such as "7.5B".

Layout counted (Llama / Qwen2 / Qwen3 / Mistral / Mixtral):
  embeddings             vocab x hidden
  per layer  attention   q: hidden x (heads*head_dim), k and v: hidden x (kv_heads*head_dim),
                         o: (heads*head_dim) x hidden; q/k/v biases if `attention_bias`
                         (Qwen2); q/k RMSNorms of head_dim if `qk_norm` (Qwen3)
             MLP         gate, up, down: 3 x hidden x intermediate (SwiGLU);
                         MoE: experts x 3 x hidden x moe_intermediate + router hidden x experts
                         (+ a shared expert and its gate, Qwen2-MoE)
             norms       2 RMSNorms of hidden
  final norm             hidden
  lm_head                vocab x hidden, unless tied to the embeddings
Not counted: multi-head latent attention (DeepSeek), sliding-window or
dense-first-layers MoE variants (every layer is taken as MoE when experts > 1).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from novarl.errors import UserError

from novarl.models.architectures import PLAIN_CAUSAL, SOFT_CAPPED_HEAD, plain_head


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    num_layers: int
    """Decoder layers (HF `num_hidden_layers`)."""
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    """Equal to `num_attention_heads` without grouped-query attention."""
    head_dim: int
    intermediate_size: int
    """Width of the dense SwiGLU MLP."""
    vocab_size: int
    tie_word_embeddings: bool = False
    """True: the lm_head is the embedding matrix (counted once)."""
    attention_bias: bool = False
    """Biases on q, k and v (Qwen2); o has none."""
    qk_norm: bool = False
    """RMSNorm of head_dim on q and on k (Qwen3)."""
    heads_split: bool = True
    """The DTensor backend's default tensor-parallel plans can split the attention by heads (False: OLMo 2, whose
    query/key norms span every head's outputs: backends/training/parallelize.check_splittable refuses it)."""
    num_experts: int = 1
    """Routed experts per MoE layer; 1 for a dense model."""
    num_experts_per_token: int = 1
    moe_intermediate_size: int | None = None
    """Width of one expert's MLP; None: `intermediate_size` (Mixtral)."""
    shared_expert_intermediate_size: int = 0
    """Width of the always-on shared expert (Qwen2-MoE); 0: none."""
    source: str = ""
    """Where the shape came from, for messages: a path, an id or 'assumed for 7.5B'."""
    plain_causal_attention: bool = True
    """Attention is plain causal softmax attention (Llama/Qwen2/Qwen3/Mistral without a sliding
    window): what novarl's context parallelism computes (models/context_parallel.py)."""
    picking_head: bool = True
    """The logits are the output head's as is (architectures.plain_head): the DTensor and DeepSpeed
    backends take the following tokens' logprobs from the Hugging Face head chunk by chunk, without the
    logits over the vocabulary (models/logprob_head.py; Megatron's output layer picks for every model it
    converts)."""

    # ------------------------------------------------------------ parameter counts
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 1

    @property
    def embedding_parameters(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_parameters(self) -> int:
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def attention_parameters_per_layer(self) -> int:
        q_width = self.num_attention_heads * self.head_dim
        kv_width = self.num_key_value_heads * self.head_dim
        count = 2 * self.hidden_size * q_width + 2 * self.hidden_size * kv_width
        if self.attention_bias:
            count += q_width + 2 * kv_width
        if self.qk_norm:
            count += 2 * self.head_dim
        return count

    @property
    def expert_parameters_per_layer(self) -> int:
        """The routed experts' weights: what expert parallelism splits. 0 when dense."""
        if not self.is_moe:
            return 0
        return self.num_experts * 3 * self.hidden_size * (self.moe_intermediate_size or self.intermediate_size)

    @property
    def mlp_parameters_per_layer(self) -> int:
        if not self.is_moe:
            return 3 * self.hidden_size * self.intermediate_size
        router = self.hidden_size * self.num_experts
        shared = 0
        if self.shared_expert_intermediate_size:
            shared = 3 * self.hidden_size * self.shared_expert_intermediate_size + self.hidden_size
        return self.expert_parameters_per_layer + router + shared

    @property
    def layer_parameters(self) -> int:
        return self.attention_parameters_per_layer + self.mlp_parameters_per_layer + 2 * self.hidden_size

    @property
    def parameters(self) -> int:
        return (self.embedding_parameters + self.num_layers * self.layer_parameters
                + self.hidden_size + self.lm_head_parameters)

    @property
    def active_parameters(self) -> int:
        """Parameters one token passes through: `num_experts_per_token` of the experts."""
        if not self.is_moe:
            return self.parameters
        idle = self.num_experts - self.num_experts_per_token
        idle_per_layer = idle * 3 * self.hidden_size * (self.moe_intermediate_size or self.intermediate_size)
        return self.parameters - self.num_layers * idle_per_layer

    # ---------------------------------------------------------------- constructors
    @classmethod
    def from_hf_config(cls, config: dict[str, Any], source: str = "config.json") -> ModelShape:
        """From the dict of a Hugging Face `config.json` (multimodal: its `text_config`)."""
        if not isinstance(config, dict):
            raise UserError(f"{source}: a config.json holds a JSON object, not {type(config).__name__}.")
        if isinstance(config.get("text_config"), dict):
            config = {"model_type": config.get("model_type"), **config["text_config"]}
        needed = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        absent = [key for key in needed if not config.get(key)]
        if absent:
            raise UserError(f"{source}: no {', '.join(absent)}; novarl reads Llama/Qwen/Mistral-style "
                            "configs. Give a parameter count such as '7B' instead.")
        wrong = [f"{key}={config[key]!r}" for key in (*needed, "num_key_value_heads", "head_dim", "num_experts",
                                                       "num_local_experts", "num_experts_per_tok",
                                                       "moe_intermediate_size", "shared_expert_intermediate_size")
                 if config.get(key) is not None and not _is_count(config[key])]
        if wrong:
            raise UserError(f"{source}: {', '.join(wrong)}: each must be a whole number.")
        heads = config["num_attention_heads"]
        model_type = str(config.get("model_type") or "")
        experts = config.get("num_local_experts") or config.get("num_experts") or 1
        return cls(
            num_layers=config["num_hidden_layers"],
            hidden_size=config["hidden_size"],
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            intermediate_size=config["intermediate_size"],
            vocab_size=config["vocab_size"],
            # LlamaConfig, Qwen2Config and MistralConfig default to untied.
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases and its config does not say so.
            attention_bias=bool(config.get("attention_bias", model_type in ("qwen2", "qwen2_moe"))),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            heads_split=model_type != "olmo2",
            num_experts=int(experts),
            num_experts_per_token=int(config.get("num_experts_per_tok") or 1) if experts > 1 else 1,
            moe_intermediate_size=config.get("moe_intermediate_size"),
            shared_expert_intermediate_size=int(config.get("shared_expert_intermediate_size") or 0),
            source=source,
            plain_causal_attention=model_type in PLAIN_CAUSAL and not (
                config.get("sliding_window") and config.get("use_sliding_window", True)),
            picking_head=plain_head(model_type, config.get("final_logit_softcapping",
                                                           SOFT_CAPPED_HEAD.get(model_type))),
        )

    @classmethod
    def from_folder(cls, path: str | os.PathLike[str], overrides: Mapping[str, Any] | None = None) -> ModelShape:
        """From `<path>/config.json` (or `path` itself if it is the file), with `overrides`' keys replacing
        its own (policy.hf_config_overrides). No weights are read."""
        path = Path(path)
        file = path if path.is_file() else path / "config.json"
        if not file.is_file():
            raise UserError(f"{path}: no config.json there. Give a model folder with its config.json, "
                            "a Hugging Face id, or a parameter count such as '7B'.")
        try:
            config = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError) as err:  # ValueError: not JSON, or not UTF-8 text
            raise UserError(f"{file}: cannot be read as JSON ({err}).") from None
        if overrides and isinstance(config, dict):
            config = {**config, **overrides}
        return cls.from_hf_config(config, source=str(file))

    @classmethod
    def from_parameter_count(cls, count: str | int | float) -> ModelShape:
        """An assumed Llama-like shape with about `count` parameters ("7.5B", "500M", 7.5e9).

        Assumptions (Llama 3 family): hidden size from `_ASSUMED_WIDTHS` by size,
        head_dim 128, at most 8 KV heads, intermediate 3.5 x hidden rounded up to
        a multiple of 256 (Llama 3 8B and 70B: 14336 for 4096, 28672 for 8192),
        vocab 128256, embeddings tied up to hidden 3072 (as Llama 3.2 1B/3B). The
        number of layers is then solved for the count, so `parameters` lands
        within half a layer of it: under 4% from 100M up, checked to be within 10%.
        A count under ~70M raises UserError: the assumed embeddings alone are bigger.
        """
        wanted = parse_parameter_count(count)
        hidden = next((width for limit, width in _ASSUMED_WIDTHS if wanted <= limit), _ASSUMED_WIDTHS[-1][1])
        heads = hidden // 128
        base = cls(num_layers=1, hidden_size=hidden, num_attention_heads=heads,
                   num_key_value_heads=min(heads, 8), head_dim=128,
                   intermediate_size=256 * math.ceil(3.5 * hidden / 256),
                   vocab_size=128256, tie_word_embeddings=hidden <= 3072,
                   source=f"assumed Llama-like shape for {count}")
        outside = base.parameters - base.layer_parameters
        layers = max(1, round((wanted - outside) / base.layer_parameters))
        shape = cls(**{**base.__dict__, "num_layers": layers})
        if abs(shape.parameters - wanted) > 0.1 * wanted:
            raise UserError(f"parameter count {count!r} is too small for an assumed Llama-like shape "
                            f"(its 128k-token embeddings alone hold {base.embedding_parameters:,}); "
                            "give the model's config.json instead.")
        return shape

    @classmethod
    def from_name(cls, name: str, *, download: bool = False, overrides: Mapping[str, Any] | None = None
                  ) -> ModelShape:
        """A parameter count ("7B"), a local folder, or a Hugging Face id whose
        config.json is in the local cache (fetched, config.json only, if `download`); a
        config.json's keys replaced by `overrides`."""
        if Path(name).exists():
            return cls.from_folder(name, overrides)
        if _COUNT.match(name):
            return cls.from_parameter_count(name)
        try:
            from huggingface_hub import hf_hub_download, try_to_load_from_cache
        except ImportError:  # pragma: no cover - huggingface_hub comes with transformers
            raise UserError(f"'{name}' is not a folder and huggingface_hub is not installed to look it up.") from None
        cached = try_to_load_from_cache(name, "config.json")
        if isinstance(cached, str):
            return cls.from_folder(cached, overrides)
        if not download:
            raise UserError(f"'{name}' is neither a parameter count, a local folder, nor a Hugging Face id "
                            "with config.json in the local cache. Download its config.json, or give a "
                            "parameter count such as '7B'.")
        try:
            return cls.from_folder(hf_hub_download(name, "config.json"), overrides)
        except Exception as err:  # noqa: BLE001 - any hub failure is the user's id or network
            raise UserError(f"'{name}': cannot fetch config.json from the Hugging Face hub ({err}).") from None


# (largest parameter count, hidden size) after Llama 3.2 1B (2048), 3B (3072),
# Llama 3 8B (4096), 70B (8192), Llama 3.1 405B (16384) and Korthikanti et al.'s
# 1T (25600); the limits keep the solved layer count between about 10 and 130
# from 100M to 1T.
_ASSUMED_WIDTHS: tuple[tuple[float, int], ...] = (
    (0.3e9, 512), (0.8e9, 1024), (1.6e9, 2048), (4.5e9, 3072), (11e9, 4096), (20e9, 5120),
    (40e9, 6144), (100e9, 8192), (220e9, 12288), (450e9, 16384), (800e9, 20480), (math.inf, 25600),
)

KEPT_UNIT_PARAMETERS = 1 << 28
"""Parameters of decoder layers that make one FSDP2 unit where a data-parallel shard keeps its gathered weights
through a step (the DTensor backend's keeps_gathered): 268 M (5 of Qwen2.5-1.5B's 47 M-parameter layers)."""


def layers_per_kept_unit(layer_parameters: int, num_layers: int) -> int:
    """How many consecutive decoder layers share one FSDP2 unit (one gather, one gradient reduction and one set
    of hooks) where a shard keeps its gathered weights: per-layer units save no memory there (every layer stays
    gathered), and each costs its hooks' host time in every forward and backward (28 layers in one run: a training
    step's host time 0.72-0.87x, benchmarks/results/host_overhead_cpu.md). A unit's size bounds the transient
    buffers of its gather and of its gradients' reduction; at least one layer, at most all. (On one device the
    DTensor backend's model is not FSDP2's: backends/training/one_device.py.)"""
    return max(1, min(num_layers, KEPT_UNIT_PARAMETERS // max(layer_parameters, 1)))


def largest_weight(shape: ModelShape) -> int:
    """The most elements one weight tensor of the model holds: the embedding (or the output head), an MLP's
    projection (gate and up fused in some architectures: counted as two), or a mixture's experts, which
    transformers holds as one tensor for all of them."""
    mlp = 2 * shape.intermediate_size * shape.hidden_size
    if shape.num_experts > 1:
        experts = shape.moe_intermediate_size or shape.intermediate_size
        mlp = max(mlp, 2 * shape.num_experts * experts * shape.hidden_size)
    return max(shape.vocab_size * shape.hidden_size, mlp)


_COUNT = re.compile(r"^\s*(\d+(?:\.\d*)?(?:[eE]\d+)?)\s*([kKmMbBtT]?)\s*$")
_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}


def parse_parameter_count(count: str | int | float) -> int:
    """'7.5B' -> 7_500_000_000; also 'M', 'K', 'T', plain numbers and 7.5e9."""
    if isinstance(count, (int, float)) and not isinstance(count, bool):
        value = float(count)
    else:
        match = _COUNT.match(str(count))
        if not match:
            raise UserError(f"parameter count {count!r} is not a number with an optional K/M/B/T suffix "
                            "(e.g. '7.5B', '500M').")
        value = float(match.group(1)) * _SUFFIX[match.group(2).lower()]
    if not value >= 1:
        raise UserError(f"parameter count {count!r} must be positive.")
    return int(round(value))


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def head_problems(shape: ModelShape | None, key: str, size: int, *, kv_replicated: bool) -> list[str]:
    """Tensor parallelism splits attention by heads: `size` must divide the query heads and
    the KV heads. kv_replicated (vLLM): fewer KV heads than ranks is allowed when `size`
    is a multiple of them, each KV head then living on size / kv_heads ranks."""
    if shape is None or size == 1:
        return []
    heads, kv_heads = shape.num_attention_heads, shape.num_key_value_heads
    kv_fits = not kv_heads % size or (kv_replicated and kv_heads < size and not size % kv_heads)
    if not heads % size and kv_fits:
        return []
    need = "divide num_attention_heads and divide (or be a multiple of) num_key_value_heads" if kv_replicated \
        else "divide num_attention_heads and num_key_value_heads"
    return [f"{key}={size} must {need}: the model ({shape.source}) has num_attention_heads={heads}, "
            f"num_key_value_heads={kv_heads}."]
