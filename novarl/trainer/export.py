"""Export a resumable checkpoint as a consolidated Hugging Face folder."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from novarl.config import load_config
from novarl.config.schema import CheckpointingConfig, LoraConfig
from novarl.errors import CheckpointLoadFailed, UserError
from novarl.trainer.checkpoint import CRITIC_DIR, POLICY_DIR, STATE_FILE, Checkpointer, check_checkpoint


def find_checkpoint(path: Path) -> Path:
    """`path` itself when it is a checkpoint (a step_N folder), else the newest good step_N in
    it (a checkpointing.checkpoint_dir; the others are reported and skipped). Either way its
    files have been checked against the manifest, checksums included: nothing of it has been
    unpickled yet, and what is loaded from it after is what was saved."""
    if not path.is_dir():
        raise UserError(f"'{path}' does not exist or is not a folder; give a checkpoint "
                        "(checkpoint_dir/step_N) or the checkpoint_dir holding them.")
    if path.name.startswith("step_") or (path / STATE_FILE).exists():
        problem = check_checkpoint(path, verify_checksums=True)
        if problem is not None:
            raise UserError(f"'{path}' is not a complete checkpoint ({problem}).")
        return path
    steps = sorted(path.glob("step_*"))
    if not steps:
        raise UserError(f"'{path}' holds no checkpoint (no step_N folder): give a step_N folder written by "
                        "checkpointing, or the checkpointing.checkpoint_dir holding them.")
    latest = Checkpointer(CheckpointingConfig(checkpoint_dir=str(path)), config_yaml="").latest(verify=True)
    if latest is None:
        found = "; ".join(f"{step.name}: {check_checkpoint(step)}" for step in steps)
        raise UserError(f"'{path}' holds no complete checkpoint ({found}).")
    return latest.path


def export_checkpoint(checkpoint: Path, output: Path, *, critic: bool = False) -> Path:
    """Load `checkpoint` (any number of ranks wrote it) on one rank and write `output`.
    `checkpoint` may be the checkpoint_dir: its newest complete step is exported. critic: PPO's
    critic instead of the policy, as a token-classification folder (models/critic.py).

    The checkpoint is verified first (sizes and checksums against its manifest). DTensor and
    Megatron checkpoints load with weights_only=True (DCP's `.metadata` pickle read through a
    restricted unpickler first); DeepSpeed's zero_to_fp32 unpickles without restriction, so its
    files are scanned for foreign globals first (checkpoint_files.check_deepspeed_pickles).
    The folder is written in the run's precision and checkpointing.model_save_format (see
    models.loading.export_format); a DTensor checkpoint's optimizer state is not read."""
    from novarl.backends.training.dtensor import DTensorPolicy
    from novarl.distributed.local import default_device, ensure_single_process_group
    from novarl.models.loading import export_format, load_tokenizer, resolve_model_path
    from novarl.trainer.api import save_atomically

    checkpoint = find_checkpoint(checkpoint)
    if output.exists() and any(output.iterdir()):
        raise UserError(f"'{output}' exists and is not empty; give a new folder.")
    cfg = load_config(checkpoint / "config.yaml")
    if critic:
        return _export_critic(checkpoint, cfg, output)
    model_path = resolve_model_path(cfg.policy.model_name)
    tokenizer = load_tokenizer(cfg.policy.tokenizer.name or model_path,
                               trust_remote_code=cfg.policy.trust_remote_code)
    fmt = export_format(cfg.policy.precision, cfg.checkpointing.model_save_format,
                        on_gpu=default_device().type == "cuda")
    if (checkpoint / POLICY_DIR / "deepspeed").is_dir():
        lora = cfg.policy.dtensor_cfg.lora_cfg
        return _export_deepspeed(checkpoint / POLICY_DIR, model_path, tokenizer, output, fmt,
                                 lora if lora.enabled else None, cfg.policy.trust_remote_code)
    if (checkpoint / POLICY_DIR / "megatron").is_dir():
        return _export_megatron(checkpoint / POLICY_DIR / "megatron", model_path, tokenizer, output, fmt)
    ensure_single_process_group()
    policy = DTensorPolicy(cfg.policy, model_path, default_device(), total_steps=1,
                           temperature=cfg.policy.generation.temperature)
    with loading(checkpoint):
        policy.load_weights(checkpoint / POLICY_DIR)  # the model's weights only, not the optimizer's state
    save_atomically(output, lambda tmp: policy.save_hf(tmp, tokenizer, fmt))
    return output


def _export_critic(checkpoint: Path, cfg, output: Path) -> Path:
    """PPO's critic of `checkpoint` (step_N/critic) as a Hugging Face token-classification folder."""
    from transformers import AutoConfig

    from novarl.backends.training.dtensor import DTensorCritic
    from novarl.distributed.local import default_device, ensure_single_process_group
    from novarl.models.critic import save_critic_hf
    from novarl.models.loading import export_format, load_tokenizer, resolve_model_path
    from novarl.trainer.api import save_atomically

    if cfg.value is None or not (checkpoint / CRITIC_DIR).is_dir():
        raise UserError(f"'{checkpoint}' holds no critic: its run had none (grpo.adv_estimator.name is not gae); "
                        "leave out --critic to export the policy.")
    value = cfg.value
    model_path = resolve_model_path(value.model_name)
    tokenizer = load_tokenizer(value.tokenizer.name or model_path, trust_remote_code=value.trust_remote_code)
    fmt = export_format(value.precision, cfg.checkpointing.model_save_format, on_gpu=default_device().type == "cuda")
    if (checkpoint / CRITIC_DIR / "megatron").is_dir():
        return _export_megatron(checkpoint / CRITIC_DIR / "megatron", model_path, tokenizer, output, fmt, critic=True)
    if (checkpoint / CRITIC_DIR / "deepspeed").is_dir():
        from novarl.backends.training.ops import deepspeed_environment

        deepspeed_environment()
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        with loading(checkpoint):
            state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint / CRITIC_DIR), tag="deepspeed")
        model_config = AutoConfig.from_pretrained(model_path)
        save_atomically(output, lambda tmp: save_critic_hf(tmp, model_config, state, tokenizer, fmt))
        return output
    ensure_single_process_group()
    model = DTensorCritic(value, model_path, default_device(), total_steps=1)
    with loading(checkpoint):
        model.load_weights(checkpoint / CRITIC_DIR)
    save_atomically(output, lambda tmp: model.save_hf(tmp, tokenizer, fmt))
    return output


@contextmanager
def loading(checkpoint: Path) -> Iterator[None]:
    """Turn a failure to read `checkpoint` (it passed the checks, yet torch or the backend refused it)
    into a UserError naming it."""
    try:
        yield
    except BaseException as err:  # torch.distributed.checkpoint's CheckpointException is a BaseException
        if isinstance(err, (KeyboardInterrupt, SystemExit, UserError)):
            raise
        reason = CheckpointLoadFailed(checkpoint, err).reason
        raise UserError(f"'{checkpoint}' could not be loaded ({reason}); it passed the manifest's "
                        "checks, so it was written so or this environment cannot read it (another torch "
                        "or backend version?).") from err


def _export_deepspeed(policy_dir: Path, model_path: str, tokenizer, output: Path, fmt,
                      lora: LoraConfig | None, trust_remote_code: bool) -> Path:
    """DeepSpeed's fp32 master weights, merged from every rank's partition offline (no
    process group, any number of ranks wrote them). A LoRA checkpoint holds the adapters alone:
    the frozen base comes from the model folder, and the folder holds the merged model."""
    from transformers import AutoConfig

    from novarl.backends.training.ops import deepspeed_environment
    from novarl.models.lora import save_hf
    from novarl.trainer.api import save_atomically

    deepspeed_environment()
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with loading(policy_dir.parent):
        state = get_fp32_state_dict_from_zero_checkpoint(str(policy_dir), tag="deepspeed")
    if lora is not None:
        state = {**_lora_base_state(model_path, lora, trust_remote_code), **state}
    model_config = AutoConfig.from_pretrained(model_path)
    save_atomically(output, lambda tmp: save_hf(tmp, model_config, state, tokenizer, fmt, lora))
    return output


def _lora_base_state(model_path: str, lora: LoraConfig, trust_remote_code: bool) -> dict:
    """The base model's tensors under the names they have with LoRA's layers in place."""
    import torch

    from novarl.models.loading import load_causal_lm
    from novarl.models.lora import inject

    model = load_causal_lm(model_path, dtype=torch.float32, trust_remote_code=trust_remote_code)
    inject(model, lora)
    return dict(model.state_dict())


def _export_megatron(folder: Path, model_path: str, tokenizer, output: Path, fmt, *, critic: bool = False) -> Path:
    """The Megatron model shards (every tensor-parallel rank of every pipeline stage, and every
    expert-parallel rank's experts), joined offline with the conversion's name mapping; no
    process group, no megatron-core. critic: PPO's critic, whose last stage holds a scalar head
    (the same on every tensor-parallel rank) where the output layer was."""
    import dataclasses
    import json

    import torch
    from transformers import AutoConfig

    from novarl.backends.megatron.convert import LayerShape, experts_file, join_expert_tensor_parts, shards_to_hf
    from novarl.models.loading import save_hf_folder
    from novarl.trainer.api import save_atomically

    with loading(folder.parent.parent):
        layout = json.loads((folder / "layout.json").read_text())
        tp, pp, ep, etp = (layout["parallel"].get(k, 1) for k in ("tp", "pp", "ep", "etp"))
        parts = [(t, p, torch.load(folder / f"model_tp{t}_pp{p}.pt", weights_only=True))
                 for t in range(tp) for p in range(pp)]
        experts = {}
        for e in range(ep if layout.get("experts") else 0):
            for p in range(pp):
                experts.update(join_expert_tensor_parts([
                    torch.load(folder / experts_file(e, p, r, etp), weights_only=True) for r in range(etp)]))
    model_config = AutoConfig.from_pretrained(model_path)
    shape = LayerShape.from_hf_config(model_config)
    head = {}
    if critic:
        head = {name.replace("output_layer.", "lm_head."): tensor for name, tensor in parts[pp - 1][2].items()
                if name.startswith("output_layer.")}  # (tp 0, the last stage)
        parts = [(t, p, {n: x for n, x in state.items() if not n.startswith("output_layer.")}) for t, p, state in parts]
        shape = dataclasses.replace(shape, tied=True)  # no vocabulary head to join: the scalar one replaces it
    state = {**shards_to_hf(parts, shape, tensor_parallel_size=tp, fused_norms=layout["fused_norms"],
                            experts=experts), **head}
    if critic:
        from novarl.models.critic import save_critic_hf

        save_atomically(output, lambda tmp: save_critic_hf(tmp, model_config, state, tokenizer, fmt))
    else:
        save_atomically(output, lambda tmp: save_hf_folder(tmp, model_config, state, tokenizer, fmt))
    return output
