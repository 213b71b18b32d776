"""A ROLL role's training side: its strategy (`megatron_train`, `fsdp2_train`, `deepspeed_train`)
and strategy_config as novarl's backend section, its model_args (dtype, LoRA), training_args (the
optimizer, schedule and batch) and data_args, and the role keys every role shares (dynamic
batching, operational keys). Used by config/roll.py for actor_train and the critic."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from novarl.config.roll_devices import Placement, Translation, _number


MEGATRON_KEYS_OPERATIONAL = ("bf16", "overlap_grad_reduce", "moe_shared_expert_overlap", "cross_entropy_loss_fusion",
                             "account_for_loss_in_pipeline_split", "account_for_embedding_in_pipeline_split",
                             "recompute_modules", "distrib_optim_fully_reshardable")


FSDP_KEYS = ("fsdp_size", "param_dtype", "reduce_dtype", "reshard_after_forward", "offload_policy",
             "use_batched_model_update", "wrap_policy")


FSDP_NOT_READ = {  # key: (the value novarl's DTensor backend behaves as, what it does)
    "reshard_after_forward": (True, "novarl's FSDP2 frees each layer's gathered weights after its forward"),
    "use_batched_model_update": (None, "novarl sends the weights to the engines in buckets of "
                                       "policy.generation.weight_sync_bucket_mb"),
    "wrap_policy": (None, "novarl shards each decoder layer, then the rest of the model"),
}


DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "bfloat16": "bfloat16", "float16": "float16",
          "float32": "float32"}


TRAIN_STRATEGIES = {"megatron_train": "megatron", "fsdp2_train": "dtensor", "deepspeed_train": "deepspeed"}


def strategy(block: Mapping[str, Any], role: str, known: Mapping[str, str], out: Translation
              ) -> tuple[Any, Mapping[str, Any], str | None]:
    """(strategy_name, strategy_config, novarl's backend for it or None, refused)."""
    strategy = block.get("strategy_args") or {}
    name, config = strategy.get("strategy_name"), strategy.get("strategy_config") or {}
    backend = known.get(name)
    if backend is None:
        out.refuse(f"{role}.strategy_args.strategy_name", name, f"novarl's {role} runs {', '.join(known)}")
    return name, config, backend


@dataclass(frozen=True)
class Training:
    """What actor_train became: what the reference and the critic run on."""

    strategy: str
    """ROLL's strategy_name (megatron_train, ...)."""
    backend: str
    """novarl's training backend (megatron, dtensor, deepspeed)."""
    sizes: Mapping[str, int]
    """Its parallel sizes (tp, pp, cp, ep), as the log shows them."""
    dtype: Any = None
    """actor_train.model_args.dtype."""

    def layout(self) -> str:
        return ", ".join(f"{k} {v}" for k, v in self.sizes.items()) or "data parallel"


SECTIONS = {"megatron": "megatron_cfg", "deepspeed": "deepspeed_cfg", "dtensor": "dtensor_cfg"}
"""novarl's training backend -> its config section under policy (ROLL's strategies map to the backends)."""


def trainer(block: Mapping[str, Any], role: str, config: Mapping[str, Any], training: str, out: Translation,
             placement: Placement | None) -> dict[str, int]:
    """A training role's strategy_config, model_args, training_args and infer_batch_size onto
    `policy` (the critic's are moved to `value` after); its parallel sizes."""
    sizes = {"megatron": _megatron, "dtensor": _fsdp2, "deepspeed": _deepspeed}[training](config, out, placement,
                                                                                         role)
    model = block.get("model_args") or {}
    model_args(model, role, out)
    checkpointing = not model.get("disable_gradient_checkpointing", False)
    section = SECTIONS[training]
    if checkpointing and not (training == "megatron" and config.get("recompute_granularity")):
        out.set(f"policy.{section}.activation_checkpointing", True)
    training_args(block.get("training_args") or {}, out, training, placement, sizes, role)
    if block.get("infer_batch_size"):
        out.set("policy.logprob_batch_size", block["infer_batch_size"])
    return sizes


def _megatron(config: Mapping[str, Any], out: Translation, placement: Placement | None,
              role: str = "actor_train") -> dict[str, int]:
    from novarl.config.loading import schema_has

    where = f"{role}.strategy_args.strategy_config."
    for key, value in config.items():
        if key in MEGATRON_KEYS_OPERATIONAL:
            if key == "overlap_grad_reduce":
                out.set("policy.megatron_cfg.overlap_grad_reduce", value)
            elif key == "bf16" and value:
                out.set("policy.precision", "bfloat16")
        elif key == "additional_configs":
            out.refuse(where + "additional_configs", value, "extra megatron-core arguments are not passed through")
        elif key == "moe_grouped_gemm" and value is True:  # a kernel choice: the same experts, the same maths
            out.set("policy.megatron_cfg.moe_grouped_gemm", False)
            out.warnings.append(f"{where}moe_grouped_gemm=true: novarl runs the experts as megatron-core's "
                                "SequentialMLP, one GEMM each (the same experts; its weight conversion does not "
                                "write the grouped-GEMM layout)")
        elif schema_has(f"policy.megatron_cfg.{key}"):
            out.set(f"policy.megatron_cfg.{key}", value)
        else:
            out.refused.append(f"unknown key '{where}{key}' (megatron_train): not a megatron_cfg setting novarl has.")
    return {"tp": config.get("tensor_model_parallel_size", 1), "pp": config.get("pipeline_model_parallel_size", 1),
            "cp": config.get("context_parallel_size", 1),
            **({"ep": config["expert_model_parallel_size"]} if config.get("expert_model_parallel_size", 1) > 1 else {})}


def _fsdp2(config: Mapping[str, Any], out: Translation, placement: Placement | None,
           role: str = "actor_train") -> dict[str, int]:
    where = f"{role}.strategy_args.strategy_config."
    for key, value in config.items():
        if key == "param_dtype":
            out.set("policy.precision", DTYPES.get(value, value))
        elif key == "reduce_dtype" and value not in ("float32", "fp32"):
            out.refuse(where + "reduce_dtype", value, "novarl reduces gradients in float32")
        elif key == "offload_policy":
            out.set("policy.dtensor_cfg.cpu_offload", bool(value))
        elif key == "fsdp_size" and placement is not None and value not in (len(placement.train), -1):
            out.refuse(where + "fsdp_size", value, f"novarl shards over every training rank ({len(placement.train)}); "
                                                   "hybrid sharding is not built")
        elif key in FSDP_NOT_READ and value != FSDP_NOT_READ[key][0]:
            out.warnings.append(f"{where}{key}={value!r}: accepted and not used ({FSDP_NOT_READ[key][1]})")
        elif key not in FSDP_KEYS:
            out.refused.append(f"unknown key '{where}{key}' (fsdp2_train): not a setting novarl's DTensor backend "
                               "has.")
    return {}


def _deepspeed(config: Mapping[str, Any], out: Translation, placement: Placement | None,
               role: str = "actor_train") -> dict[str, int]:
    zero = dict(config.get("zero_optimization") or {})
    if "stage" in zero:
        out.set("policy.deepspeed_cfg.zero_stage", zero.pop("stage"))
    for key, flag in (("offload_optimizer", "offload_optimizer"), ("offload_param", "offload_param")):
        device = (zero.get(key) or {}).get("device")
        if device is not None:
            out.set(f"policy.deepspeed_cfg.{flag}", device == "cpu")
    if config:
        out.set("policy.deepspeed_cfg.config", dict(config))
    return {}


def model_args(model: Mapping[str, Any], role: str, out: Translation) -> None:
    dtype = model.get("dtype")
    if dtype is not None:
        if dtype not in DTYPES:
            out.refuse(f"{role}.model_args.dtype", dtype, "novarl's precisions are bf16, fp16 and fp32")
        elif role in ("actor_train", "critic"):
            out.set("policy.precision", DTYPES[dtype])
    _lora(model, role, out)
    if model.get("ulysses_size", 1) not in (1, None):
        out.refuse(f"{role}.model_args.ulysses_size", model["ulysses_size"], "sequence parallelism over attention "
                                                                             "heads (Ulysses) is not built")
    if model.get("freeze_module_prefix"):
        out.refuse(f"{role}.model_args.freeze_module_prefix", model["freeze_module_prefix"],
                   "freezing parts of the model is not built")


def _lora(model: Mapping[str, Any], role: str, out: Translation) -> None:
    """ROLL's LoRA (model_args: on when lora_target is set; lora_rank 8, lora_alpha 2 x rank and
    lora_dropout 0 by default; targets a comma list, or `all` for every linear layer) onto
    policy.dtensor_cfg.lora_cfg."""
    where = f"{role}.model_args."
    for key in ("adapter_name_or_path", "additional_target"):
        if model.get(key):
            out.refuse(where + key, model[key], "starting from a saved adapter and training modules beside LoRA's "
                                               "are not built")
    target = model.get("lora_target")
    if target is None:
        return
    if not isinstance(target, str) or any(c in target for c in "*$|("):
        out.refuse(where + "lora_target", target, "give module names separated by commas, or 'all' (a regular "
                                                  "expression is not read)")
        return
    names = [name.strip() for name in target.split(",") if name.strip()]
    lora = "policy.dtensor_cfg.lora_cfg."
    out.set(lora + "enabled", True)
    out.set(lora + "use_triton", False)
    out.set(lora + "match_all_linear", names in (["all"], ["all-linear"]))
    if names not in (["all"], ["all-linear"]):
        out.set(lora + "target_modules", names)
    rank = _number(model, "lora_rank", out, where, integer=True) or 8
    out.set(lora + "dim", rank)
    out.set(lora + "alpha", _number(model, "lora_alpha", out, where) or 2 * rank)
    dropout = _number(model, "lora_dropout", out, where, positive=False)
    if dropout:
        out.set(lora + "dropout", dropout)
        out.set(lora + "dropout_position", "pre")  # PEFT's (and ROLL's) LoRA drops the adapter's input


def training_args(args: Mapping[str, Any], out: Translation, training: str, placement: Placement | None,
                   sizes: Mapping[str, int], role: str = "actor_train") -> None:
    where = f"{role}.training_args."
    lr = _number(args, "learning_rate", out, where)
    decay = _number(args, "weight_decay", out, where, positive=False)
    micro, accumulation, warmup = (_number(args, k, out, where, integer=True) for k in (
        "per_device_train_batch_size", "gradient_accumulation_steps", "warmup_steps"))
    if training == "megatron":
        if lr is not None:
            out.set("policy.megatron_cfg.optimizer.lr", lr)
        if decay is not None:
            out.set("policy.megatron_cfg.optimizer.weight_decay", decay)
        if warmup:
            out.set("policy.megatron_cfg.scheduler.lr_warmup_iters", warmup)
    else:
        kwargs = {"lr": lr if lr is not None else 1e-6, "weight_decay": decay or 0.0, "betas": [0.9, 0.999],
                  "eps": 1e-8}
        out.set("policy.optimizer", {"name": "torch.optim.AdamW", "kwargs": kwargs})
        out.set("policy.scheduler", [] if not warmup else [
            {"name": "torch.optim.lr_scheduler.LinearLR", "kwargs": {"start_factor": 1e-3, "end_factor": 1.0,
                                                                     "total_iters": warmup}},
            {"name": "torch.optim.lr_scheduler.ConstantLR", "kwargs": {"factor": 1.0, "total_iters": 10**10}},
            {"milestones": [warmup]}])
    if micro:
        out.set("policy.train_micro_batch_size", micro)
    if micro and accumulation and placement is not None:
        parallel = math.prod(v for k, v in sizes.items() if k in ("tp", "pp", "cp") and isinstance(v, int) and v > 0)
        out.set("policy.train_global_batch_size", micro * accumulation * max(len(placement.train) // parallel, 1))
    epochs = _number(args, "num_train_epochs", out, where, integer=True)
    if epochs:
        out.set("grpo.max_num_epochs", epochs)
    unknown = set(args) - {"learning_rate", "weight_decay", "warmup_steps", "per_device_train_batch_size",
                           "gradient_accumulation_steps", "num_train_epochs"}
    out.refused.extend(f"unknown key '{where}{k}'." for k in sorted(unknown))


def data_args(args: Mapping[str, Any], out: Translation) -> None:
    files = args.get("file_name")
    files = [files] if isinstance(files, str) else list(files or [])
    mixing = args.get("domain_interleave_probs")
    if args.get("interleave_probs") not in (None, 1, 1.0, "1", "1.0"):  # one file's: neutral
        out.refuse("actor_train.data_args.interleave_probs", args["interleave_probs"],
                   "sampling the files by probability is not built; domain_interleave_probs samples the domains")
    if mixing:
        out.set("data.domain_interleave_probs", dict(mixing))
    if len(files) > 1:
        out.set("data.train", [{"data_path": f} for f in files])
    elif files:
        out.set("data.train_data_path", files[0])
    if args.get("messages"):  # ROLL's rows: chat messages in this field, the answer in ground_truth
        out.set("data.input_key", args["messages"])
        out.set("data.output_key", "ground_truth")
    if args.get("template"):
        out.warnings.append(f"actor_train.data_args.template={args['template']!r}: novarl applies the tokenizer's own "
                            "chat template")
    unknown = set(args) - {"file_name", "messages", "template", "dataset_dir", "preprocessing_num_workers",
                           "interleave_probs", "domain_interleave_probs"}
    out.refused.extend(f"unknown key 'actor_train.data_args.{k}'." for k in sorted(unknown))


BATCHING = {"use_dynamic_batching_in_train": "policy.dynamic_batching.enabled",
            "max_tokens_per_microbatch_in_train": "policy.dynamic_batching.train_mb_tokens",
            "max_tokens_per_microbatch_in_infer": "policy.dynamic_batching.logprob_mb_tokens",
            "sequence_length_round_in_train": "policy.dynamic_batching.sequence_length_round",
            "use_sequence_packing": "policy.sequence_packing.enabled"}
"""ROLL's per-role micro-batching keys (actor_train's) and novarl's."""


ROLE_OPERATIONAL = ("offload_nccl", "num_gpus_per_worker", "use_remove_padding", "use_dynamic_batching_in_infer",
                    "sequence_length_round_in_infer", "system_envs", "backend_timeout", "max_concurrency",
                    "model_update_frequency")


def role_extras(block: Mapping[str, Any], role: str, out: Translation, known: tuple[str, ...]) -> None:
    for key, value in block.items():
        if key in known or key in ROLE_OPERATIONAL:
            continue
        if role == "actor_train" and key in BATCHING:
            out.set(BATCHING[key], value)
            continue
        if role == "actor_train" and key == "sequence_packing_args":
            continue  # ROLL's packer settings: novarl packs with its own (policy.sequence_packing)
        out.refused.append(f"unknown key '{role}.{key}' (a ROLL role setting novarl does not map).")
