"""`policy.backend: auto`: the planner's recommendation, applied to a config.

On a GPU host the advisor ranks the layouts for the model, `cluster` and the
memory of GPU 0; novarl takes its recommendation, or, when that backend is not
built yet, the best-ranked layout that fits and is built, and says so. On a
host without GPUs the advisor has no GPU memory to plan: the run takes the
CPU layout (DTensor over the `cluster` ranks, colocated generation on the engine
measured faster there for the model's size, as without auto).

What was chosen is written into the config as the seeds' own keys (the
`*_cfg.enabled` flags, parallel sizes, generation backend and placement), so
the rest of novarl, and the run's saved config.yaml, see an explicit config.
"""

from __future__ import annotations

from novarl.backends.contract.resolve import default_generation_backend
from novarl.backends.registry import (DEFAULT_TRAINING, FALLBACK_GENERATION, generation_spec, training_spec,
                                      training_specs)
from novarl.backends.spec import PlannedLayout
from novarl.config.schema import NovaRLConfig
from novarl.errors import UserError



def apply_auto(cfg: NovaRLConfig, *, gpu_memory_gb: float | None = None,
               on_gpu: bool | None = None) -> tuple[NovaRLConfig, list[str]]:
    """(config with the chosen backends, lines explaining the choice); unchanged unless
    policy.backend is 'auto'. gpu_memory_gb / on_gpu: what this host has, when not probed."""
    if cfg.policy.backend != "auto":
        return cfg, []
    from novarl.config.loading import load_config, with_warnings

    if on_gpu is None or (on_gpu and gpu_memory_gb is None):
        on_gpu, gpu_memory_gb = _probe_gpu()
    if on_gpu and cfg.cluster.gpus_per_node >= 1:
        overrides, why = _from_advice(cfg, gpu_memory_gb)
    else:
        generation, reason = default_generation_backend(cfg)  # the engine measured faster for this model here
        overrides = _layout_overrides(DEFAULT_TRAINING, PlannedLayout(), generation=generation, generation_tp=1,
                                      colocated=True)
        why = [f"policy.backend=auto, no GPU here: DTensor (FSDP2 over {max(cfg.cluster.gpus_per_node, 1)} x "
               f"{cfg.cluster.num_nodes} CPU rank(s)) with {generation} generation ({reason}), colocated; the "
               "advisor's memory model is for GPUs (`novarl plan` shows it)."]
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


def _from_advice(cfg: NovaRLConfig, gpu_memory_gb: float) -> tuple[list[str], list[str]]:
    from novarl.models.loading import resolve_model_path
    from novarl.models.scores import training_precision
    from novarl.plan.advisor import advise
    from novarl.plan.rewards import policy_cluster, reward_model_fits
    from novarl.backends.contract.model_shape import ModelShape
    from novarl.backends.contract.resolve import micro_batch_shape, separate_reference

    shape = ModelShape.from_name(resolve_model_path(cfg.policy.model_name, download=False),
                                 overrides=cfg.policy.hf_config_overrides)
    per_node, nodes = policy_cluster(cfg)  # less the model-based rewards' own devices
    advice = advise(shape, gpus_per_node=per_node, num_nodes=nodes,
                    gpu_memory_gb=gpu_memory_gb, **micro_batch_shape(cfg.policy),
                    precision=training_precision(cfg.policy.precision, on_gpu=True),
                    with_reference=separate_reference(cfg), with_critic=cfg.value is not None)
    runnable = [c for c in advice.candidates if c.fits and c.built]
    if not runnable:
        raise UserError(f"policy.backend=auto: no layout novarl can run today fits {cfg.policy.model_name} on "
                        f"{nodes} x {per_node} GPU(s) of {gpu_memory_gb:.0f} GB; "
                        "`novarl plan -c CONFIG` lists every layout with its memory.")
    pick = advice.recommended if advice.recommended in runnable else runnable[0]
    why = [f"policy.backend=auto ({gpu_memory_gb:.0f} GB GPUs): {line}" for line in advice.explanation]
    if pick is not advice.recommended:
        wanted = advice.recommended.describe() if advice.recommended else "nothing"
        why.append(f"the advisor recommends {wanted}, which novarl does not run yet; running the best-ranked "
                   f"layout it does run: {pick.describe()}")
    generation = pick.generation_backend
    if generation_spec(generation).missing(cfg):
        generation = FALLBACK_GENERATION
        why.append(f"{generation_spec(pick.generation_backend).title} is not installed: generation falls back to "
                   f"{generation_spec(generation).title}")
    overrides = _layout_overrides(pick.training_backend, planned_layout(pick, generation), generation=generation,
                                  generation_tp=pick.generation_tp, colocated=pick.placement == "colocated")
    if pick.placement == "dedicated":  # generation on the last node, training on the others (NeMo RL's count)
        overrides += [f"policy.generation.colocated.resources.gpus_per_node={cfg.cluster.gpus_per_node}",
                      "policy.generation.colocated.resources.num_nodes=1"]
    why += [f"policy.backend=auto: {fit.describe(gpu_memory_gb)}" for fit in reward_model_fits(cfg, gpu_memory_gb)]
    return overrides, why


def planned_layout(pick, generation: str) -> PlannedLayout:
    """The advisor's Candidate `pick`, generated by `generation`, as the specs read it."""
    return PlannedLayout(
        tensor_parallel_size=pick.tensor_parallel_size, context_parallel_size=pick.context_parallel_size,
        pipeline_parallel_size=pick.pipeline_parallel_size,
        virtual_pipeline_parallel_size=pick.virtual_pipeline_parallel_size,
        expert_parallel_size=pick.expert_parallel_size, activation_checkpointing=pick.activation_checkpointing,
        cpu_offload="offload" in pick.strategy, zero_stage=pick.zero_stage,
        generation_on_training_weights=generation_spec(generation).on_training_weights)


def _layout_overrides(training: str, layout: PlannedLayout, *, generation: str, generation_tp: int,
                      colocated: bool) -> list[str]:
    """The seeds' keys for a layout: every training backend's enabled flag (DTensor's, the default,
    stays on beneath the chosen one), DTensor's sizes, the chosen backend's own, and generation's."""
    flags = [f"policy.{spec.section}.enabled={str(spec.name in (training, DEFAULT_TRAINING)).lower()}"
             for spec in training_specs()]
    sizes = training_spec(DEFAULT_TRAINING).layout_overrides(layout)
    if training != DEFAULT_TRAINING:
        sizes += training_spec(training).layout_overrides(layout)
    return [*flags, *sizes, f"policy.generation.backend={generation}",
            *generation_spec(generation).layout_overrides(generation_tp),
            f"policy.generation.colocated.enabled={str(colocated).lower()}"]
