"""Typed, frozen configuration models.

Key names follow the seed documents (NeMo RL, ROLL, NovaRL) so their YAML
files load as they are. Where two seeds name one thing differently, the loader
(`novarl.config.loading`) rewrites the alias to the canonical name before these
models see it: `dtensor_config` -> `dtensor_cfg`, `max_total_sequence_length`
-> `max_seq_length`, `algorithm` -> `grpo`.

Every section forbids unknown keys and is immutable once validated. Fields whose
backend is not built yet are still typed here; `novarl.plan.resolve` reports
them as "not available yet" only when a run would need them.

Rules every section applies: floats are finite (no field takes inf or nan; a
float | None field takes None for "no limit"), integers fit in 64 bits, and
file and folder names (`PathText`) are names a file system can hold.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Discriminator, Field, PrivateAttr, Tag, field_validator,
                      model_validator)

Precision = Literal["float32", "bfloat16", "float16"]
BUNDLED_TASKS = ("arithmetic", "repeat", "word_problems")
"""Tasks shipped with novarl (novarl.data.datasets.BUNDLED_DATASETS implements them)."""

NAME_MAX_BYTES = 255
"""Longest file or folder name (one path component) Linux and macOS file systems hold."""
PATH_MAX_BYTES = 4095
"""Longest whole path Linux takes (PATH_MAX, less the terminating NUL)."""


def _path_text(path: str) -> str:
    """A path (or hub id) a file system can take: no NUL byte, no name longer than 255 bytes."""
    if "\0" in path:
        raise ValueError("a path cannot contain a NUL character")
    if len(path.encode()) > PATH_MAX_BYTES:
        raise ValueError(f"a path is at most {PATH_MAX_BYTES} bytes long; this one is {len(path.encode()):,}")
    longest = max(path.replace("\\", "/").split("/"), key=lambda part: len(part.encode()))
    if len(longest.encode()) > NAME_MAX_BYTES:
        raise ValueError(f"the name '{longest[:40]}...' in it is {len(longest.encode()):,} bytes long; file "
                         f"systems hold at most {NAME_MAX_BYTES} bytes per file or folder name")
    return path


PathText = Annotated[str, AfterValidator(_path_text)]
"""A file or folder path (or a name that may be one, such as a hub id)."""


def _finite_numbers(value: Any, where: str = "") -> Any:
    """`value` (a dict or list of keyword arguments) when every float in it is finite."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where or 'the value'} is {value}; it must be a finite number")
    if isinstance(value, dict):
        for key, item in value.items():
            _finite_numbers(item, f"{where}.{key}" if where else str(key))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _finite_numbers(item, f"{where}[{i}]")
    return value


class Section(BaseModel):
    # allow_inf_nan=False: no setting takes inf or nan (a temperature or learning rate of
    # inf validates as a float and ends in NaN weights); "no limit" is None where allowed.
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, allow_inf_nan=False)

    @field_validator("*")
    @classmethod
    def _int64(cls, value: Any) -> Any:
        """Integers fit in 64 bits: torch and vLLM take nothing larger (a seed of 10**30 fails there)."""
        items = value if isinstance(value, list) else (value,)
        if any(isinstance(v, int) and not isinstance(v, bool) and not -2**63 <= v < 2**63 for v in items):
            raise ValueError("out of the 64-bit integer range")
        return value


# --------------------------------------------------------------------- cluster
class ClusterConfig(Section):
    gpus_per_node: int = Field(1, ge=0)
    """GPUs per node given to the run; 0 means CPU ranks."""
    num_nodes: int = Field(1, ge=1)
    """Nodes in the run."""


class ResourcesConfig(Section):
    gpus_per_node: int | None = Field(None, ge=1)
    """GPUs per node dedicated to generation (dedicated mode only)."""
    num_nodes: int | None = Field(None, ge=1)
    """Nodes dedicated to generation (dedicated mode only)."""


# ------------------------------------------------------------------ generation
class ColocatedConfig(Section):
    enabled: bool = True
    """True: generation shares the training devices. False: dedicated ones."""
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)


class VllmConfig(Section):
    async_engine: bool = False
    precision: Precision | None = None
    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    expert_parallel_size: int = Field(1, ge=1)
    gpu_memory_utilization: float = Field(0.6, gt=0, le=1)
    max_model_len: int | None = Field(None, ge=1)
    enforce_eager: bool = False
    use_deep_gemm: bool = False
    num_last_layers_in_bf16: int = Field(0, ge=0)
    num_first_layers_in_bf16: int = Field(0, ge=0)


class McoreGenerationConfig(Section):
    buffer_size_gb: float = Field(20, gt=0)
    num_cuda_graphs: int = Field(16, ge=0)
    block_size_tokens: int = Field(256, ge=1)
    enable_chunked_prefill: bool = True


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM's max_lora_rank accepts (policy.generation.lora_sync: adapter)."""


class GenerationConfig(Section):
    backend: Literal["vllm", "hf", "megatron"] | None = None
    """None: the one measured faster for the model and host (plan/resolve.py: default_generation_backend)."""
    max_new_tokens: int = Field(512, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int | None = Field(None, ge=1)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    """Token ids that end a completion; each below the tokenizer's vocabulary size (checked by preflight)."""
    stop_strings: list[str] | None = None
    generation_batch_size: int | None = Field(None, ge=1)
    """Sequences per Hugging Face generate call; None: all at once."""
    vllm_cfg: VllmConfig = Field(default_factory=VllmConfig)
    vllm_kwargs: dict[str, Any] = {}
    mcore_generation_config: McoreGenerationConfig = Field(default_factory=McoreGenerationConfig)
    colocated: ColocatedConfig = Field(default_factory=ColocatedConfig)
    weight_sync_bucket_mb: float = Field(512, gt=0)
    """The weight sync's bound on one bucket (MB): the extra memory a rank holds beyond its own
    shards while the engines take new weights."""
    lora_sync: Literal["merged", "adapter"] = "merged"
    """With LoRA (policy.dtensor_cfg.lora_cfg), what the engines get at each weight sync. merged:
    every adapted layer's merged weight (W + alpha/r B A) and the other tensors, the whole model,
    for any engine; adapter: the adapters alone (two rank-r matrices a layer), which vLLM applies
    with its LoRA kernels over the base weights it loaded at start (backend vllm): a sync moves
    megabytes instead of the model, generation pays for the LoRA kernels."""


# -------------------------------------------------------------------- training
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
    bias_activation_fusion: bool = False
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
    config: dict[str, Any] | None = None
    """Raw DeepSpeed JSON config, merged over the preset."""


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


TORCH_OPTIMIZERS = frozenset({"ASGD", "Adadelta", "Adafactor", "Adagrad", "Adam", "AdamW", "Adamax", "LBFGS", "NAdam",
                              "RAdam", "RMSprop", "Rprop", "SGD", "SparseAdam"})
"""torch.optim's optimizer classes, known without importing torch (validation stays light: `novarl
validate` on a config without a local model imports no torch). Any other name is looked up in torch."""

TORCH_SCHEDULERS = frozenset({"ChainedScheduler", "ConstantLR", "CosineAnnealingLR", "CosineAnnealingWarmRestarts",
                              "CyclicLR", "ExponentialLR", "LambdaLR", "LinearLR", "MultiStepLR",
                              "MultiplicativeLR", "OneCycleLR", "PolynomialLR", "ReduceLROnPlateau",
                              "SequentialLR", "StepLR"})
"""torch.optim.lr_scheduler's classes, known without importing torch."""


def _torch_has(module: str, name: str) -> bool:
    """Whether `module` (imported only for a name the lists above do not hold) has the class `name`."""
    import importlib

    return isinstance(getattr(importlib.import_module(module), name, None), type)


class OptimizerConfig(Section):
    name: str = "torch.optim.AdamW"
    """A class in torch.optim, by its import path."""
    kwargs: Annotated[dict[str, Any], AfterValidator(_finite_numbers)] = {
        "lr": 5e-6, "weight_decay": 0.01, "betas": [0.9, 0.999], "eps": 1e-8}

    @field_validator("name")
    @classmethod
    def _torch_optimizer(cls, name: str) -> str:
        short = name.removeprefix("torch.optim.")
        if "." in short or short not in TORCH_OPTIMIZERS and not _torch_has("torch.optim", short):
            raise ValueError(f"'{name}' is not an optimizer class in torch.optim (e.g. torch.optim.AdamW)")
        return name


class SchedulerStep(Section):
    name: str
    """A class in torch.optim.lr_scheduler, by its import path."""
    kwargs: Annotated[dict[str, Any], AfterValidator(_finite_numbers)] = {}

    @field_validator("name")
    @classmethod
    def _torch_scheduler(cls, name: str) -> str:
        short = name.removeprefix("torch.optim.lr_scheduler.")
        if "." in short or short not in TORCH_SCHEDULERS and not _torch_has("torch.optim.lr_scheduler", short):
            raise ValueError(f"'{name}' is not a scheduler class in torch.optim.lr_scheduler")
        return name


class SchedulerMilestones(Section):
    milestones: list[int]
    """Steps at which the next scheduler in the list takes over."""


def _scheduler_kind(item: Any) -> str:
    """SchedulerMilestones for {milestones: [...]} (or one already built), else SchedulerStep,
    whose validation then says what is wrong with an item that is not a mapping."""
    if isinstance(item, SchedulerMilestones) or isinstance(item, dict) and "milestones" in item:
        return "SchedulerMilestones"
    return "SchedulerStep"


SchedulerItem = Annotated[
    Annotated[SchedulerStep, Tag("SchedulerStep")] | Annotated[SchedulerMilestones, Tag("SchedulerMilestones")],
    Discriminator(_scheduler_kind),
]


def _default_scheduler() -> list[SchedulerItem]:
    return [
        SchedulerStep(name="torch.optim.lr_scheduler.LinearLR",
                      kwargs={"start_factor": 0.1, "end_factor": 1.0, "total_iters": 10}),
        SchedulerStep(name="torch.optim.lr_scheduler.ConstantLR",
                      kwargs={"factor": 1.0, "total_iters": 10_000_000_000}),
        SchedulerMilestones(milestones=[10]),
    ]


class TokenizerConfig(Section):
    name: PathText | None = None
    """Tokenizer folder or hub id; None: the model's own."""
    chat_template: str | None = "default"
    """NeMo RL's meanings: 'default' the tokenizer's own template (prompts as plain text when it
    has none); null the pass-through template (the messages' contents, no role markers); a
    Jinja string, or the path of a .jinja / .j2 / .txt file holding one."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Passed to the template (e.g. {enable_thinking: false} for Qwen3)."""


class PolicyConfig(Section):
    model_name: PathText = "tiny-arith"
    """Hugging Face hub id, local folder, or a bundled model name (tiny-arith)."""
    backend: Literal["auto"] | None = None
    """novarl's own key. 'auto': the planner picks the training backend, parallel sizes,
    generation backend and placement (see `novarl plan`), overriding the *_cfg flags; None:
    the flags decide (megatron > deepspeed > dtensor)."""
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    trust_remote_code: bool = False
    train_global_batch_size: int | None = Field(None, ge=1)
    """Samples per optimizer step; None: all samples of a GRPO step."""
    train_micro_batch_size: int = Field(4, ge=1)
    """Samples per forward/backward on one data-parallel rank."""
    generation_batch_size: int | None = Field(None, ge=1)
    logprob_batch_size: int | None = Field(None, ge=1)
    """Samples per logprob forward; None: train_micro_batch_size."""
    max_seq_length: int = Field(512, ge=2)
    """Prompt + completion tokens, at most (alias max_total_sequence_length)."""
    precision: Precision | None = None
    """None: bfloat16 on GPU, float32 on CPU."""
    logprob_chunk_size: int | None = Field(None, ge=1)
    dtensor_cfg: DTensorConfig = Field(default_factory=DTensorConfig)
    megatron_cfg: MegatronConfig = Field(default_factory=MegatronConfig)
    deepspeed_cfg: DeepSpeedConfig = Field(default_factory=DeepSpeedConfig)
    dynamic_batching: DynamicBatchingConfig = Field(default_factory=DynamicBatchingConfig)
    sequence_packing: SequencePackingConfig = Field(default_factory=SequencePackingConfig)
    make_sequence_length_divisible_by: int = Field(1, ge=1)
    max_grad_norm: float | None = Field(1.0, ge=0)
    optimizer: OptimizerConfig | None = Field(default_factory=OptimizerConfig)
    """None (NeMo RL's way to say it): the Megatron backend's own optimizer (megatron_cfg.optimizer)."""
    scheduler: list[SchedulerItem] | None = Field(default_factory=_default_scheduler)
    """None: a constant learning rate (Megatron: megatron_cfg.scheduler)."""
    generation: GenerationConfig = Field(default_factory=GenerationConfig)

    @model_validator(mode="after")
    def _optimizer_given(self) -> "PolicyConfig":
        if self.optimizer is None and not self.megatron_cfg.enabled:
            raise ValueError("policy.optimizer is null, which only the Megatron backend allows (it reads "
                             "policy.megatron_cfg.optimizer): give policy.optimizer {name, kwargs}, or set "
                             "policy.megatron_cfg.enabled=true")
        return self

    @field_validator("scheduler")
    @classmethod
    def _one_milestone_list(cls, steps: list | None) -> list | None:
        if steps is None:
            return None
        schedulers = [s for s in steps if isinstance(s, SchedulerStep)]
        milestones = [s for s in steps if isinstance(s, SchedulerMilestones)]
        if len(milestones) > 1:
            raise ValueError("give at most one {milestones: [...]} entry")
        if milestones and len(milestones[0].milestones) != len(schedulers) - 1:
            raise ValueError(
                f"{len(schedulers)} schedulers need {len(schedulers) - 1} milestones, "
                f"got {len(milestones[0].milestones)}")
        if len(schedulers) > 1 and not milestones:
            raise ValueError(f"{len(schedulers)} schedulers need a {{milestones: [...]}} entry")
        return steps


# ------------------------------------------------------------------ algorithm
class AsyncGRPOConfig(Section):
    enabled: bool = False
    max_trajectory_age_steps: int = Field(1, ge=1)


class AdvEstimatorConfig(Section):
    """NeMo RL's grpo.adv_estimator (its normalize_rewards and use_leave_one_out_baseline are
    grpo.normalize_rewards and grpo.use_leave_one_out_baseline here, which NeMo RL's files
    interpolate into it)."""

    name: Literal["grpo", "reinforce_plus_plus", "rloo"] = "grpo"
    """The estimator (novarl.algorithms.advantages): grpo (group baseline, optionally leave-one-out,
    normalised by the group's std with grpo.normalize_rewards), reinforce_plus_plus (REINFORCE++:
    normalised over the whole step), rloo (leave-one-out baseline, not normalised)."""
    minus_baseline: bool = True
    """reinforce_plus_plus: subtract each group's mean reward before normalising over the step."""


class RewardScalingConfig(Section):
    """NeMo RL's grpo.reward_scaling: rewards clamped to [source_min, source_max], then mapped
    linearly onto [target_min, target_max], before shaping and advantages."""

    enabled: bool = False
    source_min: float = 0.0
    source_max: float = 1.0
    target_min: float = 0.0
    target_max: float = 1.0

    @model_validator(mode="after")
    def _a_range(self) -> "RewardScalingConfig":
        if self.enabled and not self.source_max > self.source_min:
            raise ValueError(f"grpo.reward_scaling: source_max ({self.source_max}) must be above source_min "
                             f"({self.source_min})")
        return self


class RewardShapingConfig(Section):
    """NeMo RL's grpo.reward_shaping (DAPO's overlong reward shaping): a completion longer than
    max_response_length - overlong_buffer_length tokens loses overlong_buffer_penalty x (its
    excess / overlong_buffer_length); or, with stop_properly_penalty_coef set, a completion cut
    by the length limit has its reward multiplied by that coefficient (and the overlong keys
    are not used)."""

    enabled: bool = False
    overlong_buffer_length: int | None = Field(None, ge=1)
    overlong_buffer_penalty: float | None = Field(None, ge=0)
    max_response_length: int | None = Field(None, ge=1)
    """None: policy.generation.max_new_tokens."""
    stop_properly_penalty_coef: float | None = Field(None, ge=0, le=1)

    @model_validator(mode="after")
    def _dapo_keys(self) -> "RewardShapingConfig":
        if self.enabled and self.stop_properly_penalty_coef is None:
            missing = [k for k in ("overlong_buffer_length", "overlong_buffer_penalty")
                       if getattr(self, k) is None]
            if missing:
                raise ValueError(f"grpo.reward_shaping is enabled without {' and '.join(missing)} (DAPO's "
                                 "overlong penalty needs them), and stop_properly_penalty_coef is not set")
        return self


class GRPOConfig(Section):
    num_prompts_per_step: int = Field(32, ge=1)
    """Prompts drawn per step (alias: algorithm.batch_size)."""
    num_generations_per_prompt: int = Field(16, ge=1)
    """Completions sampled per prompt: the group advantages are normalised in."""
    max_rollout_turns: int = Field(1, ge=1)
    max_num_epochs: int | None = Field(None, ge=1)
    """Passes over the training prompts, at most: the run ends at max_num_steps or here,
    whichever comes first (NeMo RL's rule; its configs set 1). None: max_num_steps decides."""
    max_num_steps: int = Field(1000, ge=1)
    max_train_seconds: float | None = Field(None, gt=0)
    """Stop after this much wall time in the loop (evaluation excluded); None: no limit."""
    gradient_accumulation_steps: int | None = Field(None, ge=1)
    """Micro-batches per optimizer step; None: derived from the batch sizes."""
    normalize_rewards: bool = True
    """Divide group-centred rewards by the group's standard deviation."""
    use_leave_one_out_baseline: bool = False
    advantage_clip_low: float | None = None
    """Advantages below it are raised to it (NeMo RL's key); None: no lower bound."""
    advantage_clip_high: float | None = None
    """Advantages above it are lowered to it; None: no upper bound."""
    reward_clip: float | None = Field(None, gt=0)
    """Rewards are clipped to [-reward_clip, reward_clip] before the advantages (ROLL's key; the
    logged rewards are the unclipped ones); None: not clipped."""
    adv_estimator: AdvEstimatorConfig = Field(default_factory=AdvEstimatorConfig)
    reward_scaling: RewardScalingConfig = Field(default_factory=RewardScalingConfig)
    reward_shaping: RewardShapingConfig = Field(default_factory=RewardShapingConfig)
    use_dynamic_sampling: bool = False
    """DAPO's dynamic sampling: groups whose rewards are all equal are dropped and more prompts
    are generated until num_prompts_per_step groups with signal are gathered."""
    batch_multiplier: float = Field(1, ge=1)
    """With dynamic sampling: prompts generated per round = num_prompts_per_step x this."""
    dynamic_sampling_max_gen_batches: int = Field(10, ge=1)
    """With dynamic sampling: generation rounds allowed per step before the run stops with an error."""
    val_period: int = Field(0, ge=0)
    """Evaluate every N steps; 0: only at start (if val_at_start) and end."""
    val_at_start: bool = True
    val_at_end: bool = True
    overlong_filtering: bool = False
    max_val_samples: int | None = Field(256, ge=1)
    """At most this many evaluation prompts; None: all of the held-out split (NeMo RL's null)."""
    val_batch_size: int = Field(256, ge=1)
    seed: int = 42
    async_grpo: AsyncGRPOConfig = Field(default_factory=AsyncGRPOConfig)


class LossConfig(Section):
    loss: str = "clipped_pg"
    """Policy loss in the registry (novarl.algorithms.losses)."""
    reference_policy_kl_penalty: float = Field(0.0, ge=0)
    """KL coefficient to the frozen reference; 0 loads no reference."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Alias: NeMo RL's reference_policy_kl_type."""
    kl_input_clamp_value: float | None = Field(None, gt=0)
    """The log-ratio log q - log p is clamped to [-v, v] before the KL estimator; None: not clamped."""
    kl_output_clamp_value: float | None = Field(None, gt=0)
    """The per-token KL estimate is clamped to [-v, v]; None: not clamped."""
    ratio_clip_min: float = Field(0.2, ge=0)
    ratio_clip_max: float = Field(0.2, ge=0)
    ratio_clip_c: float | None = Field(None, gt=1)
    """Dual-clip constant (> 1) for negative advantages; None: off."""
    use_on_policy_kl_approximation: bool = False
    disable_ppo_ratio: bool = False
    """REINFORCE's surrogate, -A log p per token: no ratio, no clipping (NeMo RL's key)."""
    use_kl_in_reward: bool = False
    """REINFORCE++ (grpo.adv_estimator.name: reinforce_plus_plus): reference_policy_kl_penalty x each
    token's KL (the policy before the update against the reference) is subtracted from its
    advantage before the step's normalisation, instead of being a term of the loss."""
    use_importance_sampling_correction: bool = False
    sequence_level_importance_ratios: bool = False
    token_level_loss: bool = True
    """True: average over all tokens of the step; False: per sequence, then over sequences."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                           "seq-mean-token-sum-norm"] | None = None
    """How token losses become the step's loss (verl's and ROLL's key): token-mean (all tokens of
    the step), seq-mean-token-mean (each sequence's mean, then over sequences), seq-mean-token-sum
    (each sequence's sum, then over sequences), seq-mean-token-sum-norm (Dr. GRPO: each sequence's
    sum divided by policy.generation.max_new_tokens, then over sequences: no length bias). None:
    token_level_loss decides (token-mean or seq-mean-token-mean)."""


# ------------------------------------------------------------------ data, reward
class DatasetBlock(Section):
    """One of several datasets (NeMo RL's list form of data.train / data.validation). A key left
    unset takes data's own (data.input_key, ...), as NeMo RL's data.default does."""

    dataset_name: str | None = None
    """A named dataset, or 'ResponseDataset' / None for data_path."""
    data_path: PathText | None = None
    input_key: str | None = None
    output_key: str | None = None
    subset: str | None = None
    split: str | None = None
    split_validation_size: float | None = Field(None, ge=0, lt=1)
    """Training blocks: this fraction is held out for evaluation (drawn with grpo.seed); None:
    data.split_validation_size."""
    repeat: int = Field(1, ge=1)
    """Validation blocks: each example this many times (NeMo RL: AIME x16, averaged over samples)."""

    @model_validator(mode="after")
    def _one_source(self) -> "DatasetBlock":
        named = self.dataset_name not in (None, "ResponseDataset")
        if named == bool(self.data_path):
            raise ValueError("a dataset block names its data with dataset_name (a named dataset) or data_path, "
                             f"one of them (got dataset_name={self.dataset_name!r}, data_path={self.data_path!r})")
        return self


class DataConfig(Section):
    dataset_name: str | None = None
    """'arithmetic', 'repeat' or 'word_problems' (bundled); 'ResponseDataset' (data.train_data_path: a file, a
    `datasets` folder or a hub dataset id); a NeMo RL named dataset ('OpenMathInstruct-2',
    'DAPOMath17K', 'DeepScaler', 'AIME2024', ...: novarl/data/named.py); None: from the paths."""
    train_data_path: PathText | None = None
    """A data file (.jsonl, .json, .parquet, .arrow, .csv), a folder `datasets` saved or laid out as
    a hub dataset repository, or a hub dataset id 'org/name' (read from the local caches;
    `novarl train` downloads the split when no cache holds it)."""
    val_data_path: PathText | None = None
    """As train_data_path, for evaluation; None: the training source's validation or test split
    when it has one (else the training split, and the log says so)."""
    val_dataset_name: str | None = None
    """A named dataset to evaluate on (NeMo RL's data.validation.dataset_name: 'AIME2024', ...)."""
    input_key: str = "prompt"
    output_key: str = "answer"
    subset: str | None = None
    """The subset (configuration) of a hub dataset or folder with several (NeMo RL's `subset`)."""
    train_split: str | None = None
    """The split to train on; None: 'train' (a named dataset's own split)."""
    val_split: str | None = None
    """The split to evaluate on; None: 'validation', else 'test', else the training split."""
    prompt_file: PathText | None = None
    """A text file with one '{}' where the prompt goes (other braces doubled: '{{', '}}')."""
    system_prompt_file: PathText | None = None
    shuffle: bool = True
    max_input_seq_length: int | None = Field(None, ge=1)
    split_validation_size: float = Field(0.0, ge=0, lt=1)
    """With no held-out split given: this fraction of the training examples (drawn with grpo.seed)
    is held out for evaluation and not trained on (NeMo RL's data.train.split_validation_size)."""
    train: list[DatasetBlock] | None = None
    """Several training datasets (NeMo RL's list form), read one after the other into one shuffled
    pool; instead of dataset_name / train_data_path."""
    validation: list[DatasetBlock] | None = None
    """Several evaluation datasets, instead of val_dataset_name / val_data_path."""

    @model_validator(mode="after")
    def _one_source(self) -> "DataConfig":
        for blocks, flat in (("train", ("dataset_name", "train_data_path", "train_split")),
                             ("validation", ("val_dataset_name", "val_data_path", "val_split"))):
            given = [k for k in flat if getattr(self, k) not in (None, "ResponseDataset")]
            if getattr(self, blocks) is not None and given:
                raise ValueError(f"data.{blocks} lists the datasets, and data.{given[0]} names one too: give one form")
            if getattr(self, blocks) == []:
                raise ValueError(f"data.{blocks} is an empty list: name at least one dataset")
        given = [k for k in ("train_data_path", "val_data_path") if getattr(self, k)]
        if self.dataset_name in BUNDLED_TASKS and given:
            raise ValueError(f"data.dataset_name='{self.dataset_name}' is a bundled task, but data.{given[0]} "
                             "is also set: drop dataset_name (or set it to 'ResponseDataset') to train on the file")
        if self.dataset_name not in (None, "ResponseDataset", *BUNDLED_TASKS) and self.train_data_path:
            raise ValueError(f"data.dataset_name='{self.dataset_name}' names a dataset, but data.train_data_path is "
                             "also set: drop dataset_name (or set it to 'ResponseDataset') to train on the path")
        if self.val_dataset_name is not None and self.val_data_path:
            raise ValueError("data.val_dataset_name and data.val_data_path both name the evaluation data: set one")
        return self


class RewardConfig(Section):
    function: PathText | list[PathText] = "exact_match"
    """A registered name (exact_match, math_verify, boxed_match, last_number, boxed_format), an import
    path 'module:function' (also a module in the working directory), or a file
    'path/to/rewards.py:function' (relative to the working directory); or a list of them, whose
    rewards are added with `weights`. How each is called: novarl/rewards/scorer.py."""
    weights: list[float] | None = None
    """One weight per function when `function` is a list (TRL's reward_weights); None: 1.0 each."""

    @model_validator(mode="after")
    def _weights(self) -> "RewardConfig":
        count = len(self.function) if isinstance(self.function, list) else 1
        if not count:
            raise ValueError("reward.function is an empty list: give at least one reward function")
        if self.weights is not None and len(self.weights) != count:
            raise ValueError(f"reward.weights has {len(self.weights)} weight(s) for {count} reward function(s): "
                             "give one weight per function")
        if self.weights is not None and not all(math.isfinite(w) for w in self.weights):
            raise ValueError(f"reward.weights={self.weights}: weights are finite numbers")
        return self
    timeout_s: float | None = Field(300.0, gt=0)
    """Seconds one call of the function (one completion) may take; past it the run stops with an
    error naming the function and the completion. None: no limit, and the function is called
    as it is (see novarl.rewards.registry for how the limit is enforced)."""


class MathEnvConfig(Section):
    num_workers: int = Field(8, ge=1)
    math_verify_impl: str = "hf_math_verify"


# ------------------------------------------------------------------ outputs
class CheckpointingConfig(Section):
    enabled: bool = True
    checkpoint_dir: PathText = "results/grpo"
    metric_name: str | None = "val_reward"
    """The summary value keep_top_k ranks by (NeMo RL's "val:accuracy" is val_accuracy); None: the newest."""
    higher_is_better: bool = True
    keep_top_k: int | None = Field(3, ge=1)
    save_period: int = Field(10, ge=1)
    checkpoint_must_save_by: str | None = None
    model_save_format: Literal["safetensors", "torch_save"] | None = "safetensors"
    """The Hugging Face folders' file format (the run's policy/ and `novarl convert`): safetensors,
    or torch_save (pytorch_model.bin); None: safetensors."""
    save_consolidated: bool = False


class WandbConfig(Section):
    project: str = "novarl"
    name: str | None = None
    entity: str | None = None


class MlflowConfig(Section):
    experiment_name: str = "novarl"
    run_name: str | None = None
    """None: the run folder's name (exp_001, ...)."""
    tracking_uri: str | None = None
    """None: $MLFLOW_TRACKING_URI, else MLflow's default."""
    artifact_location: str | None = None


class GpuMonitoringConfig(Section):
    collection_interval: float = Field(10, gt=0)
    flush_interval: float = Field(10, gt=0)


class LoggerConfig(Section):
    log_dir: PathText = "logs"
    """Each run writes to a new numbered folder under it (exp_001, ...)."""
    num_val_samples_to_print: int = Field(0, ge=0)
    progress_bar: bool = True
    print_every_n_steps: int = Field(10, ge=1)
    wandb_enabled: bool = False
    tensorboard_enabled: bool = False
    mlflow_enabled: bool = False
    swanlab_enabled: bool = False
    monitor_gpus: bool = False
    """Each step's GPU memory (allocated, peak, reserved; GB) and utilisation (%), the maximum over
    the training ranks, in the step's metrics (novarl/distributed/gpu_monitor.py); none without CUDA."""
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    tensorboard: dict[str, Any] = {}
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig)
    gpu_monitoring: GpuMonitoringConfig = Field(default_factory=GpuMonitoringConfig)


# ------------------------------------------------------------------ the whole
class NovaRLConfig(Section):
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    loss_fn: LossConfig = Field(default_factory=LossConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    env: dict[str, MathEnvConfig] = {}
    checkpointing: CheckpointingConfig = Field(default_factory=CheckpointingConfig)
    logger: LoggerConfig = Field(default_factory=LoggerConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    _load_warnings: tuple[str, ...] = PrivateAttr(default=())
    _load_notes: tuple[str, ...] = PrivateAttr(default=())

    @property
    def load_warnings(self) -> tuple[str, ...]:
        """What loading said about the file (settings accepted and not used, names rewritten),
        one line each; novarl validate, plan and train print them (config/loading.py: with_warnings)."""
        return self._load_warnings

    @property
    def load_notes(self) -> tuple[str, ...]:
        """What loading rewrote that is worth a line (a ROLL config: what each role block became)."""
        return self._load_notes

    @model_validator(mode="after")
    def _cross_checks(self) -> "NovaRLConfig":
        gen = self.policy.generation
        if gen.backend == "megatron" and not self.policy.megatron_cfg.enabled:
            raise ValueError(
                "policy.generation.backend='megatron' needs the Megatron training backend: "
                "set policy.megatron_cfg.enabled=true or pick backend 'vllm' or 'hf'")
        if gen.backend == "megatron" and not gen.colocated.enabled:
            raise ValueError(
                "policy.generation.backend='megatron' samples with the policy's own model on its own GPUs, "
                "so it cannot be dedicated: set policy.generation.colocated.enabled=true, or use 'vllm' "
                "for generation on GPUs of its own")
        if self.loss_fn.ratio_clip_min >= 1:
            raise ValueError(f"loss_fn.ratio_clip_min={self.loss_fn.ratio_clip_min} must be < 1 "
                             "(the ratio is clipped to [1 - min, 1 + max])")
        return self
