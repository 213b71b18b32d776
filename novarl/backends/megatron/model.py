"""A Hugging Face Llama-family model (Llama, Qwen2/3, Mistral; Mixtral, Qwen2-MoE, Qwen3-MoE) as
megatron-core's GPTModel, from `policy.megatron_cfg`.

What maps where (the seeds' keys on the left):

    tensor/pipeline/context_parallel_size,      -> parallel_state.initialize_model_parallel; context
    expert_model/expert_tensor_parallel_size       parallelism (Transformer Engine's attention, CUDA
                                                    only) splits each sequence into 2 x cp chunks,
                                                    rank r keeping chunks r and 2cp-1-r
    virtual_pipeline_model_parallel_size         -> model chunks per pipeline stage (interleaved
                                                    1F1B schedule: each stage holds vpp chunks of
                                                    layers, stage-major, e.g. pp 2 x vpp 2 puts
                                                    layers 0 and 2 on stage 0, 1 and 3 on stage 1)
    num_layers_in_first/last_pipeline_stage,     -> TransformerConfig (uneven pipeline stages)
    pipeline_dtype                               -> must equal policy.precision (stages send activations
                                                    in the parameters' precision)
    sequence_parallel                            -> TransformerConfig; needs Transformer Engine's norms
    activation_checkpointing,                    -> recompute_granularity "full" (uniform, every layer)
    recompute_granularity                           or "selective" (attention core only)
    apply_rope_fusion, bias_activation_fusion    -> TransformerConfig (fused kernels)
    torch_compile (novarl's)                     -> each local-spec layer compiled (torch.compile)
    expert_model_parallel_size, moe_*,           -> Mixture-of-Experts models (Mixtral, Qwen2-MoE with
                                                    its gated shared expert, Qwen3-MoE): experts spread
    freeze_moe_router                               over expert-parallel ranks, whole (expert tensor
                                                    parallelism 1); the router frozen by default;
                                                    refused for dense models
    fp8_cfg                                      -> TransformerConfig fp8 / fp8_recipe / fp8_param
                                                    (Transformer Engine on Hopper or newer)
    converter_type                               -> checked against the checkpoint's architecture
    policy.precision                             -> bf16 / fp16 / fp32 (params_dtype)
    defer_fp32_logits                            -> nothing to change: logprobs are always taken
                                                    from the logits cast to fp32 after the head
    empty_unused_memory_level                    -> the CUDA cache is emptied after logprobs (1)
                                                    and after optimizer steps too (2)
    env_vars                                     -> set in each rank's environment first

The layers are Transformer Engine's where it is installed; without it, megatron-core's local
ones with novarl's core attention (attention.py: torch's SDPA and varlen kernels, packed rows
included) in place of megatron-core's unfused one. The optimizer, scheduler and DDP keys are
mapped in backends/training/megatron.py.
megatron-core is imported inside functions only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from novarl.backends.megatron.convert import LayerShape
from novarl.config.schema import PolicyConfig
from novarl.errors import ConfigError
from novarl.models.loading import DTYPES

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
                 "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


@dataclass(frozen=True)
class ParallelSizes:
    tensor: int
    pipeline: int
    context: int
    expert: int
    expert_tensor: int
    virtual: int = 1
    """Model chunks per pipeline stage (interleaved schedule)."""

    @classmethod
    def from_policy(cls, policy: PolicyConfig) -> "ParallelSizes":
        mc = policy.megatron_cfg
        return cls(mc.tensor_model_parallel_size, mc.pipeline_model_parallel_size, mc.context_parallel_size,
                   mc.expert_model_parallel_size, mc.expert_tensor_parallel_size, virtual_stages(policy))

    @property
    def model_parallel(self) -> int:
        """Ranks that hold one copy of the model: tp x pp x cp."""
        return self.tensor * self.pipeline * self.context


def check_model(hf_config, policy: PolicyConfig) -> LayerShape:
    """The model's shape, after checking that megatron_cfg can run it; every problem at once."""
    mc, problems = policy.megatron_cfg, []
    shape = LayerShape.from_hf_config(hf_config)
    expected = ARCHITECTURES[hf_config.model_type]
    if mc.converter_type not in (None, expected):
        problems.append(f"policy.megatron_cfg.converter_type={mc.converter_type!r} does not match the model, "
                        f"a {expected} ({hf_config.model_type}).")
    tp = mc.tensor_model_parallel_size
    if shape.num_heads % tp or shape.num_kv_heads % tp or shape.ffn_hidden_size % tp or shape.shared_expert_size % tp:
        problems.append(f"policy.megatron_cfg.tensor_model_parallel_size={tp} must divide the {shape.num_heads} "
                        f"attention heads, the {shape.num_kv_heads} key/value heads and the MLP size "
                        f"{shape.ffn_hidden_size}" + (f" and the shared expert's {shape.shared_expert_size}"
                                                      if shape.shared_expert_size else "") + ".")
    pp = mc.pipeline_model_parallel_size
    if pp > 1 and not (mc.num_layers_in_first_pipeline_stage or mc.num_layers_in_last_pipeline_stage) \
            and shape.num_layers % pp:
        problems.append(f"policy.megatron_cfg.pipeline_model_parallel_size={pp} does not divide the "
                        f"{shape.num_layers} layers; set num_layers_in_first/last_pipeline_stage.")
    problems += _virtual_pipeline_problems(policy, shape)
    ep = mc.expert_model_parallel_size
    if not shape.num_experts and (ep > 1 or mc.expert_tensor_parallel_size > 1):
        problems.append(f"expert parallelism (policy.megatron_cfg.expert_model_parallel_size={ep}, "
                        f"expert_tensor_parallel_size={mc.expert_tensor_parallel_size}) needs a Mixture-of-Experts "
                        f"model; {expected} is dense.")
    if shape.num_experts and shape.num_experts % ep:
        problems.append(f"policy.megatron_cfg.expert_model_parallel_size={ep} must divide the model's "
                        f"{shape.num_experts} experts.")
    if shape.num_experts and mc.tensor_model_parallel_size > 1 and not mc.sequence_parallel:
        problems.append(f"policy.megatron_cfg.tensor_model_parallel_size={mc.tensor_model_parallel_size} on a "
                        "Mixture-of-Experts model needs sequence_parallel=true (megatron-core's rule for MoE with "
                        "tensor parallelism; it needs Transformer Engine).")
    etp = mc.expert_tensor_parallel_size
    if shape.num_experts and shape.ffn_hidden_size % etp:
        problems.append(f"policy.megatron_cfg.expert_tensor_parallel_size={etp} must divide each expert's MLP "
                        f"size {shape.ffn_hidden_size}.")
    if shape.num_experts and etp > 1 and ep == 1 and etp != tp:
        # megatron-core marks experts as expert-parallel (reduced over expert-data-parallel ranks)
        # only when ep > 1; otherwise they are reduced and sharded as dense weights
        problems.append(f"policy.megatron_cfg.expert_tensor_parallel_size={etp} with expert_model_parallel_size=1 "
                        f"must equal tensor_model_parallel_size={tp}: megatron-core would then reduce each "
                        "expert's gradients over the data-parallel ranks, which hold other parts of it; set "
                        "expert_model_parallel_size > 1 too.")
    if mc.sequence_parallel and mc.tensor_model_parallel_size > 1 and _megatron_generation(policy):
        problems.append("policy.megatron_cfg.sequence_parallel with policy.generation.backend='megatron': decoding "
                        "feeds one token at a time, which sequence parallelism cannot split over "
                        f"{mc.tensor_model_parallel_size} ranks; turn one of them off.")
    precision = policy.precision
    if mc.pipeline_dtype is not None and precision is not None and mc.pipeline_dtype != precision:
        problems.append(f"policy.megatron_cfg.pipeline_dtype={mc.pipeline_dtype} differs from policy.precision="
                        f"{precision}: pipeline stages send activations in the parameters' precision.")
    if mc.distributed_data_parallel_config.use_custom_fsdp:
        problems.append("policy.megatron_cfg.distributed_data_parallel_config.use_custom_fsdp: Megatron's FSDP is "
                        "not available yet; use the distributed optimizer (ZeRO-1 style) or the DTensor backend.")
    if mc.context_parallel_size > 1 and _megatron_generation(policy):
        problems.append(f"policy.megatron_cfg.context_parallel_size={mc.context_parallel_size} with "
                        "policy.generation.backend='megatron': decoding feeds one token at a time, which context "
                        "parallelism cannot split; use vLLM or Hugging Face generation.")
    window = getattr(hf_config, "sliding_window", None) if getattr(hf_config, "use_sliding_window", True) else None
    if window and window < policy.max_seq_length:
        problems.append(f"the model attends within a sliding window of {window} tokens, which the Megatron backend "
                        f"does not map; policy.max_seq_length={policy.max_seq_length} must be at most {window}.")
    rope = _rope(hf_config)
    if rope.get("rope_type", "default") not in ("default", "llama3"):
        problems.append(f"the model's rope_type {rope.get('rope_type')!r} is not mapped to Megatron "
                        "(default and llama3 are).")
    if problems:
        raise ConfigError("The Megatron backend cannot run this model as configured:\n"
                          + "\n".join(f"  - {p}" for p in problems))
    return shape


def _megatron_generation(policy: PolicyConfig) -> bool:
    """The policy generates with its own Megatron model (a critic's section has no generation)."""
    return getattr(getattr(policy, "generation", None), "backend", None) == "megatron"


def _virtual_pipeline_problems(policy: PolicyConfig, shape: LayerShape) -> list[str]:
    """What keeps `virtual_pipeline_model_parallel_size` from running: megatron-core cuts each
    stage's layers into vpp equal chunks."""
    mc = policy.megatron_cfg
    vpp, pp = mc.virtual_pipeline_model_parallel_size or 1, mc.pipeline_model_parallel_size
    if vpp == 1:
        return []
    key = f"policy.megatron_cfg.virtual_pipeline_model_parallel_size={vpp}"
    if pp == 1:
        return [f"{key} interleaves pipeline stages; it needs pipeline_model_parallel_size > 1."]
    problems = []
    first, last = mc.num_layers_in_first_pipeline_stage, mc.num_layers_in_last_pipeline_stage
    middle_stages = pp - (first is not None) - (last is not None)
    middle_layers = shape.num_layers - (first or 0) - (last or 0)
    if any(n is not None and n % vpp for n in (first, last)) or middle_layers % (max(middle_stages, 1) * vpp):
        problems.append(f"{key}: each of the {pp} pipeline stages' layers must split into {vpp} equal chunks "
                        f"({shape.num_layers} layers"
                        + (f", {first} on the first stage" if first is not None else "")
                        + (f", {last} on the last" if last is not None else "") + ").")
    if _megatron_generation(policy):
        problems.append(f"{key} with policy.generation.backend='megatron': decoding runs one model chunk per "
                        "stage; use vLLM or Hugging Face generation, or leave it unset.")
    return problems


def transformer_engine_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


def transformer_config(hf_config, shape: LayerShape, policy: PolicyConfig, *, precision: str,
                       world_size: int) -> Any:
    """megatron-core's TransformerConfig for this model and megatron_cfg."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    mc = policy.megatron_cfg
    te = transformer_engine_available()
    if mc.sequence_parallel and not te and mc.tensor_model_parallel_size > 1:
        raise ConfigError("policy.megatron_cfg.sequence_parallel needs Transformer Engine's norms "
                          "(pip install --no-build-isolation 'novarl[te]' on the GPU hosts); set it false without it.")
    if mc.context_parallel_size > 1 and not (te and torch.cuda.is_available()):
        raise ConfigError(f"policy.megatron_cfg.context_parallel_size={mc.context_parallel_size}: megatron-core "
                          "splits sequences only in Transformer Engine's attention, on CUDA GPUs (pip install "
                          "transformer-engine on the GPU hosts); without it, use the DTensor backend's "
                          "policy.dtensor_cfg.context_parallel_size.")
    params_dtype = DTYPES[precision]
    kwargs: dict[str, Any] = dict(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size, num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads, kv_channels=shape.head_dim, ffn_hidden_size=shape.ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=hf_config.rms_norm_eps, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, add_qkv_bias=shape.qkv_bias, qk_layernorm=shape.qk_norm,
        hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=mc.tensor_model_parallel_size,
        pipeline_model_parallel_size=mc.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_stages(policy) if virtual_stages(policy) > 1 else None,
        context_parallel_size=mc.context_parallel_size,
        sequence_parallel=mc.sequence_parallel and mc.tensor_model_parallel_size > 1,
        num_layers_in_first_pipeline_stage=mc.num_layers_in_first_pipeline_stage,
        num_layers_in_last_pipeline_stage=mc.num_layers_in_last_pipeline_stage,
        pipeline_dtype=params_dtype,
        params_dtype=params_dtype, bf16=precision == "bfloat16", fp16=precision == "float16",
        apply_rope_fusion=mc.apply_rope_fusion, bias_activation_fusion=fuses_activation(mc),
        masked_softmax_fusion=False, bias_dropout_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        # each micro-batch's loss is already its share of the step's mean, summed over ranks
        calculate_per_token_loss=True,
        # initialised on the device, then overwritten by the checkpoint; megatron-core marks which
        # parameters are tensor-parallel only while initialising them (gradient norms need it)
        use_cpu_initialization=False, perform_initialization=True,
    )
    if shape.num_experts:
        kwargs.update(_moe(mc, shape))
    if virtual_stages(policy) > 1:
        # Interleaved stages send activations and gradients both ways at once; on 2 stages the peer
        # is the same rank both ways, where batched sends would pair them in the wrong order, so
        # they go one by one (megatron-core pairs them by parity), overlapped with compute on CUDA
        # (Megatron-LM's default with virtual stages); waited on at once on the CPU (gloo keeps no
        # reference to a buffer the schedule frees after sending)
        kwargs.update(batch_p2p_comm=False, overlap_p2p_comm=torch.cuda.is_available())
    granularity = mc.recompute_granularity or ("full" if mc.activation_checkpointing else None)
    if granularity == "full":
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif granularity == "selective":
        kwargs.update(recompute_granularity="selective")
    if mc.fp8_cfg is not None and mc.fp8_cfg.enabled:
        kwargs.update(_fp8(mc, te))
    if world_size % (mc.expert_model_parallel_size * mc.pipeline_model_parallel_size):
        raise ConfigError(f"policy.megatron_cfg.expert_model_parallel_size={mc.expert_model_parallel_size} x "
                          f"pipeline_model_parallel_size={mc.pipeline_model_parallel_size} must divide the "
                          f"{world_size} ranks.")
    if world_size % (mc.tensor_model_parallel_size * mc.pipeline_model_parallel_size * mc.context_parallel_size):
        raise ConfigError("the world size is not a multiple of tp x pp x cp")  # checked at validation too
    try:
        return TransformerConfig(**kwargs)
    except (ValueError, AssertionError) as err:  # e.g. a fusion whose kernel is not installed
        raise ConfigError(f"policy.megatron_cfg: megatron-core refused the model's configuration: {err}") from None


def _moe(mc, shape: LayerShape) -> dict[str, Any]:
    """The Mixture-of-Experts keys. Routing: Mixtral's (top-k of the logits, softmax over the
    chosen; Qwen's with norm_topk_prob is the same) is megatron-core's softmax without pre-softmax;
    Qwen's without norm_topk_prob (softmax over every expert, the top-k kept) is pre-softmax.
    Qwen2-MoE's shared expert: megatron-core's shared expert with its sigmoid gate."""
    moe: dict[str, Any] = dict(
        num_moe_experts=shape.num_experts, moe_router_topk=shape.experts_per_token,
        moe_ffn_hidden_size=shape.ffn_hidden_size, moe_router_pre_softmax=shape.router_pre_softmax,
        expert_model_parallel_size=mc.expert_model_parallel_size,
        expert_tensor_parallel_size=mc.expert_tensor_parallel_size,
        moe_router_load_balancing_type=mc.moe_router_load_balancing_type,
        moe_token_dispatcher_type=mc.moe_token_dispatcher_type,
        moe_grouped_gemm=False,  # SequentialMLP whatever megatron_cfg says (config/unused.py warns)
        moe_permute_fusion=mc.moe_permute_fusion, moe_router_bias_update_rate=mc.moe_router_bias_update_rate)
    if shape.shared_expert_size:
        moe.update(moe_shared_expert_intermediate_size=shape.shared_expert_size, moe_shared_expert_gate=True)
    if mc.moe_router_dtype:
        moe["moe_router_dtype"] = mc.moe_router_dtype
    if mc.moe_layer_recompute:
        moe.update(recompute_granularity="selective", recompute_modules=["moe"])
    return moe


def _fp8(mc, te: bool) -> dict[str, Any]:
    if not te:
        raise ConfigError("policy.megatron_cfg.fp8_cfg.enabled needs Transformer Engine (pip install "
                          "transformer-engine) on Hopper-or-newer GPUs.")
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        name = torch.cuda.get_device_name()
        raise ConfigError(f"policy.megatron_cfg.fp8_cfg.enabled needs an FP8 GPU (Hopper, Ada or newer); "
                          f"this one is a {name}.")
    fp8 = {"fp8": mc.fp8_cfg.fp8_format, "fp8_param": mc.fp8_cfg.fp8_param}
    if mc.fp8_cfg.fp8_recipe:
        fp8["fp8_recipe"] = mc.fp8_cfg.fp8_recipe
    return fp8


def _rope(hf_config) -> dict[str, Any]:
    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return {**rope, "rope_theta": theta}


def layer_spec(config):
    """Transformer Engine's layer spec where it is installed (fused norms and attention, FP8,
    sequence and context parallelism), else megatron-core's local one with novarl's SDPA core
    attention (backends/megatron/attention.py: torch's fused kernels, packed rows included) in
    place of its unfused one; with experts when the model has them. Either way packed rows are
    rotated without waiting for the GPU (attention.py packed_rotary)."""
    from megatron.core.models.gpt import gpt_layer_specs

    from novarl.backends.megatron.attention import SDPAttention, rotate_packed_rows_on_the_device

    rotate_packed_rows_on_the_device()
    experts = dict(num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm,
                   qk_layernorm=config.qk_layernorm)
    if transformer_engine_available():
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(**experts)
    _moe_router_without_transformer_engine()
    spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm", **experts)
    spec.submodules.self_attention.submodules.core_attention = SDPAttention  # (a spec built for this call)
    return spec


def _moe_router_without_transformer_engine() -> None:
    """megatron-core 0.16's router asks for `te_general_gemm` even when Transformer Engine is
    absent, where the name is never defined: define it as absent, so the router's plain
    matmul path runs."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def virtual_stages(policy: PolicyConfig) -> int:
    """Model chunks per pipeline stage (virtual_pipeline_model_parallel_size; unset is 1)."""
    return policy.megatron_cfg.virtual_pipeline_model_parallel_size or 1


@dataclass(frozen=True)
class Chunk:
    """One model chunk of this pipeline stage (the stage itself without interleaving)."""

    vp_stage: int | None
    """Its virtual stage (None without interleaving, as megatron-core wants it)."""
    layers: range
    """The global indexes of its decoder layers."""
    first: bool
    """It holds the embedding (the pipeline's first chunk)."""
    last: bool
    """It holds the final norm and the output layer (the pipeline's last chunk)."""


def stage_chunks(config) -> list[Chunk]:
    """This pipeline stage's model chunks, in virtual-stage order."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    vpp = config.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp) if vpp else [None]:
        first = get_transformer_layer_offset(config, vp_stage=vp_stage)
        layers = range(first, first + get_num_layers_to_build(config, vp_stage=vp_stage))
        chunks.append(Chunk(vp_stage, layers,
                            parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                            parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)))
    return chunks


def build_gpt_model(config, hf_config, shape: LayerShape, chunk: Chunk, *, max_sequence_length: int):
    """One model chunk's GPTModel (embedding on the pipeline's first chunk, head on its last)."""
    from megatron.core.models.gpt import GPTModel

    rope = _rope(hf_config)
    scaling = rope.get("rope_type") == "llama3"
    return norms_in_params_dtype(GPTModel(
        config=config, transformer_layer_spec=layer_spec(config),
        vocab_size=shape.padded_vocab_size(config.tensor_model_parallel_size),
        max_sequence_length=max(max_sequence_length, getattr(hf_config, "max_position_embeddings", 0)),
        pre_process=chunk.first, post_process=chunk.last, vp_stage=chunk.vp_stage,
        share_embeddings_and_output_weights=shape.tied, position_embedding_type="rope",
        rotary_base=int(rope["rope_theta"]), rope_scaling=scaling,
        rope_scaling_factor=float(rope.get("factor", 8.0)) if scaling else 8.0), config.params_dtype)


def fuses_activation(mc) -> bool:
    """megatron_cfg.bias_activation_fusion, None read as: on CUDA GPUs."""
    return torch.cuda.is_available() if mc.bias_activation_fusion is None else mc.bias_activation_fusion


def compiles_layers(mc) -> bool:
    """Whether the transformer layers are compiled (megatron_cfg.torch_compile; None: off, not yet
    measured on a GPU): megatron-core's local layers only, Transformer Engine's being fused already."""
    return bool(mc.torch_compile) and not transformer_engine_available()


def compile_layers(module: Any) -> None:
    """Compile each transformer layer of a model chunk in place (names unchanged): the same code for every
    layer (compiled once, reused), graph breaks allowed. module: a GPTModel chunk.

    A layer traces as one graph on one rank (tested): megatron-core's row-parallel linears ask for their group
    through a helper that warns when it gets None (as they pass it), and a warning is a graph break; inside
    megatron-core's activation-offloading context dynamo cannot resume after one, so the rest of the attention
    ran eager (issue 35). `_trace_group_lookup` has dynamo trace that helper without the warning. Under tensor
    parallelism a layer still compiles in pieces: the linears' backward all-reduces asynchronously (which dynamo
    does not trace) and megatron-core warns about CUDA_DEVICE_MAX_CONNECTIONS (results equal to eager's, checked
    on 2 CPU ranks; not measured for speed)."""
    from novarl.models.compile_limits import allow_recompiles

    allow_recompiles()
    _trace_group_lookup()
    for layer in module.decoder.layers:
        layer.compile(dynamic=None)


_group_lookup_traced = False


def _trace_group_lookup() -> None:
    """Once a process: megatron-core's get_tensor_model_parallel_group_if_none, as dynamo traces it, without its
    deprecation warning (Python's filters hide it by default) -- the same group, no graph break. Eager calls run
    megatron-core's own. A megatron-core without the helper needs nothing; one whose helper takes other arguments
    keeps the graph break (correct, slower)."""
    global _group_lookup_traced
    from megatron.core import parallel_state, utils

    original = getattr(utils, "get_tensor_model_parallel_group_if_none", None)
    if _group_lookup_traced or original is None:
        return
    _group_lookup_traced = True

    def group_if_none(tp_group, is_expert=False, check_initialized=True):
        if not torch.distributed.is_initialized():
            return None
        if tp_group is not None or not parallel_state.is_initialized():
            return tp_group
        if is_expert:
            return parallel_state.get_expert_tensor_parallel_group(check_initialized=check_initialized)
        return parallel_state.get_tensor_model_parallel_group(check_initialized=check_initialized)

    try:
        torch.compiler.substitute_in_graph(original)(group_if_none)
    except (TypeError, ValueError):  # another signature, or registered already: the layers compile in pieces
        pass


def norms_in_params_dtype(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """The module with its torch norms' weights in `dtype`. megatron-core's local spec (no Transformer
    Engine) builds its norms as torch.nn.RMSNorm / LayerNorm, which make fp32 weights whatever the config's
    params_dtype; in bf16 such a norm gets bf16 inputs and an fp32 weight, which torch cannot dispatch to
    its fused kernel (it warns, and runs several elementwise kernels a norm, forward and backward).
    Megatron-LM casts its whole model (Float16Module); here only the norms are off, and the optimizer
    keeps fp32 main copies of every 16-bit weight."""
    for norm in module.modules():
        if isinstance(norm, (torch.nn.RMSNorm, torch.nn.LayerNorm)):
            norm.to(dtype)
    return module


def largest_stage(config) -> int:
    """Decoder layers on the pipeline stage that holds the most."""
    return max(_layers_on_stage(config, stage) for stage in range(config.pipeline_model_parallel_size))


def _layers_on_stage(config, stage: int) -> int:
    pp = config.pipeline_model_parallel_size
    first, last = config.num_layers_in_first_pipeline_stage, config.num_layers_in_last_pipeline_stage
    if pp == 1:
        return config.num_layers
    if first is None and last is None:
        return config.num_layers // pp
    middle_layers = config.num_layers - (first or 0) - (last or 0)
    middle_stages = pp - (first is not None) - (last is not None)
    if stage == 0 and first is not None:
        return first
    if stage == pp - 1 and last is not None:
        return last
    return middle_layers // middle_stages


def to_stage(full_shard: dict[str, torch.Tensor], layers: range, *, first: bool, last: bool,
             tied: bool) -> dict[str, torch.Tensor]:
    """A tensor-parallel shard of the whole model (global layer numbers) cut to one pipeline
    stage's model chunk, its layers renumbered from 0 as the chunk's GPTModel names them."""
    out = {}
    for name, tensor in full_shard.items():
        if name.startswith("decoder.layers."):
            index, rest = name[len("decoder.layers."):].split(".", 1)
            if int(index) in layers:
                out[f"decoder.layers.{int(index) - layers.start}.{rest}"] = tensor
        elif name.startswith("embedding.") and (first or (last and tied)):
            # a tied last stage keeps its own copy of the embedding as the output layer
            out[name if first else "output_layer.weight"] = tensor
        elif name.startswith("output_layer.") and last:
            out[name] = tensor
        elif name.startswith("decoder.final_layernorm.") and last:
            out[name] = tensor
    return out


def from_stage(stage_state: dict[str, torch.Tensor], layers: range) -> dict[str, torch.Tensor]:
    """The inverse of to_stage for one stage: global layer numbers (a tied last stage's
    output_layer copy is kept; megatron_to_hf reads the embedding instead)."""
    out = {}
    for name, tensor in stage_state.items():
        if name.endswith("_extra_state"):
            continue
        if name.startswith("decoder.layers."):
            index, rest = name[len("decoder.layers."):].split(".", 1)
            out[f"decoder.layers.{int(index) + layers.start}.{rest}"] = tensor
        else:
            out[name] = tensor
    return out


def apply_env_vars(policy: PolicyConfig) -> None:
    """megatron_cfg.env_vars, set in the rank's environment before megatron-core starts."""
    for key, value in (policy.megatron_cfg.env_vars or {}).items():
        os.environ[key] = str(value)
