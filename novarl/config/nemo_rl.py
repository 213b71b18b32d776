"""NeMo RL's keys that novarl's schema does not hold, and what novarl does with each.

The contract follows NeMo RL at commit 7ea279a (NVIDIA-NeMo/RL, 2026-08-22): its
`examples/configs/grpo_*.yaml` and `examples/configs/recipes/llm/grpo-*.yaml`, and the
September-2025 files before them. Every key those files hold is either

- in novarl's schema (config/schema.py and config/sections/) and used there, or renamed to a key that is
  (`translate`: NeMo RL's `data.train` / `data.validation` / `data.default` blocks, the
  advantage estimator's copies of grpo's flags, `val_period: -1`);
- a **feature switch** (`off`): accepted while it leaves the feature off, which is what novarl
  does; set to anything else it is refused with one line naming the key and what is missing,
  because it would change the maths and novarl does not build it;
- **operational** (`operational`): ports, servers, CUDA graphs, logging details, offloading:
  they change how fast or where, not what is computed. Accepted, and listed in one warning.
- **governed** (`governed`): read by NeMo RL only when a feature switch is on (the dynamic
  sampling cap, an engine's own block): accepted as they are, since the switch is refused
  when on.

`take_foreign` removes those keys from a composed tree before validation and returns what
it refused and what it warns about; load_config reports both with the schema's own errors,
in one message.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from novarl.config.files import show_value, tree_get
from novarl.config.sections.data import BUILT_IN_ENVIRONMENTS

NEMO_RL_VERSION = "NeMo RL main at 7ea279a (2026-08-22), and its September-2025 files"
"""The NeMo RL the key set follows (README: "Config compatibility")."""

Neutral = Callable[[Any, Mapping[str, Any]], bool]
"""(value, the whole tree) -> whether the value leaves the feature off."""


def _is(*values: Any) -> Neutral:
    return lambda value, tree: any(value == v and type(value) is type(v) or value is v for v in values)


def _empty(value: Any, tree: Mapping[str, Any]) -> bool:
    return value is None or value == {} or value == [] or value == ""


def _disabled(value: Any, tree: Mapping[str, Any]) -> bool:
    """A block with an `enabled` flag (or null) that is off."""
    return value is None or isinstance(value, Mapping) and value.get("enabled", False) is False


def _all_off(value: Any, tree: Mapping[str, Any]) -> bool:
    """A block of flags and ids (reward_penalties): every one false or null."""
    return value is None or isinstance(value, Mapping) and all(v in (None, False, 0, {}, []) for v in value.values())


def _no_kl(value: Any, tree: Mapping[str, Any]) -> bool:
    """skip_reference_policy_logprobs_calculation: novarl loads no reference at a KL penalty of 0."""
    return value is False or value is None or not (tree.get("loss_fn") or {}).get("reference_policy_kl_penalty", 0)


@dataclass(frozen=True)
class Rule:
    path: str
    """Dotted key path; a '*' part matches any one key."""
    kind: str
    """'off', 'operational' or 'governed' (see the module docstring)."""
    neutral: Neutral = field(default=lambda value, tree: True)
    why: str = ""
    """For 'off': what is not built (the refusal's reason). For 'operational': left empty."""


def off(path: str, neutral: Neutral, why: str) -> Rule:
    return Rule(path, "off", neutral, why)


def operational(*paths: str) -> list[Rule]:
    return [Rule(p, "operational") for p in paths]


def governed(*paths: str) -> list[Rule]:
    return [Rule(p, "governed") for p in paths]


ISSUE_ASYNC = "not built yet (asynchronous GRPO runs without it)"
ISSUE_DATA = "not built yet"

RULES: tuple[Rule, ...] = (
    # ---------------------------------------------------------------- grpo
    off("grpo.async_grpo.in_flight_weight_updates", _is(False),
        "in-flight weight updates (the engines taking new weights in the middle of a round) are not built: novarl "
        "queues each step's weights behind the rounds the engines have, sent in the background without the trainer "
        "waiting for those rounds"),
    off("grpo.async_grpo.max_generation_failures", _is(0), f"tolerated generation failures are {ISSUE_ASYNC}"),
    off("grpo.async_grpo.recompute_kv_cache_after_weight_updates", _is(False),
        f"KV-cache recomputation is {ISSUE_ASYNC}"),
    *governed("grpo.stop_at_validation_threshold",
              "data.num_prompts_per_dataloader", "data.custom_dataloader",
              "policy.megatron_cfg.optimizer.optimizer_offload_fraction",
              "policy.megatron_cfg.optimizer.overlap_cpu_optimizer_d2h_h2d", "policy.generation.sglang_cfg",
              "policy.generation.trtllm_cfg", "policy.generation.trtllm_kwargs", "policy.generation.dynamo_cfg",
              "policy.megatron_cfg.fused_linear_logprobs_chunk_size"),
    off("grpo.seq_logprob_error_threshold", _is(None), "masking sequences by logprob error is not built"),
    off("grpo.invalid_tool_call_advantage", _is(None), "tool calls are not built (single-turn rollouts)"),
    off("grpo.malformed_thinking_advantage", _is(None), "<think>-tag checks are not built"),
    off("grpo.stop_at_validation_metric", _is(None), "stopping on a validation metric is not built"),
    off("grpo.val_num_generations_per_prompt", _is(1), "pass@k evaluation is not built (novarl evaluates one "
        "greedy completion per prompt)"),
    off("grpo.val_start_at", lambda v, t: v is None or isinstance(v, int) and v <= 0,
        "delaying periodic evaluation is not built"),
    off("grpo.skip_reference_policy_logprobs_calculation", _no_kl,
        "a KL penalty without reference logprobs cannot be computed (novarl skips them when "
        "loss_fn.reference_policy_kl_penalty is 0)"),
    # ---------------------------------------------------------------- top level
    off("grpo.async_grpo.warmup_generation_lead_steps", _is(None), f"asynchronous PPO's warm-up is {ISSUE_ASYNC}"),
    off("grpo.async_grpo.drop_incomplete_targets_on_restore", _is(False),
        "novarl's checkpoints hold the rounds in flight whole (waited for), so none is incomplete on restore"),
    off("async_rl", _is(None), f"the single-controller asynchronous loop is {ISSUE_ASYNC}"),
    off("on_policy_distillation", _disabled, "on-policy distillation is not built"),
    off("reward_penalties", _all_off, "NeMo-Gym reward penalties are not built"),
    # ---------------------------------------------------------------- loss
    off("loss_fn.positive_example_nll_weight", _is(0, 0.0), "VAPO's NLL term is not built"),
    off("loss_fn.use_cispo", _is(False), "CISPO is not built"),
    # ---------------------------------------------------------------- policy
    off("policy.draft", _disabled, "draft models (speculative decoding heads) are not built"),
    off("policy.router_replay", _disabled, "MoE router replay is not built"),
    off("policy.hf_config_overrides", _empty, "overriding the model's config.json is not built"),
    off("policy.dtensor_cfg.expert_parallel_size", _is(1, None), "expert parallelism on DTensor is not built "
        "(use megatron_cfg.expert_model_parallel_size)"),
    off("policy.megatron_cfg.peft", _disabled, "LoRA on Megatron is not built yet (DTensor and DeepSpeed have it: "
        "policy.dtensor_cfg.lora_cfg)"),
    off("policy.megatron_cfg.model_overrides", _empty, "overriding the Megatron model provider is not built"),
    off("policy.megatron_cfg.mtp_num_layers", _is(0, None), "multi-token prediction is not built"),
    off("policy.megatron_cfg.mtp_loss_scaling_factor", _is(0, 0.0, None), "multi-token prediction is not built"),
    off("policy.megatron_cfg.mtp_use_repeated_layer", _is(False), "multi-token prediction is not built"),
    off("policy.megatron_cfg.mtp_detach_heads", _is(False), "multi-token prediction is not built"),
    off("policy.megatron_cfg.moe_router_enable_expert_bias", _is(False), "the MoE router's expert bias is not built"),
    off("policy.megatron_cfg.freeze_config", _empty, "freezing parts of a Megatron model is not built"),
    off("policy.quant_cfg", _empty, "quantisation-aware training (ModelOpt) is not built"),
    *governed("policy.disable_modelopt_layer_spec", "policy.quant_batch_size", "policy.quant_calib_data",
              "policy.quant_calib_size",
              "policy.quant_sequence_length"),
    off("policy.sequence_packing.microbatch_order", _is("packer"), "novarl runs micro-batches in the packer's order"),
    off("policy.generation.use_async_rollouts", _is(False), f"asynchronous rollouts are {ISSUE_ASYNC}"),
    off("policy.generation.quant_cfg", _empty, "quantised generation is not built"),
    off("policy.generation.real_quant", _is(False, None), "quantised generation is not built"),
    off("policy.generation.real_quant_ignore", _empty, "quantised generation is not built"),
    off("policy.generation.mcore_generation_config.num_speculative_tokens", _is(0, None),
        "speculative decoding is not built"),
    off("policy.generation.vllm_cfg.kv_cache_dtype", _is("auto", None), "a quantised KV cache is not built (FP8 "
        "generation, vllm_cfg.precision: fp8, keeps the KV cache in the policy's dtype)"),
    off("policy.generation.vllm_cfg.is_mx", _is(False, None), "MXFP8 generation (ModelOpt's) is not built; "
        "vllm_cfg.precision: fp8 quantizes in 128 x 128 blocks"),
    off("policy.generation.vllm_cfg.pow2_weight_scaling_factors", _is(False, None),
        "power-of-two FP8 scales are not built (vLLM's online FP8 keeps float32 scales)"),
    off("policy.generation.vllm_cfg.pow2_activation_scaling_factors", _is(False, None),
        "power-of-two FP8 scales are not built (vLLM's online FP8 keeps float32 scales)"),
    off("policy.generation.vllm_cfg.logprobs_mode", _is("processed_logprobs", None),
        "novarl's vLLM engines return processed logprobs (after temperature and top-p/top-k)"),
    off("data.use_multiple_dataloader", _is(False), f"several dataloaders are {ISSUE_DATA}"),
    off("data.add_system_prompt", _is(False), "set data.system_prompt_file for a system prompt"),
    # ---------------------------------------------------------------- operational
    *operational(
        "cluster.master_port_range_low", "cluster.master_port_range_high", "cluster.segment_size",
        "checkpointing.save_optimizer", "data_plane",
        "data.num_workers",
        "logger.swanlab", "logger.wandb.log_nemo_gym_full_result_tables",
        "policy.offload_optimizer_for_logprob", "policy.refit_buffer_size_gb",
        "policy.activation_checkpointing_enabled",
        "policy.tokenizer.use_fastokens",
        "policy.sequence_packing.fuse_loss",
        "policy.dtensor_cfg.clear_cache_every_n_steps", "policy.dtensor_cfg.automodel_kwargs",
        "policy.dtensor_cfg.env_vars",
        "policy.generation.port_range_low", "policy.generation.port_range_high",
        "policy.generation.real_quant_export_cpu_offload", "policy.generation.refit_cfg",
        "policy.generation.refit_transport",
        "policy.generation.val_temperature", "policy.generation.val_top_p", "policy.generation.val_top_k",
        "policy.generation.mcore_generation_config.*",
        "policy.generation.vllm_cfg.enable_vllm_metrics_logger",
        "policy.generation.vllm_cfg.vllm_metrics_logger_interval",
        "policy.generation.vllm_cfg.http_refit_api_key_env_var", "policy.generation.vllm_cfg.http_refit_server_port",
        "policy.generation.vllm_cfg.zmq_refit_server_port", "policy.generation.vllm_cfg.use_tqdm",
        "policy.generation.vllm_cfg.reset_encoder_cache_after_weight_update", "policy.generation.vllm_cfg.env_vars",
        "policy.generation.vllm_cfg.expose_http_server", "policy.generation.vllm_cfg.enable_prefix_caching",
        "policy.generation.vllm_cfg.enable_expert_parallel",
        "policy.megatron_cfg.checkpoint", "policy.megatron_cfg.cuda_graph_impl",
        "policy.megatron_cfg.cuda_graph_modules",
        "policy.megatron_cfg.cuda_graph_warmup_steps", "policy.megatron_cfg.fine_grained_activation_offloading",
        "policy.megatron_cfg.offload_modules", "policy.megatron_cfg.recompute_modules",
        "policy.megatron_cfg.force_reconvert_from_hf", "policy.megatron_cfg.use_fused_linear_logprobs",
        "policy.megatron_cfg.gradient_accumulation_fusion", "policy.megatron_cfg.moe_enable_deepep",
        "policy.megatron_cfg.moe_per_layer_logging", "policy.megatron_cfg.moe_shared_expert_overlap",
        "policy.megatron_cfg.use_fused_weighted_squared_relu", "policy.megatron_cfg.use_gloo_process_groups",
        "policy.megatron_cfg.attention_backend",
        "policy.megatron_cfg.optimizer.optimizer_cpu_offload",
    ),
)
"""Every NeMo RL key the schema lacks (see the module docstring). mcore_generation_config's keys
novarl's schema has (buffer_size_gb, ...) stay in it: a '*' rule takes only the keys the
schema does not hold."""

OPERATIONAL_NOTES = {
    "policy.generation.val_temperature": "novarl evaluates greedily",
    "policy.generation.val_top_p": "novarl evaluates greedily",
    "policy.generation.val_top_k": "novarl evaluates greedily",
    "checkpointing.save_optimizer": "novarl always saves the optimizer state, so that a resume is exact",
    "policy.megatron_cfg.optimizer.optimizer_cpu_offload": "the optimizer stays on the GPU",
    "policy.megatron_cfg.fine_grained_activation_offloading": "activations stay on the GPU",
    "policy.activation_checkpointing_enabled": "set dtensor_cfg.activation_checkpointing",
    "data_plane": "novarl moves rollouts through Ray's object store",
    "policy.dtensor_cfg.automodel_kwargs": "novarl loads models with transformers",
}
"""What an operational key's absence means where it is worth a word (said in the warning)."""


@dataclass
class Foreign:
    """What take_foreign found."""

    refused: list[str] = field(default_factory=list)
    """One line per feature switch that is on."""
    ignored: list[str] = field(default_factory=list)
    """Operational keys given (paths), warned about together."""

    def warning(self) -> str | None:
        if not self.ignored:
            return None
        groups: dict[str, list[str]] = {}
        for path in self.ignored:
            parent, _, key = path.rpartition(".")
            groups.setdefault(parent, []).append(f"{key} ({OPERATIONAL_NOTES[path]})" if path in OPERATIONAL_NOTES
                                                 else key)
        names = [f"{parent}.{keys[0]}" if len(keys) == 1 else f"{parent}.{{{', '.join(keys)}}}"
                 for parent, keys in groups.items()]
        return (f"{len(self.ignored)} NeMo RL setting(s) about ports, servers, logging, kernels or offloading are "
                f"accepted and not used by novarl: {'; '.join(n.removeprefix('.') for n in names)}")


def _backend(tree: Mapping[str, Any]) -> Any:
    return tree_get(tree, "policy.generation.backend", None)


INACTIVE_SECTIONS: tuple[tuple[str, Callable[[Mapping[str, Any]], bool]], ...] = (
    ("policy.megatron_cfg.", lambda tree: not tree_get(tree, "policy.megatron_cfg.enabled", None)),
    ("policy.generation.mcore_generation_config.", lambda tree: _backend(tree) != "megatron"),
    ("policy.generation.vllm_cfg.", lambda tree: _backend(tree) not in ("vllm", None)),
    ("value.megatron_cfg.", lambda tree: not tree_get(tree, "value.megatron_cfg.enabled", None)),
)
"""Sections a run does not use (a backend that is off): their operational keys are not worth a
warning, since nothing would read them."""


def take_foreign(tree: dict[str, Any], schema_has: Callable[[str], bool]) -> Foreign:
    """Remove from `tree` (in place) the keys RULES names that the schema does not hold
    (`schema_has(path)`), and say which it refuses and which it warns about."""
    found = Foreign()
    whole = dict(tree)
    # NeMo RL's value section is a policy block (the critic's): the policy's rules hold there too
    critic = [dataclasses.replace(r, path="value." + r.path.removeprefix("policy.")) for r in RULES
              if r.path.startswith("policy.") and not r.path.startswith("policy.generation.")]
    for rule in (*RULES, *critic):
        for path, parent, key in _matches(tree, rule.path.split(".")):
            if schema_has(path):
                continue
            value = parent.pop(key)
            if rule.kind == "operational":
                if not any(path.startswith(section) and inactive(whole) for section, inactive in INACTIVE_SECTIONS):
                    found.ignored.append(path)
            elif rule.kind == "off" and not rule.neutral(value, whole):
                found.refused.append(f"'{path}' = {show_value(value)}: {rule.why}; remove it or turn it off.")
    return found


def _matches(node: Any, parts: list[str], prefix: str = "") -> list[tuple[str, dict[str, Any], str]]:
    if not isinstance(node, dict):
        return []
    head, rest = parts[0], parts[1:]
    keys = list(node) if head == "*" else [head] if head in node else []
    out = []
    for key in keys:
        path = f"{prefix}.{key}" if prefix else key
        out.extend([(path, node, key)] if not rest else _matches(node[key], rest, path))
    return out


# ------------------------------------------------------------------ renames
DATA_FIELDS = {"dataset_name": "dataset_name", "input_key": "input_key", "output_key": "output_key",
               "prompt_file": "prompt_file", "system_prompt_file": "system_prompt_file",
               "split_validation_size": "split_validation_size"}
"""NeMo RL's per-dataset keys (data.train / data.default) and novarl's flat data keys."""

PROCESSORS = (None, "math_hf_data_processor", "math_data_processor")
"""NeMo RL prompt processors that do what novarl does: the prompt file around the problem,
then the tokenizer's chat template."""

OPTIMIZER_SYNONYMS = {
    "transformer_engine.pytorch.optimizers.fused_adam.FusedAdam": "torch.optim.AdamW",
    "transformer_engine.pytorch.optimizers.FusedAdam": "torch.optim.AdamW",
}
"""Optimizers NeMo RL recipes name that compute torch's update (TE's FusedAdam is AdamW, fused)."""


def translate(tree: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Rewrite, in place, NeMo RL's spellings of settings novarl has into novarl's keys.
    Returns (refused, warnings): one line each."""
    refused: list[str] = []
    warnings: list[str] = []
    grpo = tree.get("grpo")
    if isinstance(grpo, dict):
        refused.extend(_translate_grpo(grpo))
    for section in ("policy", "value"):  # PPO's critic (value) is a policy block: the same spellings
        block = tree.get(section)
        if isinstance(block, dict):
            warnings.extend(_translate_policy(section, block))
    checkpointing = tree.get("checkpointing")
    if isinstance(checkpointing, dict) and isinstance(checkpointing.get("metric_name"), str):
        name = checkpointing["metric_name"]
        if name.startswith("val:"):  # NeMo RL: "val:accuracy"; novarl's summary: val_accuracy
            checkpointing["metric_name"] = "val_" + name.removeprefix("val:")
    data = tree.get("data")
    if isinstance(data, dict) and any(k in data for k in ("train", "validation", "default")):
        seed = tree["grpo"].get("seed", 42) if isinstance(tree.get("grpo"), dict) else 42
        refused.extend(_flatten_data(data, warnings, seed))
    refused.extend(_environments(tree, warnings))
    return refused, warnings


def _translate_grpo(grpo: dict[str, Any]) -> list[str]:
    """The grpo section's spellings, rewritten in place; what is refused, a line each."""
    refused = []
    if grpo.get("async_grpo", False) is None:
        grpo["async_grpo"] = {}
    if grpo.get("val_period") == -1 and grpo["val_period"] is not True:
        grpo["val_period"] = 0  # NeMo RL: -1 turns periodic evaluation off; novarl: 0
    if "advantage_estimator" in grpo:  # novarl's own name before NeMo RL's (checkpoints keep their config)
        name = grpo.pop("advantage_estimator")
        if isinstance(grpo.get("adv_estimator"), dict) and "name" in grpo["adv_estimator"]:
            refused.append(f"'grpo.advantage_estimator' = {show_value(name)} and grpo.adv_estimator.name name "
                           "the same setting; give only grpo.adv_estimator.name.")
        elif isinstance(grpo.get("adv_estimator", {}), dict):
            grpo["adv_estimator"] = {**grpo.get("adv_estimator", {}), "name": name}
    estimator = grpo.get("adv_estimator")
    if isinstance(estimator, dict):
        for key in ("normalize_rewards", "use_leave_one_out_baseline"):
            if key in estimator:  # NeMo RL reads the estimator's copy (by default ${grpo.<key>})
                grpo[key] = estimator.pop(key)
        if not estimator:
            grpo.pop("adv_estimator")
    return refused


def _translate_policy(section: str, block: dict[str, Any]) -> list[str]:
    """A policy-like section's (policy, value) spellings, rewritten in place; the warnings, a line each."""
    warnings = []
    optimizer = block.get("optimizer")
    if isinstance(optimizer, dict) and isinstance(optimizer.get("name"), str) \
            and optimizer["name"] in OPTIMIZER_SYNONYMS:
        warnings.append(f"{section}.optimizer.name='{optimizer['name']}' runs as "
                        f"{OPTIMIZER_SYNONYMS[optimizer['name']]} (the same update, not fused)")
        optimizer["name"] = OPTIMIZER_SYNONYMS[optimizer["name"]]
    megatron = block.get("megatron_cfg")
    if isinstance(megatron, dict) and megatron.get("moe_token_dispatcher_type") == "flex":
        warnings.append(f"{section}.megatron_cfg.moe_token_dispatcher_type='flex' (DeepEP) runs as 'alltoall' "
                        "(the same routing, without DeepEP's kernels)")
        megatron["moe_token_dispatcher_type"] = "alltoall"
    packing = block.get("sequence_packing")
    if isinstance(packing, dict) and packing.get("algorithm") == "modified_ffd":
        packing["algorithm"] = "modified_first_fit_decreasing"
    return warnings


def _flatten_data(data: dict[str, Any], warnings: list[str], grpo_seed: Any) -> list[str]:
    """NeMo RL's data.train / data.validation / data.default blocks as novarl's flat data keys."""
    train, validation, default = data.pop("train", None), data.pop("validation", None), data.pop("default", None)
    if isinstance(train, list) or isinstance(validation, list):
        return _dataset_lists(data, train, validation, default, warnings, grpo_seed)
    blocks = {"data.train": train, "data.validation": validation, "data.default": default}
    bad = [f"'{k}' = {show_value(v)}: a dataset block is a mapping of dataset_name, data_path, input_key, ..."
           for k, v in blocks.items() if v is not None and not isinstance(v, dict)]
    if bad:
        return bad
    train, validation, default = train or {}, validation or {}, default or {}
    refused: list[str] = []

    def pick(key: str) -> Any:
        return train.get(key, default.get(key))

    # A flat key given beside the blocks (a command-line override: data.dataset_name=...) wins.
    for key, name in DATA_FIELDS.items():
        if pick(key) is not None:
            data.setdefault(name, pick(key))
        own = validation.get(key)
        if key not in ("dataset_name", "split_validation_size") and own is not None and own != pick(key):
            refused.append(f"'data.validation.{key}' = {show_value(own)} differs from the training data's "
                           f"{show_value(pick(key))}: novarl reads both splits with one {key}.")
    if train.get("data_path") is not None:
        data.setdefault("train_data_path", train["data_path"])
    if validation.get("data_path") is not None:
        data.setdefault("val_data_path", validation["data_path"])
    if train.get("split") is not None:
        data.setdefault("train_split", train["split"])
    if validation.get("split") is not None:
        data.setdefault("val_split", validation["split"])
    val_name = validation.get("dataset_name")
    if val_name is not None and val_name != data.get("dataset_name") and val_name != "ResponseDataset":
        data.setdefault("val_dataset_name", val_name)
    subsets = {v.get("subset", default.get("subset")) for v in (train, validation) if v}
    subsets.discard(None)
    if len(subsets) > 1:
        refused.append(f"'data.validation.subset' = {show_value(validation.get('subset'))} differs from the training "
                       f"data's {show_value(pick('subset'))}: novarl reads both splits with one subset.")
    elif subsets:
        data.setdefault("subset", subsets.pop())
    for block, values in (("data.train", train), ("data.validation", validation), ("data.default", default)):
        refused.extend(_data_block(block, values, data, warnings, grpo_seed))
    return refused


def _data_block(block: str, values: dict[str, Any], data: dict[str, Any], warnings: list[str],
                grpo_seed: Any) -> list[str]:
    """One data block's processor, environment, seed, repeat and unknown keys: what is refused, a line
    each (its environment goes to data._env_names)."""
    refused = []
    processor = values.get("processor")
    if processor not in PROCESSORS:
        refused.append(f"'{block}.processor' = {show_value(processor)}: novarl formats prompts as "
                       f"{PROCESSORS[1]} does (prompt file, then chat template); other processors are "
                       f"{ISSUE_DATA}.")
    env = values.get("env_name")
    if env is not None:
        data.setdefault("_env_names", set()).add(env)
    if values.get("seed") not in (None, grpo_seed):
        warnings.append(f"'{block}.seed' = {show_value(values['seed'])}: novarl draws the held-out split with "
                        f"grpo.seed ({show_value(grpo_seed)})")
    if values.get("repeat", 1) != 1 and block == "data.validation":
        warnings.append(f"'{block}.repeat' = {show_value(values['repeat'])}: novarl evaluates greedily, so "
                        "repeated examples would get the same completion; each is evaluated once")
    elif values.get("repeat", 1) != 1:
        refused.append(f"'{block}.repeat' = {show_value(values['repeat'])}: repeating a training dataset is "
                       f"{ISSUE_DATA}.")
    unknown = set(values) - {*DATA_FIELDS, "data_path", "split", "subset", "processor", "env_name", "seed", "repeat"}
    refused.extend(f"unknown key '{block}.{k}'." for k in sorted(unknown))
    return refused


BLOCK_KEYS = {"train": ("dataset_name", "data_path", "input_key", "output_key", "subset", "split",
                        "split_validation_size"),
              "validation": ("dataset_name", "data_path", "input_key", "output_key", "subset", "split", "repeat")}
"""What novarl's data.train / data.validation list blocks hold (config/sections/data.py DatasetBlock)."""


def _dataset_lists(data: dict[str, Any], train: Any, validation: Any, default: Any, warnings: list[str],
                   grpo_seed: Any) -> list[str]:
    """NeMo RL's list form (several datasets): data.default's keys under each block, as NeMo RL
    merges them; the prompt files, processor and environment are one for all datasets in novarl."""
    from novarl.config.named_datasets import NAMED_DATASETS

    default = default if isinstance(default, dict) else {}
    refused: list[str] = []
    for key in ("input_key", "output_key", "prompt_file", "system_prompt_file"):
        if default.get(key) is not None:
            data.setdefault(key, default[key])
    for role, value in (("train", train), ("validation", validation)):
        if value is None:
            continue
        blocks = value if isinstance(value, list) else [value]
        out = []
        for i, block in enumerate(blocks):
            where = f"data.{role}[{i}]"
            if not isinstance(block, dict):
                refused.append(f"'{where}' = {show_value(block)}: a dataset block is a mapping of dataset_name, "
                               "data_path, input_key, ...")
                continue
            merged = {**default, **block}
            if merged.get("dataset_name") in NAMED_DATASETS:  # NeMo RL's named datasets read their own fields
                merged = {k: v for k, v in merged.items() if k not in ("input_key", "output_key") or k in block}
            for key in ("prompt_file", "system_prompt_file"):
                if merged.get(key) != data.get(key):
                    refused.append(f"'{where}.{key}' = {show_value(merged.get(key))} differs from data.default's "
                                   f"{show_value(data.get(key))}: novarl reads every dataset with one {key}.")
            if merged.get("processor") not in PROCESSORS:
                refused.append(f"'{where}.processor' = {show_value(merged['processor'])}: novarl formats prompts as "
                               f"{PROCESSORS[1]} does; other processors are {ISSUE_DATA}.")
            if merged.get("env_name") is not None:
                data.setdefault("_env_names", set()).add(merged["env_name"])
            if merged.get("seed") not in (None, grpo_seed):
                warnings.append(f"'{where}.seed' = {show_value(merged['seed'])}: novarl draws the held-out split "
                                f"with grpo.seed ({show_value(grpo_seed)})")
            unknown = set(merged) - {*BLOCK_KEYS[role], "processor", "env_name", "seed", "prompt_file",
                                     "system_prompt_file", *(("repeat",) if role == "train" else ())}
            refused.extend(f"unknown key '{where}.{k}'." for k in sorted(unknown))
            if role == "train" and merged.get("repeat", 1) != 1:
                refused.append(f"'{where}.repeat' = {show_value(merged['repeat'])}: repeating a training dataset is "
                               f"{ISSUE_DATA}.")
            out.append({k: v for k, v in merged.items() if v is not None and (
                k in BLOCK_KEYS[role] or (k == "env_name" and v not in MATH_ENVIRONMENTS))})  # math: the default
        data.setdefault(role, out)
    return refused


NEMO_RL_ENVIRONMENTS = ("math", "math_default", "math_multi_reward", "dapo", "code", "code_jaccard", "reward_model",
                        "vlm", "nemo_gym", "sliding_puzzle_game", "clevr-cogent", "geometry3k", "refcoco", "mmpr-tiny",
                        "should_use_nemo_gym", "should_log_nemo_gym_responses")
"""The names under `env` that NeMo RL's code registers or its example configs use (NVIDIA-NeMo/RL
at 7ea279a: environments/utils.py ENV_REGISTRY, examples/configs): any other is refused as a
misspelling."""


MATH_ENVIRONMENTS = ("math", "math_default")
"""NeMo RL's math environment under both names its ENV_REGISTRY gives it (environments/utils.py:
each runs MathEnvironment on its own block)."""


def _environments(tree: dict[str, Any], warnings: list[str]) -> list[str]:
    """NeMo RL's environments: novarl scores with reward.function. The math environment (env.math
    or env.math_default) is reward.function 'math_verify' (said once in a warning); NeMo RL's
    others are not built; a name NeMo RL does not have is refused, with the closest one it does."""
    import difflib

    data = tree.get("data") if isinstance(tree.get("data"), dict) else {}
    used = data.pop("_env_names", set()) if data else set()
    reward = tree.get("reward") if isinstance(tree.get("reward"), dict) else {}
    domains = reward.get("domains")
    used -= set(domains) if isinstance(domains, dict) else set()  # novarl's reward domains, named by env_name
    env = tree.get("env")
    if not isinstance(env, dict):
        return []
    refused = []
    for name in list(env):
        if name in BUILT_IN_ENVIRONMENTS and isinstance(env[name], dict):
            env[name].setdefault("actor_class_fqn", BUILT_IN_ENVIRONMENTS[name])  # novarl's own game
        if name in MATH_ENVIRONMENTS or (isinstance(env[name], dict) and {"actor_class_fqn", "agent"} & set(env[name])):
            continue  # math is reward.function math_verify; a class (novarl's or the user's) plays episodes
        block = env.pop(name)
        if name == "reward_model" and isinstance(block, dict) and name in used:
            refused.extend(_reward_model_environment(tree, block, warnings))
        elif name not in NEMO_RL_ENVIRONMENTS:
            close = difflib.get_close_matches(name, NEMO_RL_ENVIRONMENTS, n=1, cutoff=0.6)
            refused.append(f"unknown key 'env.{name}'" + (f" (did you mean '{close[0]}'?)" if close else "")
                           + ": env holds NeMo RL's environments (math is built: reward.function math_verify) "
                           "and yours, each naming its class in env.<name>.actor_class_fqn; novarl scores "
                           "completions with reward.function otherwise.")
        elif name in used:
            refused.append(f"'env.{name}': NeMo RL's '{name}' environment is not built; novarl scores completions "
                           "with reward.function.")
        elif isinstance(block, dict) and block.get("enabled", False):
            refused.append(f"'env.{name}.enabled' = true: NeMo RL's '{name}' environment is not built.")
        else:
            warnings.append(f"env.{name}: NeMo RL's '{name}' environment is not built; the block is not used "
                            "(novarl scores completions with reward.function)")
    math = {name: env[name] for name in MATH_ENVIRONMENTS if name in env}
    if math:
        refused.extend(_math_environment(tree, math, warnings))
    return refused


REWARD_MODEL_KEYS = {"model_name": "model_name", "precision": "precision", "batch_size": "batch_size",
                     "max_model_len": "max_model_len"}
REWARD_MODEL_UNUSED = ("processor", "offload_optimizer_for_logprob", "dtensor_cfg", "dynamic_batching",
                       "sequence_packing", "max_grad_norm", "enabled")


def _reward_model_environment(tree: dict[str, Any], block: dict[str, Any], warnings: list[str]) -> list[str]:
    """NeMo RL's reward-model environment, named by the data's env_name: reward.reward_model's
    settings, scored by the registered reward 'reward_model' (the run's reward.function, or the
    domain of the datasets that name it)."""
    refused = []
    kind = (block.get("reward_model_cfg") or {}).get("reward_model_type", "bradley_terry")
    if kind != "bradley_terry" or (block.get("reward_model_cfg") or {}).get("enabled") is False:
        refused.append(f"'env.reward_model.reward_model_cfg' = {show_value(block.get('reward_model_cfg'))}: a "
                       "Bradley-Terry reward model (enabled, reward_model_type: bradley_terry) is what is built.")
    if block.get("checkpoint_path") is not None:
        refused.append(f"'env.reward_model.checkpoint_path' = {show_value(block['checkpoint_path'])}: give the reward "
                       "model's Hugging Face folder in env.reward_model.model_name.")
    settings = {ours: block[theirs] for theirs, ours in REWARD_MODEL_KEYS.items() if block.get(theirs) is not None}
    resources = block.get("resources")
    if isinstance(resources, dict):
        settings["resources"] = {k: resources[k] for k in ("gpus_per_node", "num_nodes") if resources.get(k)}
    tokenizer = (block.get("tokenizer") or {}).get("name")
    if tokenizer not in (None, block.get("model_name")):
        settings["tokenizer_name"] = tokenizer
    reward = tree.setdefault("reward", {})
    reward.setdefault("reward_model", {}).update(settings)
    data = tree.get("data") if isinstance(tree.get("data"), dict) else {}
    if any(isinstance(b, dict) and b.get("env_name") == "reward_model" for b in data.get("train") or []):
        reward.setdefault("domains", {}).setdefault("reward_model", {"function": "reward_model"})
    else:
        reward.setdefault("function", "reward_model")
    unused = [k for k in REWARD_MODEL_UNUSED if k in block]
    if unused:
        warnings.append(f"env.reward_model: {', '.join(unused)} not used (novarl scores with the reward model on "
                        "env.reward_model.resources, a Ray actor of its own, or in the driver's process without them)")
    return refused


def _math_environment(tree: dict[str, Any], blocks: dict[str, Any], warnings: list[str]) -> list[str]:
    """NeMo RL's math environment (`blocks`: its block under each name given) scores with
    math-verify (hf_math_verify): novarl's reward function 'math_verify', unless the config names
    a reward function of its own."""
    blocks = {name: block if isinstance(block, dict) else {} for name, block in blocks.items()}
    refused = []
    for name, block in blocks.items():
        impl = block.get("math_verify_impl", "hf_math_verify")
        if impl not in (None, "hf_math_verify"):
            what = "DAPO's answer checker" if impl == "dapo_math_verify" else "that checker"
            refused.append(f"'env.{name}.math_verify_impl' = {show_value(impl)}: {what} is not built; "
                           "'hf_math_verify' (reward.function: math_verify) is.")
    if refused:
        return refused
    reward = tree.setdefault("reward", {}) if isinstance(tree.get("reward", {}), dict) else {}
    given = " and ".join(f"env.{name}" for name in blocks)
    counts = [(f"env.{name}." if len(blocks) > 1 else "") + f"num_workers={block['num_workers']}"
              for name, block in blocks.items() if block.get("num_workers", 1) != 1]
    workers = (f"; {' and '.join(counts)} {'is' if len(counts) == 1 else 'are'} not used (the reward runs in the "
               "driver)" if counts else "")
    if "function" in reward:
        warnings.append(f"{given} {'is' if len(blocks) == 1 else 'are'} not used: reward.function="
                        f"{show_value(reward['function'])} scores the completions")
    else:
        reward["function"] = "math_verify"
        warnings.append(f"{given}: completions are scored by reward.function='math_verify' (math-verify, as NeMo "
                        f"RL's hf_math_verify){workers}")
    return []


VALUE_NOTES: dict[tuple[str, Any], str] = {
    ("policy.generation.backend", "sglang"): "SGLang generation is not built in novarl; use 'vllm', 'hf' or 'megatron'",
    ("policy.generation.backend", "trtllm"): "TensorRT-LLM generation is not built in novarl; use 'vllm', 'hf' or "
                                             "'megatron'",
    ("policy.generation.backend", "dynamo"): "Dynamo generation is not built in novarl; use 'vllm', 'hf' or 'megatron'",
}
"""Values of keys novarl's schema holds that name a NeMo RL feature novarl does not build:
the refusal says so instead of listing the allowed values."""
