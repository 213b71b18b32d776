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
    tokenizer = load_tokenizer(cfg.policy.tokenizer.name or model_path,
                               trust_remote_code=cfg.policy.trust_remote_code)
    if (checkpoint / POLICY_DIR / "deepspeed").is_dir():
        return _export_deepspeed(checkpoint / POLICY_DIR, model_path, tokenizer, output)
    ensure_single_process_group()
    policy = DTensorPolicy(cfg.policy, model_path, default_device(), total_steps=1,
                           temperature=cfg.policy.generation.temperature)
    policy.load(checkpoint / POLICY_DIR)
    save_atomically(output, lambda tmp: policy.save_hf(tmp, tokenizer))
    return output


def _export_deepspeed(policy_dir: Path, model_path: str, tokenizer, output: Path) -> Path:
    """DeepSpeed's fp32 master weights, merged from every rank's partition offline (no
    process group, any number of ranks wrote them)."""
    from transformers import AutoConfig

    from novarl.backends.training.ops import deepspeed_environment
    from novarl.models.loading import save_hf_folder
    from novarl.trainer.api import save_atomically

    deepspeed_environment()
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(str(policy_dir), tag="deepspeed")
    model_config = AutoConfig.from_pretrained(model_path)
    save_atomically(output, lambda tmp: save_hf_folder(tmp, model_config, state, tokenizer))
    return output
