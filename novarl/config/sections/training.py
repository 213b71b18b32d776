"""The training backends' sections (policy.dtensor_cfg with LoRA, megatron_cfg, deepspeed_cfg) and
how micro-batches are laid out (sequence_packing, dynamic_batching). Re-exported by
novarl.config.schema."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from novarl.config.sections.base import Precision, Section


class LoraConfig(Section):
    """LoRA adapters (NeMo RL's policy.dtensor_cfg.lora_cfg): the base weights frozen, rank-`dim`
    adapters trained; generation and the export get the merged weights."""

    enabled: bool = False
    target_modules: list[str] = []
    """Module names to adapt (PEFT's matching: a name's suffix, or a regular expression)."""
    exclude_modules: list[str] = []
    match_all_linear: bool = True
    """Every linear layer but the output head (overrides target_modules)."""
    dim: int = Field(8, ge=1)
    """The rank r."""
    alpha: float = Field(32, gt=0)
    """Scaling: the adapter's output is multiplied by alpha / dim."""
    dropout: float = Field(0.0, ge=0, lt=1)
    dropout_position: Literal["pre", "post"] = "post"
    """Where dropout applies; PEFT's layers drop the input (pre): post with dropout > 0 is refused."""
    lora_A_init: Literal["xavier", "uniform"] = "xavier"
    use_triton: bool = True
    """NeMo RL's Triton kernels; novarl runs PEFT's layers (said in a warning when LoRA is on)."""

    @model_validator(mode="after")
    def _post_dropout(self) -> "LoraConfig":
        if self.enabled and self.dropout > 0 and self.dropout_position == "post":
            raise ValueError(f"policy.dtensor_cfg.lora_cfg.dropout={self.dropout} with dropout_position 'post': "
                             "novarl's LoRA layers (PEFT's) drop the adapter's input; set dropout_position: pre, "
                             "or dropout: 0")
        return self


class DTensorConfig(Section):
    v2: bool = Field(True, alias="_v2")
    """Accepted for NeMo RL compatibility; novarl has one DTensor worker."""
    enabled: bool = True
    cpu_offload: bool = False
    tensor_parallel_size: int = Field(1, ge=1)
    context_parallel_size: int = Field(1, ge=1)
    activation_checkpointing: bool = False
    sequence_parallel: bool = False
    custom_parallel_plan: str | None = None
    """Import path `module:object` of a parallel plan for tensor parallelism."""
    torch_compile: bool | None = None
    """novarl's: each decoder layer compiled with torch.compile (inductor) before it is sharded, fusing
    the norms, rotary and gated MLP's elementwise work; the first steps compile (~15-25 s). None: on
    where it was measured to win (benchmarks/results/train_gpu_*.md: +23-26 % tokens/s on an H100):
    CUDA, a Llama/Qwen/Mistral model, no tensor or context parallelism, LoRA or activation
    checkpointing; off elsewhere. True with tensor parallelism is refused (dtensor_spec.py
    config_problems: not built)."""
    lora_cfg: LoraConfig = Field(default_factory=LoraConfig)


class MegatronOptimizerConfig(Section):
    optimizer: Literal["adam", "sgd"] = "adam"
    lr: float = Field(5e-6, ge=0)
    min_lr: float = Field(0.0, ge=0)
    weight_decay: float = Field(0.01, ge=0)
    bf16: bool = True
    fp16: bool = False
    params_dtype: str = "float32"
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    use_distributed_optimizer: bool = True
    use_precision_aware_optimizer: bool = False
    clip_grad: float = Field(1.0, ge=0)


class MegatronSchedulerConfig(Section):
    start_weight_decay: float | None = None
    """None: megatron_cfg.optimizer.weight_decay (the schedule sets every group's decay)."""
    end_weight_decay: float | None = None
    """None: megatron_cfg.optimizer.weight_decay."""
    weight_decay_incr_style: str = "constant"
    lr_decay_style: str = "constant"
    lr_decay_iters: int | None = None
    lr_warmup_iters: int = 0
    lr_warmup_init: float = 0.0


class MegatronDDPConfig(Section):
    grad_reduce_in_fp32: bool = False
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = False
    """novarl gathers the distributed optimizer's parameters after its step (True is warned about)."""
    average_in_collective: bool = False
    """novarl sums gradients in the collective: each micro-batch's loss is its share of the step's
    mean already (True is warned about; the update is the same)."""
    use_custom_fsdp: bool = False
    data_parallel_sharding_strategy: str = "optim_grads_params"


class FP8Config(Section):
    enabled: bool = False
    fp8_format: Literal["hybrid", "e4m3"] = "hybrid"
    fp8_recipe: str | None = None
    fp8_param: bool = False


class MegatronConfig(Section):
    enabled: bool = False
    converter_type: str | None = None
    tensor_model_parallel_size: int = Field(1, ge=1)
    pipeline_model_parallel_size: int = Field(1, ge=1)
    virtual_pipeline_model_parallel_size: int | None = Field(None, ge=1)
    num_layers_in_first_pipeline_stage: int | None = None
    num_layers_in_last_pipeline_stage: int | None = None
    context_parallel_size: int = Field(1, ge=1)
    expert_tensor_parallel_size: int = Field(1, ge=1)
    expert_model_parallel_size: int = Field(1, ge=1)
    pipeline_dtype: Precision | None = None
    sequence_parallel: bool = False
    activation_checkpointing: bool = False
    recompute_granularity: Literal["full", "selective"] | None = None
    empty_unused_memory_level: int = Field(0, ge=0, le=2)
    freeze_moe_router: bool = True
    moe_router_dtype: str | None = None
    moe_router_load_balancing_type: str = "none"
    moe_router_bias_update_rate: float = 0.0
    moe_permute_fusion: bool = False
    moe_token_dispatcher_type: Literal["allgather", "alltoall"] = "allgather"
    moe_grouped_gemm: bool = False
    moe_layer_recompute: bool = False
    overlap_grad_reduce: bool = False
    use_distributed_optimizer: bool = True
    apply_rope_fusion: bool = False
    bias_activation_fusion: bool | None = None
    """SwiGLU through megatron-core's fused function (compiled by torch.compile: one kernel forward, one
    backward, only its input kept for the backward) instead of chunk, SiLU and product as eager kernels.
    None: on CUDA GPUs (NeMo RL's recipes set it true), off on the CPU, where it would only compile."""
    torch_compile: bool | None = None
    """novarl's: each transformer layer of megatron-core's local spec (no Transformer Engine) compiled
    with torch.compile (inductor), fusing its norms, rotary and SwiGLU's elementwise work as
    dtensor_cfg.torch_compile does; the first steps compile. None: off until measured to win on a GPU
    (benchmarks/bench_train_gpu.py `megatron-packed-compile`). Not applied over Transformer Engine's
    layers (fused already: said once)."""
    defer_fp32_logits: bool | None = None
    optimizer: MegatronOptimizerConfig = Field(default_factory=MegatronOptimizerConfig)
    scheduler: MegatronSchedulerConfig = Field(default_factory=MegatronSchedulerConfig)
    distributed_data_parallel_config: MegatronDDPConfig = Field(default_factory=MegatronDDPConfig)
    fp8_cfg: FP8Config | None = None
    env_vars: dict[str, str] | None = None


class DeepSpeedConfig(Section):
    enabled: bool = False
    zero_stage: Literal[0, 1, 2, 3] = 2
    offload_optimizer: bool = False
    offload_param: bool = False
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass (transformers' gradient
    checkpointing), as dtensor_cfg.activation_checkpointing does for DTensor."""
    torch_compile: bool | None = None
    """novarl's: each decoder layer compiled with torch.compile (inductor) before the engine wraps the
    model, as dtensor_cfg.torch_compile does (the same layers; the first steps compile). ZeRO 0-2 only:
    stage 3 fetches each submodule's parameters in a hook that DeepSpeed keeps out of compiled code, so
    its layers would compile in pieces (refused: deepspeed_spec.py config_problems). None: off until
    measured to win on a GPU (benchmarks/bench_train_gpu.py `zero2-compile`)."""
    config: dict[str, Any] | None = None
    """Raw DeepSpeed JSON config, merged over the preset."""

    @model_validator(mode="after")
    def _offload_param_needs_stage_3(self) -> "DeepSpeedConfig":
        # here rather than only where the ranks build DeepSpeed's config: validate says so, and
        # a run refuses before it starts them
        if self.enabled and self.offload_param and self.zero_stage != 3:
            raise ValueError(f"policy.deepspeed_cfg.offload_param needs zero_stage 3 (it is {self.zero_stage}): "
                             "only stage 3 partitions the parameters.")
        return self


class SequencePackingConfig(Section):
    """Sequences end to end in one row per micro-batch, each attending only to itself
    (backends/training/batching.py). Excludes dynamic_batching."""

    enabled: bool = False
    train_mb_tokens: int | None = Field(None, ge=1)
    """Tokens per training micro-batch (a packed row); None: max_seq_length x train_micro_batch_size."""
    logprob_mb_tokens: int | None = Field(None, ge=1)
    """Tokens per logprob micro-batch; None: max_seq_length x logprob_batch_size."""
    algorithm: Literal["modified_first_fit_decreasing", "first_fit_decreasing", "first_fit_shuffle",
                       "concatenative"] = "modified_first_fit_decreasing"
    """How sequences are put into micro-batches (bins of train_mb_tokens)."""
    sequence_length_round: int = Field(64, ge=1)
    """A packed row's length is rounded up to a multiple of it."""
    share_prompts: bool = True
    """novarl's own key: a GRPO group's prompt is laid out once in a packed row and each of its
    samples attends to it, so the prompt's tokens are computed once per group rather than once
    per sample (DTensor and DeepSpeed with novarl's varlen attention: Llama, Qwen2/3, Mistral;
    elsewhere each sample carries its prompt)."""


class DynamicBatchingConfig(Section):
    """Micro-batches of sequences of similar length, sized by tokens rather than rows (padded to
    the micro-batch's longest). Excludes sequence_packing."""

    enabled: bool = False
    train_mb_tokens: int | None = Field(None, ge=1)
    """Rows x padded length of a training micro-batch, at most; None: max_seq_length x
    train_micro_batch_size."""
    logprob_mb_tokens: int | None = Field(None, ge=1)
    """The same for logprob micro-batches; None: max_seq_length x logprob_batch_size."""
    sequence_length_round: int = Field(64, ge=1)
    """Each micro-batch's padded length is rounded up to a multiple of it."""
