"""ROLL's pipeline configs (seed 003's format) in novarl's terms.

ROLL (alibaba/ROLL; the contract follows its RLVR examples at 8eb27cc, 2026-08) describes
a run as roles -- `actor_train`, `actor_infer`, `reference`, `rewards` -- each with a
`strategy_args` (`strategy_name` + `strategy_config`), a `device_mapping` (the GPUs it runs
on, e.g. `list(range(0,16))`) and an `infer_batch_size`, under top-level keys for the
algorithm and the schedule (`rollout_batch_size`, `num_return_sequences_in_group`,
`prompt_length`, `response_length`, `max_steps`, `pg_clip`, ...). `from_roll` turns such a
tree into novarl's sections:

- strategies: `megatron_train` -> policy.megatron_cfg (its strategy_config key by key),
  `fsdp2_train` -> policy.dtensor_cfg, `deepspeed_train` -> policy.deepspeed_cfg;
  `vllm` / `hf_infer` / `megatron_infer` for actor_infer -> policy.generation.backend;
  the reference runs on the training backend, as novarl's does.
- `device_mapping`: actor_infer's devices inside actor_train's -> colocated generation;
  apart from them -> dedicated, with the devices counted (policy.generation.colocated.resources);
  the cluster is the devices all roles name, `num_gpus_per_node` a node.
- `infer_batch_size` of actor_train / reference -> policy.logprob_batch_size.

- `adv_estimator`: grpo and reinforce -> novarl's group-baseline estimators; gae (ROLL's
  default) -> PPO: grpo.adv_estimator gae (lambd, gamma, whiten_advantages) with a critic, the
  `critic` block on the policy's backend and ranks, or without one a critic built like the
  policy (ROLL's critic model is reward_pretrain; the policy's model when it is not given).

Every other key is used, refused in one line when it asks for what novarl does not build
(difficulty masks, reward workers other than a math rule, ...), or warned about when it is
operational or read only with a switch that is off. `Translation.became` gives the lines the
log shows: what each block became.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from novarl.config.files import show_value
from novarl.config.roll_algorithm import algorithm, estimator_of, read_only_with
from novarl.config.roll_devices import ROLES, Placement, Translation, _number, parse_devices  # noqa: F401 (tests)
from novarl.config.roll_devices import placement as place, role_devices
from novarl.config.roll_rewards import read_rewards
from novarl.config.roll_training import (DTYPES, SECTIONS, TRAIN_STRATEGIES, Training, data_args, role_extras,
                                         strategy, trainer)

ROLL_VERSION = "ROLL main at 8eb27cc (2026-08-19), RLVR pipeline examples"


def is_roll(tree: Mapping[str, Any]) -> bool:
    """A ROLL pipeline config: one with ROLL's role blocks, or its `pretrain` model key."""
    return any(isinstance(tree.get(role), Mapping) for role in ROLES) or "pretrain" in tree


# Top-level keys: (ROLL key, novarl path or None, neutral values or None). A key with a path is
# copied there; a key with neutral values only is accepted at them and refused otherwise.
COPIED = {
    "seed": "grpo.seed",
    "logging_dir": "logger.log_dir",
    "max_steps": "grpo.max_num_steps",
    "save_steps": "checkpointing.save_period",
    "logging_steps": "logger.print_every_n_steps",
    "eval_steps": "grpo.val_period",
    "max_ckpt_to_keep": "checkpointing.keep_top_k",
    "rollout_batch_size": "grpo.num_prompts_per_step",
    "val_batch_size": "grpo.val_batch_size",
    "num_return_sequences_in_group": "grpo.num_generations_per_prompt",
    "max_grad_norm": "policy.max_grad_norm",
    "pretrain": "policy.model_name",
    "num_gpus_per_node": "cluster.gpus_per_node",
    "reward_clip": "grpo.reward_clip",
    "max_len_mask": "grpo.overlong_filtering",
    "difficulty_mask": "grpo.difficulty_mask.enabled",
    "difficulty_low_threshold": "grpo.difficulty_mask.low_threshold",
    "difficulty_high_threshold": "grpo.difficulty_mask.high_threshold",
    "difficulty_loss_weight": "grpo.difficulty_loss_weight",
    "ppo_epochs": "grpo.ppo_epochs",
}
NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "whiten_rewards": ((False,), "whitening the rewards is not built; set it false (whiten_advantages whitens the "
                                 "advantages)"),
    "use_reward_scaling": ((False,), "ROLL's running reward scaling is not built; set it false"),
    "use_reward_norm": ((False,), "ROLL's running reward normalisation is not built; set it false"),
    "reward_norm": ((None,), "ROLL's running reward normalisation is not built; set it null"),
    "reward_shift": ((None, 0, 0.0, False), "shifting the rewards is not built; set it false"),
    "reward_scale": ((None, 1, 1.0, False), "scaling the rewards is not built; set it false"),
    "error_max_len_clip": ((False,), "clipping error rewards at the maximum length is not built; set it false"),
    "length_loss_weight": ((False,), "weighting the loss by length is not built; set it false"),
    "add_token_level_kl": ((False,), "ROLL's KL controller in the reward is not built; set it false and use "
                                     "use_kl_loss with kl_loss_coef, or novarl's loss_fn.use_kl_in_reward=true with "
                                     "loss_fn.reference_policy_kl_penalty (a fixed coefficient)"),
    "add_len_reward": ((False,), "a length reward is not built; set it false"),
    "entropy_loss_coef": ((0, 0.0), "an entropy bonus is not built; set it 0"),
    "async_generation_ratio": ((0, 0.0), "ROLL's asynchronous generation is not mapped; set it 0 and use novarl's "
                                         "grpo.async_grpo.enabled=true (dedicated generation, with "
                                         "loss_fn.use_importance_sampling_correction=true)"),
    "is_num_return_sequences_expand": ((False, True), ""),
    "use_pg_clip_range": ((False, True), ""),
}
GOVERNED = ("value_clip", "lambd", "gamma", "target_kl",
            "kl_horizon", "kl_penalty", "critic_warmup", "reward_pretrain", "pg_clip", "pg_clip_low", "pg_clip_high",
            "dual_clip_loss", "use_kl_loss", "kl_loss_coef", "norm_mean_type", "norm_std_type", "adv_estimator",
            "whiten_advantages",
            "advantage_clip", "loss_agg_mode", "prompt_length", "response_length", "sequence_length",
            "output_dir", "checkpoint_config", "track_with", "validation", "rewards", "num_nodes", "enable_reference",
            "init_kl_coef", "critic", *ROLES)
"""Read below, with the keys they go with."""
OPERATIONAL = ("hydra", "exp_name", "resume_from_checkpoint", "tracker_kwargs", "system_envs", "rpc_timeout",
               "profiler_timeline", "profiler_memory", "profiler_output_dir", "report_length_and_rewards",
               "is_offload_states", "model_update_buffer_size_mb", "model_download_type", "offload_nccl",
               "max_running_requests", "global_template", "local_rank", "base_dir", "rollout_dump_dir")

VLLM_KEYS = {"gpu_memory_utilization": "gpu_memory_utilization", "tensor_parallel_size": "tensor_parallel_size",
             "pipeline_parallel_size": "pipeline_parallel_size", "max_model_len": "max_model_len",
             "enforce_eager": "enforce_eager"}
VLLM_OPERATIONAL = ("block_size", "load_format", "sleep_level", "distributed_executor_backend", "optimization_level",
                    "disable_log_stats", "enable_prefix_caching", "cuda_graph_sizes", "cudagraph_capture_sizes",
                    "max_num_batched_tokens", "disable_mm_preprocessor_cache")


def from_roll(tree: Mapping[str, Any]) -> Translation:
    """The ROLL pipeline config `tree` (interpolations resolved) in novarl's terms."""
    out = Translation()
    for key, value in tree.items():
        if key in COPIED:
            out.set(COPIED[key], value)
        elif key in NEUTRAL:
            allowed, why = NEUTRAL[key]
            if value not in allowed:
                out.refuse(key, value, why)
        elif key in OPERATIONAL:
            continue
        elif key not in GOVERNED:
            out.refused.append(f"unknown key '{key}' (a ROLL pipeline key novarl does not know).")
    ignored = [k for k in OPERATIONAL if k in tree and k not in ("hydra", "exp_name")]
    if ignored:
        out.warnings.append(f"ROLL settings about logging, profiling, the environment or resuming accepted and not "
                            f"used: {', '.join(ignored)} (novarl resumes from checkpointing.checkpoint_dir when it "
                            "holds a checkpoint; `novarl train --no-resume` refuses to)")
    algorithm(tree, out)
    _lengths(tree, out)
    _outputs(tree, out)
    placement = place(tree, out)
    read_only_with(tree, out)
    train = _actor_train(tree.get("actor_train"), out, placement)
    _actor_infer(tree.get("actor_infer"), out, placement, tree)
    _reference(tree.get("reference"), out, placement, train)
    _critic(tree, out, placement, train)
    refused = read_rewards(tree.get("rewards"), out, role_devices(tree))
    probs = out.tree.get("data", {}).get("domain_interleave_probs")
    if probs and refused:  # said once, at the worker
        out.tree["data"]["domain_interleave_probs"] = {d: p for d, p in probs.items() if d not in refused}
    _validation(tree.get("validation"), out)
    return out


def _lengths(tree: Mapping[str, Any], out: Translation) -> None:
    prompt, response = (_number(tree, k, out, integer=True) for k in ("prompt_length", "response_length"))
    total = _number(tree, "sequence_length", out, integer=True) or (prompt + response if prompt and response else None)
    if total:
        out.set("policy.max_seq_length", total)
    if response:
        out.set("policy.generation.max_new_tokens", response)
    if prompt:
        out.set("data.max_input_seq_length", prompt)


def _outputs(tree: Mapping[str, Any], out: Translation) -> None:
    checkpoint = tree.get("checkpoint_config") or {}
    folder = checkpoint.get("output_dir") or tree.get("output_dir")
    if folder:
        out.set("checkpointing.checkpoint_dir", folder)
    if checkpoint.get("type", "file_system") != "file_system":
        out.refuse("checkpoint_config.type", checkpoint["type"], "novarl saves checkpoints to a file system")
    sink = tree.get("track_with")
    if sink in ("wandb", "tensorboard", "mlflow", "swanlab"):
        out.set(f"logger.{sink}_enabled", True)
    elif sink not in (None, "stdout"):
        out.refuse("track_with", sink, "novarl's trackers are wandb, tensorboard, mlflow and swanlab")


# ------------------------------------------------------------------ roles
INFER_STRATEGIES = {"vllm": "vllm", "hf_infer": "hf", "megatron_infer": "megatron"}


def _actor_train(block: Any, out: Translation, placement: Placement | None) -> Training | None:
    if not isinstance(block, Mapping):
        out.refused.append("'actor_train' is missing: novarl needs the training role.")
        return None
    name, config, training = strategy(block, "actor_train", TRAIN_STRATEGIES, out)
    if training is None:
        return None
    for backend, section in SECTIONS.items():
        out.set(f"policy.{section}.enabled", training == backend)
    sizes = trainer(block, "actor_train", config, training, out, placement)
    data_args(block.get("data_args") or {}, out)
    role_extras(block, "actor_train", out, ("model_args", "training_args", "data_args", "strategy_args",
                                             "device_mapping", "infer_batch_size"))
    devices = len(placement.train) if placement else "?"
    done = Training(name, training, sizes, (block.get("model_args") or {}).get("dtype"))
    out.became.append(f"actor_train ({name} on {devices} device(s)) -> policy: {training} ({done.layout()})")
    return done


def _actor_infer(block: Any, out: Translation, placement: Placement | None, tree: Mapping[str, Any]) -> None:
    if not isinstance(block, Mapping):
        return
    name, config, backend = strategy(block, "actor_infer", INFER_STRATEGIES, out)
    if backend is None:
        return
    out.set("policy.generation.backend", backend)
    for key, value in config.items():
        if backend == "vllm" and key in VLLM_KEYS:
            out.set(f"policy.generation.vllm_cfg.{VLLM_KEYS[key]}", value)
        elif backend == "vllm" and key in VLLM_OPERATIONAL:
            continue
        else:
            out.refused.append(f"unknown key 'actor_infer.strategy_args.strategy_config.{key}' ({name}).")
    generating = block.get("generating_args") or {}
    for key, path in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"),
                      ("max_new_tokens", "max_new_tokens")):
        if generating.get(key) is not None:
            out.set(f"policy.generation.{path}", generating[key])
    group = tree.get("num_return_sequences_in_group")
    if generating.get("num_return_sequences") not in (None, group):
        out.refuse("actor_infer.generating_args.num_return_sequences", generating["num_return_sequences"],
                   f"it must equal num_return_sequences_in_group ({group})")
    if generating.get("num_beams", 1) != 1:
        out.refuse("actor_infer.generating_args.num_beams", generating["num_beams"], "beam search is not built")
    dtype = (block.get("model_args") or {}).get("dtype")
    if backend == "vllm" and dtype in DTYPES:
        out.set("policy.generation.vllm_cfg.precision", DTYPES[dtype])
    if backend == "hf" and block.get("infer_batch_size"):
        out.set("policy.generation.generation_batch_size", block["infer_batch_size"])
    role_extras(block, "actor_infer", out, ("model_args", "generating_args", "data_args", "strategy_args",
                                             "device_mapping", "infer_batch_size"))
    devices = len(placement.infer) if placement else "?"
    where = ("colocated on the training devices" if placement and placement.colocated
             else f"dedicated, {devices} device(s)")
    out.became.append(f"actor_infer ({name} on {devices} device(s)) -> policy.generation: {backend}, {where}")


def _reference(block: Any, out: Translation, placement: Placement | None, train: Training | None) -> None:
    """ROLL's reference: novarl's frozen reference runs on the policy's backend, devices and
    layout, in its precision; what the block asks otherwise is said in one warning."""
    if not isinstance(block, Mapping):
        return
    strategy = block.get("strategy_args") or {}
    name = strategy.get("strategy_name")
    if name not in ("megatron_infer", "hf_infer", "fsdp2_infer", "deepspeed_infer", None):
        out.refuse("reference.strategy_args.strategy_name", name, "the reference runs on a training backend")
    role_extras(block, "reference", out, ("model_args", "data_args", "strategy_args", "device_mapping",
                                           "infer_batch_size"))
    layout = f"actor_train's {train.strategy}: {train.layout()}" if train else "actor_train's"
    unused = _beside_the_policy(block, "reference", placement, train)
    if strategy.get("strategy_config"):
        shown = ", ".join(f"{k}={show_value(v)}" for k, v in strategy["strategy_config"].items())
        unused.insert(0, f"its strategy_config ({shown}): the reference runs on the training backend's layout "
                         f"({layout})")
    if unused:
        out.warnings.append(f"reference: {'; '.join(unused)}")
    out.became.append(f"reference ({name}) -> the frozen reference, on the training backend "
                      f"({train.backend if train else None}); it is loaded when loss_fn.reference_policy_kl_penalty > "
                      "0 (ROLL: use_kl_loss, kl_loss_coef)")


def _beside_the_policy(block: Mapping[str, Any], role: str, placement: Placement | None,
                       train: Training | None) -> list[str]:
    """What a role that novarl runs on the policy's devices and precision (the reference, the
    critic) asks otherwise: devices, and for the reference its dtype."""
    unused = []
    mapping = block.get("device_mapping")
    if placement is not None and mapping is not None:
        try:
            same = parse_devices(mapping, f"{role}.device_mapping") == placement.train
        except ValueError as err:
            same = True
            if role == "critic":  # (the reference's is refused with the placement)
                raise ValueError(f"'{role}.device_mapping': {err}") from None
        if not same:
            unused.append(f"its device_mapping differs from actor_train's: novarl's {role} runs on the policy's "
                          "devices")
    dtype = (block.get("model_args") or {}).get("dtype")
    if role == "reference" and train is not None and dtype is not None and dtype != train.dtype:
        unused.append(f"model_args.dtype={show_value(dtype)}: novarl's reference computes in the policy's precision "
                      f"(actor_train's dtype {show_value(train.dtype)})")
    return unused


CRITIC_KEYS = ("model_args", "training_args", "data_args", "strategy_args", "device_mapping", "infer_batch_size")


def _critic(tree: Mapping[str, Any], out: Translation, placement: Placement | None, train: Training | None) -> None:
    """PPO's critic (adv_estimator gae) as novarl's `value` section: it runs on the policy's
    backend, ranks and layout. ROLL's `critic` block gives its model (model_args.model_name_or_path,
    else reward_pretrain), optimizer, micro-batches and precision, and must name actor_train's
    strategy and sizes; without the block the critic is built like the policy (as NeMo RL's
    `value: {}`), on reward_pretrain when the file gives it, else on the policy's model. The block
    is translated as a training role and its `policy` settings become `value`; the run's settings
    it gives (training_args.num_train_epochs) are said in its warning, not used."""
    block = tree.get("critic")
    if estimator_of(tree) != "gae":
        if isinstance(block, Mapping) and block:
            out.warnings.append(f"critic: ROLL trains a critic only with adv_estimator: gae, and this file's is "
                                f"{show_value(estimator_of(tree))}; the block is not used")
        return
    if train is None:  # refused for its actor_train: a critic like the policy keeps the error to that line
        out.set("value", {})
        return
    model = (block.get("model_args") or {}).get("model_name_or_path") if isinstance(block, Mapping) else None
    if model and tree.get("reward_pretrain") not in (None, model):
        out.warnings.append(f"reward_pretrain={show_value(tree['reward_pretrain'])} is not used: the critic is "
                            f"critic.model_args.model_name_or_path ({show_value(model)}), and novarl has no "
                            "reward-model role (its math rule reward, reward.function, loads no model)")
    model = model or tree.get("reward_pretrain")
    policy_model = f" ({show_value(tree['pretrain'])})" if tree.get("pretrain") else ""
    shown = show_value(model) if model else f"the policy's model{policy_model}"
    if not isinstance(block, Mapping):
        out.set("value", {"model_name": model} if model else {})
        out.became.append(f"critic (no critic block; adv_estimator gae) -> value: a critic built like the policy, on "
                          f"{shown} with a scalar head, on the training backend ({train.backend}: {train.layout()}), "
                          "the policy's ranks and settings")
        return
    sub = Translation()
    name, config, backend = strategy(block, "critic", TRAIN_STRATEGIES, sub)
    if backend is not None and name != train.strategy:
        sub.refuse("critic.strategy_args.strategy_name", name, f"novarl's critic runs on the policy's backend and "
                   f"ranks ({train.strategy}); name it, with actor_train's parallel sizes, or remove the critic block "
                   "to build the critic like the policy")
    elif backend is not None:
        sizes = trainer(block, "critic", config, backend, sub, placement)
        if sizes != dict(train.sizes):
            sub.refused.append(f"'critic.strategy_args.strategy_config': its parallel sizes "
                               f"({', '.join(f'{k} {v}' for k, v in sizes.items()) or 'data parallel'}) differ from "
                               f"actor_train's ({train.layout()}): novarl's critic runs on the policy's ranks, laid "
                               "out like it; give actor_train's sizes.")
    worker = str(block.get("worker_cls") or "CriticWorker").rsplit(".", 1)[-1]
    if worker != "CriticWorker":
        sub.refuse("critic.worker_cls", block["worker_cls"], "novarl's critic is ROLL's CriticWorker (a scalar value "
                                                               "head trained on GAE's returns); remove worker_cls")
    unused = _beside_the_policy(block, "critic", placement, train)
    if block.get("data_args"):
        unused.append("data_args: the critic reads the policy's samples")
    out.refused.extend(sub.refused)
    out.warnings.extend(sub.warnings)
    unused.extend(_not_the_critics(sub.tree, block))
    if unused:
        out.warnings.append(f"critic: {'; '.join(unused)}")
    value = dict(sub.tree.get("policy", {}))
    if model:
        value["model_name"] = model
    out.set("value", value)
    role_extras(block, "critic", out, (*CRITIC_KEYS, "worker_cls"))
    out.became.append(f"critic ({name}) -> value: the critic, on {shown} with a scalar head, on the training backend "
                      f"({train.backend}: {train.layout()}) and the policy's ranks")


RUN_SETTINGS = {
    "grpo.max_num_epochs": ("training_args.num_train_epochs", "the run's epochs (grpo.max_num_epochs) are "
                                                             "actor_train's; the critic trains at every step the "
                                                             "policy does"),
}
"""A training role's keys that translate outside `policy`, to settings of the run: novarl's path
-> (the ROLL key under the role, why the critic's is not used)."""


def _not_the_critics(translated: Mapping[str, Any], block: Mapping[str, Any]) -> list[str]:
    """The critic block's keys whose translation lies outside `policy` (only `policy` becomes
    `value`): one line each, naming the key, for the block's warning."""
    lines = []
    for path in _leaf_paths({k: v for k, v in translated.items() if k != "policy"}):
        if path not in RUN_SETTINGS:  # translated elsewhere and not named here yet: still said
            lines.append(f"a key that became {path}, a setting of the run: not used")
            continue
        key, why = RUN_SETTINGS[path]
        section, _, leaf = key.partition(".")
        lines.append(f"{key}={show_value((block.get(section) or {}).get(leaf))}: {why}")
    return lines


def _leaf_paths(tree: Mapping[str, Any], prefix: str = "") -> list[str]:
    """The dotted paths of `tree`'s values that are not mappings, in order."""
    return [path for key, value in tree.items() for path in (
        _leaf_paths(value, f"{prefix}{key}.") if isinstance(value, Mapping) and value else [f"{prefix}{key}"])]


def _validation(validation: Any, out: Translation) -> None:
    if not isinstance(validation, Mapping):
        return
    files = (validation.get("data_args") or {}).get("file_name")
    files = [files] if isinstance(files, str) else list(files or [])
    if len(files) > 1:
        out.refuse("validation.data_args.file_name", files, "several held-out files are not built yet")
    elif files:
        out.set("data.val_data_path", files[0])
    if validation.get("generating_args"):
        out.warnings.append("validation.generating_args: not read (the evaluation is greedy, or samples "
                            "grpo.val_num_generations_per_prompt completions at policy.generation.val_temperature)")


