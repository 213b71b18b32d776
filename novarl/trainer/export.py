"""Export a resumable checkpoint as a consolidated Hugging Face folder."""

from __future__ import annotations

from pathlib import Path

from novarl.config import load_config
from novarl.errors import UserError
from novarl.trainer.checkpoint import POLICY_DIR, check_checkpoint


def export_checkpoint(checkpoint: Path, output: Path) -> Path:
    """Load `checkpoint` (any number of ranks wrote it) on one rank and write `output`."""
    from novarl.backends.training.dtensor import DTensorPolicy
    from novarl.distributed.local import default_device, ensure_single_process_group
    from novarl.models.loading import load_tokenizer, resolve_model_path
    from novarl.trainer.api import save_atomically

    problem = check_checkpoint(checkpoint)
    if problem is not None:
        raise UserError(f"'{checkpoint}' is not a complete checkpoint ({problem}).")
    if output.exists() and any(output.iterdir()):
        raise UserError(f"'{output}' exists and is not empty; give a new folder.")
    cfg = load_config(checkpoint / "config.yaml")
    model_path = resolve_model_path(cfg.policy.model_name)
    ensure_single_process_group()
    policy = DTensorPolicy(cfg.policy, model_path, default_device(), total_steps=1,
                           temperature=cfg.policy.generation.temperature)
    policy.load(checkpoint / POLICY_DIR)
    tokenizer = load_tokenizer(cfg.policy.tokenizer.name or model_path,
                               trust_remote_code=cfg.policy.trust_remote_code)
    save_atomically(output, lambda tmp: policy.save_hf(tmp, tokenizer))
    return output
