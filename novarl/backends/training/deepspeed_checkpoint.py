"""The DeepSpeed backend's checkpoints (its engine's own files under <role>/deepspeed): their files
checked, and a role exported as a Hugging Face folder from the fp32 master weights, merged from
every rank's partition offline (no process group; any number of ranks wrote them). DeepSpeed
unpickles its files with weights_only=False, so `check_deepspeed_pickles` scans them first."""

from __future__ import annotations

from pathlib import Path

import torch

from novarl.backends.spec import HfExport
from novarl.config.schema import LoraConfig
from novarl.errors import loading_checkpoint

CHECKPOINT_TAG = "deepspeed"
"""The engine's checkpoint tag: its folder in the role's."""


def files_problem(folder: Path, role: str, *, verify: bool) -> str | None:
    engine = folder / CHECKPOINT_TAG
    if not any(engine.glob("*model_states.pt")) or not any(engine.glob("*optim_states.pt")):
        return "DeepSpeed engine state missing"
    return check_deepspeed_pickles(engine) if verify else None


def export_hf(export: HfExport) -> None:
    """The role's fp32 weights. A LoRA checkpoint holds the adapters alone: the frozen base comes from
    the model folder, and the folder holds the merged model. A critic's is a token-classification folder."""
    from transformers import AutoConfig

    from novarl.backends.training.ops import deepspeed_environment

    deepspeed_environment()
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with loading_checkpoint(export.folder.parent):
        state = get_fp32_state_dict_from_zero_checkpoint(str(export.folder), tag=CHECKPOINT_TAG)
    model_config = AutoConfig.from_pretrained(export.model_path)
    if export.critic:
        from novarl.models.critic import save_critic_hf

        export.save(export.output, lambda tmp: save_critic_hf(tmp, model_config, state, export.tokenizer, export.fmt))
        return
    from novarl.models.lora import save_hf

    lora = export.section.dtensor_cfg.lora_cfg if export.section.dtensor_cfg.lora_cfg.enabled else None
    if lora is not None:
        state = {**lora_base_state(export.model_path, lora, export.section.trust_remote_code), **state}
    export.save(export.output, lambda tmp: save_hf(tmp, model_config, state, export.tokenizer, export.fmt, lora))


def lora_base_state(model_path: str, lora: LoraConfig, trust_remote_code: bool) -> dict:
    """The base model's tensors under the names they have with LoRA's layers in place."""
    from novarl.models.loading import load_causal_lm
    from novarl.models.lora import inject

    model = load_causal_lm(model_path, dtype=torch.float32, trust_remote_code=trust_remote_code)
    inject(model, lora)
    return dict(model.state_dict())


def check_deepspeed_pickles(engine: Path) -> str | None:
    """None if every DeepSpeed file in `engine` refers to nothing beyond what weights_only admits
    and DeepSpeed's own dataclasses, enums and loss scalers (found without unpickling them), else
    what else it refers to. DeepSpeed unpickles its files with weights_only=False: check them first."""
    import dataclasses
    import enum
    import importlib

    from novarl.backends.training.ops import deepspeed_environment

    def harmless(name: str) -> bool:
        module, _, attr = name.rpartition(".")
        if not module.startswith("deepspeed.") or not attr.isidentifier() or attr.startswith("_"):
            return False
        deepspeed_environment()
        found = getattr(importlib.import_module(module), attr, None)
        return isinstance(found, type) and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum)
                                            or module == "deepspeed.runtime.fp16.loss_scaler")

    for file in sorted(engine.glob("*.pt")):
        try:
            refused = [g for g in torch.serialization.get_unsafe_globals_in_checkpoint(file) if not harmless(g)]
        except Exception as err:  # not torch's zip format, a damaged archive, no such module
            return f"{file.name} unreadable: {type(err).__name__}: {err}"
        if refused:
            return f"{file.name} refers to {refused[0]}, which DeepSpeed's checkpoints never hold"
    return None
