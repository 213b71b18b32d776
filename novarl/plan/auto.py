"""`policy.backend: auto`: the planner's recommendation, applied to a config.

On a GPU host the advisor ranks the layouts for the model, `cluster` and the
memory of GPU 0; novarl takes its recommendation, or, when that backend is not
built yet, the best-ranked layout that fits and is built, and says so. On a
host without GPUs the advisor has no GPU memory to plan: the run takes the
CPU layout (DTensor over the `cluster` ranks, colocated generation).

What was chosen is written into the config as the seeds' own keys (the
`*_cfg.enabled` flags, parallel sizes, generation backend and placement), so
the rest of novarl, and the run's saved config.yaml, see an explicit config.
"""

from __future__ import annotations

from novarl.config.schema import NovaRLConfig
from novarl.errors import UserError


def apply_auto(cfg: NovaRLConfig, *, gpu_memory_gb: float | None = None,
               on_gpu: bool | None = None) -> tuple[NovaRLConfig, list[str]]:
    """(config with the chosen backends, lines explaining the choice); unchanged unless
    policy.backend is 'auto'. gpu_memory_gb / on_gpu: what this host has, when not probed."""
    if cfg.policy.backend != "auto":
        return cfg, []
    from novarl.config.loading import load_config, with_warnings
    from novarl.backends.contract.resolve import installed

    if on_gpu is None or (on_gpu and gpu_memory_gb is None):
        on_gpu, gpu_memory_gb = _probe_gpu()
    has_vllm = installed("vllm")
    if on_gpu and cfg.cluster.gpus_per_node >= 1:
        overrides, why = _from_advice(cfg, gpu_memory_gb, has_vllm)
    else:
        generation = "vllm" if has_vllm else "hf"
        overrides = _layout_overrides(tp=1, activation_checkpointing=False, cpu_offload=False,
                                      generation=generation, generation_tp=1, colocated=True)
        why = [f"policy.backend=auto, no GPU here: DTensor (FSDP2 over {max(cfg.cluster.gpus_per_node, 1)} x "
               f"{cfg.cluster.num_nodes} CPU rank(s)) with {generation} generation, colocated; the advisor's "
               "memory model is for GPUs (`novarl plan` shows it)."]
    overrides.append("policy.backend=null")  # resolved: the saved config is explicit
    if cfg.value is not None:  # the critic runs on the policy's backend and ranks, laid out like it
        overrides += [f"value.{o.removeprefix('policy.')}" for o in overrides
                      if o.startswith("policy.") and not o.startswith(("policy.generation.", "policy.backend"))]
    # only the keys the config gives (not every default): what loading says of keys set (unused
    # settings, say) stays about what the user set
    resolved = load_config(cfg.model_dump(by_alias=True, exclude_unset=True), overrides=overrides)
    return with_warnings(resolved, cfg.load_warnings, cfg.load_notes), why


def _probe_gpu() -> tuple[bool, float | None]:
    from novarl import host

    if not host.has_cuda():  # without importing torch
        return False, None
    import torch

    if not torch.cuda.is_available():
        return False, None
    return True, torch.cuda.get_device_properties(0).total_memory / 1e9


def _from_advice(cfg: NovaRLConfig, gpu_memory_gb: float, has_vllm: bool) -> tuple[list[str], list[str]]:
    from novarl.models.loading import resolve_model_path
    from novarl.plan.advisor import advise
    from novarl.backends.contract.model_shape import ModelShape
    from novarl.backends.contract.resolve import micro_batch_shape, separate_reference

    shape = ModelShape.from_name(resolve_model_path(cfg.policy.model_name, download=False))
    advice = advise(shape, gpus_per_node=cfg.cluster.gpus_per_node, num_nodes=cfg.cluster.num_nodes,
                    gpu_memory_gb=gpu_memory_gb, **micro_batch_shape(cfg.policy),
                    precision=cfg.policy.precision or "bfloat16",
                    with_reference=separate_reference(cfg), with_critic=cfg.value is not None)
    runnable = [c for c in advice.candidates if c.fits and c.built]
    if not runnable:
        raise UserError(f"policy.backend=auto: no layout novarl can run today fits {cfg.policy.model_name} on "
                        f"{cfg.cluster.num_nodes} x {cfg.cluster.gpus_per_node} GPU(s) of {gpu_memory_gb:.0f} GB; "
                        "`novarl plan -c CONFIG` lists every layout with its memory.")
    pick = advice.recommended if advice.recommended in runnable else runnable[0]
    why = [f"policy.backend=auto ({gpu_memory_gb:.0f} GB GPUs): {line}" for line in advice.explanation]
    if pick is not advice.recommended:
        wanted = advice.recommended.describe() if advice.recommended else "nothing"
        why.append(f"the advisor recommends {wanted}, which novarl does not run yet; running the best-ranked "
                   f"layout it does run: {pick.describe()}")
    generation = pick.generation_backend
    if generation == "vllm" and not has_vllm:
        generation = "hf"
        why.append("vLLM is not installed: generation falls back to Hugging Face")
    overrides = _layout_overrides(tp=pick.tensor_parallel_size, activation_checkpointing=pick.activation_checkpointing,
                                  cpu_offload="offload" in pick.strategy, generation=generation,
                                  generation_tp=pick.generation_tp, colocated=pick.placement == "colocated",
                                  zero_stage=int(pick.strategy[-1]) if pick.training_backend == "deepspeed" else None,
                                  cp=pick.context_parallel_size)
    if pick.training_backend == "megatron":
        overrides += _megatron_overrides(pick)
    if pick.placement == "dedicated":  # generation on the last node, training on the others (NeMo RL's count)
        overrides += [f"policy.generation.colocated.resources.gpus_per_node={cfg.cluster.gpus_per_node}",
                      "policy.generation.colocated.resources.num_nodes=1"]
    return overrides, why


def _layout_overrides(*, tp: int, activation_checkpointing: bool, cpu_offload: bool, generation: str,
                      generation_tp: int, colocated: bool, zero_stage: int | None = None, cp: int = 1) -> list[str]:
    """The seeds' keys for a layout: DTensor, or DeepSpeed ZeRO `zero_stage` when given."""
    deepspeed = (["policy.deepspeed_cfg.enabled=true", f"policy.deepspeed_cfg.zero_stage={zero_stage}",
                  f"policy.deepspeed_cfg.activation_checkpointing={str(activation_checkpointing).lower()}"]
                 if zero_stage is not None else ["policy.deepspeed_cfg.enabled=false"])
    return ["policy.dtensor_cfg.enabled=true", "policy.megatron_cfg.enabled=false", *deepspeed,
            f"policy.dtensor_cfg.tensor_parallel_size={tp}", f"policy.dtensor_cfg.context_parallel_size={cp}",
            f"policy.dtensor_cfg.activation_checkpointing={str(activation_checkpointing).lower()}",
            f"policy.dtensor_cfg.cpu_offload={str(cpu_offload).lower()}",
            f"policy.generation.backend={generation}",
            *([f"policy.generation.vllm_cfg.tensor_parallel_size={generation_tp}"] if generation == "vllm" else []),
            f"policy.generation.colocated.enabled={str(colocated).lower()}"]


def _megatron_overrides(pick) -> list[str]:
    """Megatron-core for a `megatron tp x pp` layout (after _layout_overrides, which it
    overrides): sequence parallelism with TP where Transformer Engine is there to run it
    and generation is not Megatron's."""
    from novarl.backends.megatron.model import transformer_engine_available

    # decoding with Megatron feeds one token at a time, which sequence parallelism cannot split
    sequence_parallel = (pick.tensor_parallel_size > 1 and transformer_engine_available()
                         and pick.generation_backend != "megatron")
    return ["policy.megatron_cfg.enabled=true", "policy.dtensor_cfg.tensor_parallel_size=1",
            f"policy.megatron_cfg.tensor_model_parallel_size={pick.tensor_parallel_size}",
            f"policy.megatron_cfg.pipeline_model_parallel_size={pick.pipeline_parallel_size}",
            f"policy.megatron_cfg.expert_model_parallel_size={pick.expert_parallel_size}",
            "policy.megatron_cfg.virtual_pipeline_model_parallel_size="
            + (str(pick.virtual_pipeline_parallel_size) if pick.virtual_pipeline_parallel_size > 1 else "null"),
            f"policy.megatron_cfg.sequence_parallel={str(sequence_parallel).lower()}",
            f"policy.megatron_cfg.activation_checkpointing={str(pick.activation_checkpointing).lower()}"]
