"""Settings novarl's schema holds (the seeds and NeMo RL name them) whose feature novarl
does not build, or builds differently: each is refused when set to something that would
change the maths, or said once in a warning when it only changes speed or memory. At its
default, each does what novarl does. `check_settings` runs after validation (load_config);
a test checks that every schema field is read by the code or named here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from novarl.config.files import MISSING, tree_get
from novarl.config.schema import NovaRLConfig
from novarl.config.sections.data import CODE_REWARDS, SandboxConfig


@dataclass(frozen=True)
class Setting:
    path: str
    neutral: Callable[[Any], bool]
    """Whether the value leaves the feature as novarl has it."""
    refuse: bool
    """True: a value outside neutral is refused; False: it is warned about."""
    why: str


def _off(value: Any) -> bool:
    return value in (None, False, 0, [], {}, "")


SETTINGS: tuple[Setting, ...] = (
    Setting("checkpointing.checkpoint_must_save_by", _off, True,
            "saving before a wall-clock deadline is not built; grpo.max_train_seconds ends a run on time, with a "
            "checkpoint"),
    Setting("policy.dtensor_cfg._v2", lambda v: v is True, False, "novarl has one DTensor worker"),
    Setting("checkpointing.save_consolidated", _off, False,
            "checkpoints hold the training shards; `novarl convert` (and the end of every run) writes the Hugging "
            "Face folder"),
    Setting("policy.megatron_cfg.moe_grouped_gemm", _off, False,
            "novarl runs the experts as megatron-core's SequentialMLP, one GEMM each (the same experts and maths; "
            "its weight conversion writes SequentialMLP's names, which a grouped-GEMM layer does not have)"),
    Setting("logger.gpu_monitoring.collection_interval", lambda v: v == 10, False,
            "the GPUs are read once per training step"),
    Setting("logger.gpu_monitoring.flush_interval", lambda v: v == 10, False,
            "GPU readings go out with each step's metrics"),
)
SETTINGS += (Setting("value.logprob_chunk_size", _off, False, "the critic's head is one value wide: no logits to chunk"),)
# PPO's critic (`value`) is a policy block: the policy's settings hold for it too (said for the critic only
# where it differs from the policy, which it starts from)
SETTINGS += tuple(dataclasses.replace(s, path="value." + s.path.removeprefix("policy.")) for s in SETTINGS
                  if s.path.startswith("policy.") and not s.path.startswith("policy.generation."))


def refuse_settings(tree: Mapping[str, Any]) -> list[str]:
    """The refusals among SETTINGS, read from the tree before validation, so that they are
    listed with the schema's own errors in one message."""
    refused = []
    for setting in SETTINGS:
        value = tree_get(tree, setting.path)
        if setting.path.startswith("value.") and value == tree_get(tree, "policy." + setting.path[6:]):
            continue  # the policy's, said once for it
        if setting.refuse and value is not MISSING and not setting.neutral(value):
            refused.append(f"'{setting.path}' = {value!r}: {setting.why}.")
    return refused


def check_settings(config: NovaRLConfig) -> list[str]:
    """The warnings, one line each, for the SETTINGS `config` sets outside their neutral values
    (the refusals are refuse_settings'). Megatron generation's CUDA graphs are said when
    Megatron generates."""
    warnings = []
    for setting in SETTINGS:
        if setting.path.startswith("value.") and (config.value is None or _get(config, setting.path) == _get(
                config, "policy." + setting.path.removeprefix("value."))):
            continue
        value = _get(config, setting.path)
        if not setting.refuse and not setting.neutral(value):
            warnings.append(f"'{setting.path}' = {value!r}: {setting.why}")
    warnings.extend(_sequence_parallel_warnings(config.policy))
    ddp = config.policy.megatron_cfg.distributed_data_parallel_config
    chunk = config.policy.logprob_chunk_size
    if chunk and _computes_logits_whole(config.policy):
        warnings.append(f"'policy.logprob_chunk_size' = {chunk}: logprobs come from chunks of that many tokens where "
                        "the output layer picks them (not under Megatron's context parallelism); this run computes "
                        "each micro-batch's logits whole")
    if config.policy.megatron_cfg.enabled:
        if ddp.overlap_param_gather:
            warnings.append("'policy.megatron_cfg.distributed_data_parallel_config.overlap_param_gather' = True: the "
                            "distributed optimizer gathers parameters after its step, without overlapping the next "
                            "forward")
        if ddp.average_in_collective:
            warnings.append("'policy.megatron_cfg.distributed_data_parallel_config.average_in_collective' = True: "
                            "gradients are summed in the collective, since each micro-batch's loss is already its "
                            "share of the step's mean (the same update)")
    warnings.extend(_reward_warnings(config))
    warnings.extend(_evaluation_sampling_warnings(config))
    warnings.extend(_tool_call_warnings(config))
    generation = config.policy.generation
    if generation.vllm_cfg.async_engine and not any(block.plays_episodes for block in config.env.values()):
        warnings.append("'policy.generation.vllm_cfg.async_engine' = True: it plays each episode's turns on its own "
                        "(an environment's: env.<name>.actor_class_fqn); this run's rollouts are single-turn, each "
                        "step's prompts generated at once")
    if generation.backend == "megatron" and generation.mcore_generation_config.num_cuda_graphs:
        warnings.append(f"'policy.generation.mcore_generation_config.num_cuda_graphs' = "
                        f"{generation.mcore_generation_config.num_cuda_graphs}: Megatron generation decodes eagerly "
                        "(no CUDA graphs are captured)")
    return warnings


def _get(config: Any, path: str) -> Any:
    for part in path.split("."):
        config = getattr(config, "v2" if part == "_v2" else part)
    return config


def _sequence_parallel_warnings(policy) -> list[str]:
    """Sequence parallelism splits the tensor-parallel ranks' activations: with one such rank (on
    the backend that trains) there is nothing to split."""
    mc, dt = policy.megatron_cfg, policy.dtensor_cfg
    if mc.enabled and mc.sequence_parallel and mc.tensor_model_parallel_size == 1:
        return ["'policy.megatron_cfg.sequence_parallel' = True: no effect with "
                "policy.megatron_cfg.tensor_model_parallel_size=1 (nothing to split the activations over)"]
    if not mc.enabled and not policy.deepspeed_cfg.enabled and dt.sequence_parallel and dt.tensor_parallel_size == 1:
        return ["'policy.dtensor_cfg.sequence_parallel' = True: no effect with "
                "policy.dtensor_cfg.tensor_parallel_size=1 (nothing to split the activations over)"]
    return []


def _computes_logits_whole(policy) -> bool:
    """Whether the output layer computes each micro-batch's logits whole rather than picking the logprobs
    chunk by chunk: Megatron's under context parallelism (megatron_model.py). DTensor's and DeepSpeed's
    head picks on every layout of theirs (under DTensor's tensor and context parallelism too; only a custom
    plan function that splits the head, unseen here, keeps it plain: models/logprob_head.py)."""
    return policy.megatron_cfg.enabled and policy.megatron_cfg.context_parallel_size > 1


def _tool_call_warnings(config: NovaRLConfig) -> list[str]:
    """grpo.invalid_tool_call_advantage where no environment plays the episodes: no turn calls a tool."""
    value = config.grpo.invalid_tool_call_advantage
    if value is None or any(block.plays_episodes for block in config.env.values()):
        return []
    return [f"'grpo.invalid_tool_call_advantage' = {value!r}: this run's rollouts are single-turn (no "
            "env.<name>.actor_class_fqn plays episodes), so no turn's tool call is run or found invalid"]


def _evaluation_sampling_warnings(config: NovaRLConfig) -> list[str]:
    """policy.generation.val_temperature / val_top_p / val_top_k set where the evaluation is greedy (NeMo
    RL's files set them to the training sampling's)."""
    generation = config.policy.generation
    given = [key for key in ("val_temperature", "val_top_p", "val_top_k") if getattr(generation, key) is not None]
    if not given or config.grpo.val_num_generations_per_prompt > 1:
        return []
    keys = given[0] if len(given) == 1 else f"{{{', '.join(given)}}}"
    return [f"'policy.generation.{keys}': the evaluation is greedy, one completion per prompt; the evaluation's "
            "sampling settings apply with grpo.val_num_generations_per_prompt > 1"]


def _reward_warnings(config: NovaRLConfig) -> list[str]:
    """reward.sandbox set where no code reward runs."""
    reward = config.reward
    if reward.sandbox != SandboxConfig() and not reward.used & set(CODE_REWARDS):
        return [f"'reward.sandbox' is set: only the code rewards ({', '.join(CODE_REWARDS)}) run programs, and this "
                "run's reward functions name none"]
    local = [k for k in ("isolate", "site_packages", "max_processes", "max_output_bytes", "max_file_mb")
             if getattr(reward.sandbox, k) != getattr(SandboxConfig(), k)]
    if reward.sandbox.url and local:
        return [f"'reward.sandbox.{{{', '.join(local)}}}': the local sandbox's settings, not used: programs run at "
                f"reward.sandbox.url={reward.sandbox.url!r}, under its own"]
    return []
