"""NeMo RL's keys that novarl's schema does not hold, and what novarl does with each.

The contract follows NeMo RL at commit 7ea279a (NVIDIA-NeMo/RL, 2026-08-22): its
`examples/configs/grpo_*.yaml` and `examples/configs/recipes/llm/grpo-*.yaml`, and the
September-2025 files before them. Every key those files hold is either

- in novarl's schema (config/schema.py and config/sections/) and used there, or renamed to a key that is
  (`translate`: NeMo RL's `data.train` / `data.validation` / `data.default` blocks and `env` section
  (config/nemo_rl_data.py), the advantage estimator's copies of grpo's flags, `val_period: -1`);
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
from novarl.config.nemo_rl_data import ISSUE_DATA, environments, flatten_data

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

RULES: tuple[Rule, ...] = (
    # ---------------------------------------------------------------- grpo
    off("grpo.async_grpo.in_flight_weight_updates", _is(False),
        "in-flight weight updates (the engines taking new weights in the middle of a round) are not built: novarl "
        "queues each step's weights behind the rounds the engines have, sent in the background without the trainer "
        "waiting for those rounds"),
    off("grpo.async_grpo.max_generation_failures", _is(0), f"tolerated generation failures are {ISSUE_ASYNC}"),
    off("grpo.async_grpo.recompute_kv_cache_after_weight_updates", _is(False),
        f"KV-cache recomputation is {ISSUE_ASYNC}"),
    *governed("data.num_prompts_per_dataloader", "data.custom_dataloader",
              "policy.megatron_cfg.optimizer.optimizer_offload_fraction",
              "policy.megatron_cfg.optimizer.overlap_cpu_optimizer_d2h_h2d", "policy.generation.sglang_cfg",
              "policy.generation.trtllm_cfg", "policy.generation.trtllm_kwargs", "policy.generation.dynamo_cfg",
              "policy.megatron_cfg.fused_linear_logprobs_chunk_size"),
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
    # ---------------------------------------------------------------- policy
    off("policy.draft", _disabled, "draft models (speculative decoding heads) are not built"),
    off("policy.router_replay", _disabled, "MoE router replay is not built"),
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
        refused.extend(flatten_data(data, warnings, seed))
    refused.extend(environments(tree, warnings))
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


VALUE_NOTES: dict[tuple[str, Any], str] = {
    ("policy.generation.backend", "sglang"): "SGLang generation is not built in novarl; use 'vllm', 'hf' or 'megatron'",
    ("policy.generation.backend", "trtllm"): "TensorRT-LLM generation is not built in novarl; use 'vllm', 'hf' or "
                                             "'megatron'",
    ("policy.generation.backend", "dynamo"): "Dynamo generation is not built in novarl; use 'vllm', 'hf' or 'megatron'",
}
"""Values of keys novarl's schema holds that name a NeMo RL feature novarl does not build:
the refusal says so instead of listing the allowed values."""
