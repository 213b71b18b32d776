"""Export a resumable checkpoint as a consolidated Hugging Face folder."""

from __future__ import annotations

from pathlib import Path

from novarl.config import load_config
from novarl.config.schema import CheckpointingConfig
from novarl.errors import UserError
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
    files are scanned for foreign globals first (deepspeed_checkpoint.check_deepspeed_pickles).
    The folder is written in the run's precision and checkpointing.model_save_format (see
    models.loading.export_format); a DTensor checkpoint's optimizer state is not read."""
    from novarl.backends.registry import trains_on
    from novarl.backends.spec import HfExport
    from novarl.distributed.local import default_device
    from novarl.models.loading import export_format, load_tokenizer, resolve_model_path
    from novarl.trainer.api import save_atomically

    checkpoint = find_checkpoint(checkpoint)
    if output.exists() and any(output.iterdir()):
        raise UserError(f"'{output}' exists and is not empty; give a new folder.")
    cfg = load_config(checkpoint / "config.yaml")
    section = cfg.value if critic else cfg.policy
    if section is None or (critic and not (checkpoint / CRITIC_DIR).is_dir()):
        raise UserError(f"'{checkpoint}' holds no critic: its run had none (grpo.adv_estimator.name is not gae); "
                        "leave out --critic to export the policy.")
    model_path = resolve_model_path(section.model_name)
    if section.hf_config_overrides:  # the run's model, as its roles read it
        from novarl.models.config_overrides import with_overrides

        model_path = with_overrides(model_path, section.hf_config_overrides,
                                    key=f"{'value' if critic else 'policy'}.hf_config_overrides")
    tokenizer = load_tokenizer(section.tokenizer.name or model_path, trust_remote_code=section.trust_remote_code)
    fmt = export_format(section.precision, cfg.checkpointing.model_save_format, on_gpu=default_device().type == "cuda")
    trains_on(cfg).export_hf(HfExport(checkpoint / (CRITIC_DIR if critic else POLICY_DIR), section, model_path,
                                      tokenizer, output, fmt, critic, save_atomically))
    return output
