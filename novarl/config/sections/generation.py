"""The generation section (policy.generation: the engines, their sampling, where they run and how
they get weights). Re-exported by novarl.config.schema."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from novarl.config.sections.base import Precision, Section


class ResourcesConfig(Section):
    gpus_per_node: int | None = Field(None, ge=1)
    """GPUs per node dedicated to generation (dedicated mode only)."""
    num_nodes: int | None = Field(None, ge=1)
    """Nodes dedicated to generation (dedicated mode only)."""


class ColocatedConfig(Section):
    enabled: bool = True
    """True: generation shares the training devices. False: dedicated ones."""
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)


class VllmConfig(Section):
    async_engine: bool = False
    precision: Precision | Literal["fp8"] | None = None
    """The engines' dtype; None: the policy's. 'fp8' (NeMo RL's): vLLM's online FP8 quantization, weights
    in 128 x 128 blocks with dynamic activation scales, computed in the policy's dtype (bfloat16 or
    float16; float32 is refused) and re-quantized at each weight sync. CUDA GPUs of compute capability
    7.5 or newer, as vLLM has it: FP8 matmuls on Hopper and Blackwell, FP8 weights through vLLM's Marlin
    kernels on Turing, Ampere and Ada (backends/generation/vllm.py: fp8_engine_args)."""
    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    expert_parallel_size: int = Field(1, ge=1)
    gpu_memory_utilization: float = Field(0.6, gt=0, le=1)
    max_model_len: int | None = Field(None, ge=1)
    enforce_eager: bool = False
    use_deep_gemm: bool = False
    """With precision 'fp8': DeepGEMM's FP8 kernels, with float32 scales (VLLM_USE_DEEP_GEMM=1,
    VLLM_USE_DEEP_GEMM_E8M0=0, as NeMo RL sets); False: vLLM's own choice."""
    num_last_layers_in_bf16: int = Field(0, ge=0)
    """With precision 'fp8': the last N decoder layers are not quantized."""
    num_first_layers_in_bf16: int = Field(0, ge=0)
    """With precision 'fp8': the first N decoder layers are not quantized."""
    quantization_ignored_layer_kws: list[str] = []
    """With precision 'fp8': layers whose name contains one of these words are not quantized."""


class McoreGenerationConfig(Section):
    buffer_size_gb: float = Field(20, gt=0)
    num_cuda_graphs: int = Field(16, ge=0)
    block_size_tokens: int = Field(256, ge=1)
    enable_chunked_prefill: bool = True


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM's max_lora_rank accepts (policy.generation.lora_sync: adapter)."""


FOREIGN_GENERATION = ("sglang", "trtllm", "dynamo")
"""Generation backends of NeMo RL's configs that novarl does not build: refused as the config loads (any
other name is checked against backends/registry.py by the run's contract)."""


class GenerationConfig(Section):
    backend: str | None = None
    """A generation backend of backends/registry.py ('vllm', 'hf', 'megatron'; the run's contract refuses
    another name); None: the one measured faster for the model and host (backends/contract/resolve.py:
    default_generation_backend)."""

    @field_validator("backend")
    @classmethod
    def _not_a_foreign_engine(cls, backend: str | None) -> str | None:
        if backend in FOREIGN_GENERATION:  # config/nemo_rl.py's VALUE_NOTES says what to use instead
            raise ValueError(f"'{backend}' generation is not built in novarl")
        return backend
    max_new_tokens: int = Field(512, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int | None = Field(None, ge=1)
    val_temperature: float | None = Field(None, ge=0)
    """The evaluation's sampling with grpo.val_num_generations_per_prompt > 1 (NeMo RL's key); None:
    temperature. With one completion per prompt the evaluation is greedy (said when it is set)."""
    val_top_p: float | None = Field(None, gt=0, le=1)
    """As val_temperature, for top_p."""
    val_top_k: int | None = Field(None, ge=1)
    """As val_temperature, for top_k."""
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    """Token ids that end a completion; each below the tokenizer's vocabulary size (checked by preflight)."""
    stop_strings: list[str] | None = None
    """Strings that end a completion: it ends with the token that completes the first of them in its
    text (the string kept in its text and tokens); every engine (backends/generation/stops.py)."""
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
