"""The DTensor backend's checkpoints (torch.distributed.checkpoint, DCP): their files checked, and a
role exported as a Hugging Face folder. DCP unpickles its `.metadata` with no restriction, so
`check_dcp_metadata` reads it through a restricted unpickler before anything loads it."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch

from novarl.backends.spec import HfExport
from novarl.errors import loading_checkpoint


def files_problem(folder: Path, role: str, *, verify: bool) -> str | None:
    """What is wrong with a role's DCP shards and scheduler state in `folder`, or None."""
    if not (folder / ".metadata").is_file() or not any(folder.glob("*.distcp")):
        return f"{role} shards missing"
    if not (folder / "scheduler.pt").is_file():
        return "scheduler state missing"
    return check_dcp_metadata(folder / ".metadata") if verify else None


def export_hf(export: HfExport) -> None:
    """Load the role's weights on one rank in this process (no optimizer state) and write the folder."""
    from novarl.backends.training.dtensor import DTensorCritic, DTensorPolicy
    from novarl.distributed.local import default_device, ensure_single_process_group

    ensure_single_process_group()
    if export.critic:
        model: Any = DTensorCritic(export.section, export.model_path, default_device(), total_steps=1)
    else:
        model = DTensorPolicy(export.section, export.model_path, default_device(), total_steps=1)
    with loading_checkpoint(export.folder.parent):
        model.load_weights(export.folder)
    export.save(export.output, lambda tmp: model.save_hf(tmp, export.tokenizer, export.fmt))


class _Refused(Exception):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    """Admits what torch.distributed.checkpoint's `.metadata` holds: DCP's own dataclasses and
    enums, torch.Size, dtypes and layouts, paths. Module names are checked before any import."""

    PLAIN = {("torch.serialization", "_get_layout"), ("collections", "OrderedDict"), ("pathlib", "PosixPath"),
             ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath")}

    def find_class(self, module: str, name: str) -> Any:
        import dataclasses
        import enum

        if (module, name) in self.PLAIN:
            return super().find_class(module, name)
        if module == "torch":
            found = getattr(torch, name, None)
            if found is torch.Size or isinstance(found, (torch.dtype, torch.layout, torch.memory_format)):
                return found
        elif module.startswith("torch.distributed.checkpoint.") and "__" not in name:
            found = super().find_class(module, name)
            if isinstance(found, type) and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum)):
                return found
        raise _Refused(f"{module}.{name}")


def check_dcp_metadata(path: Path) -> str | None:
    """None if DCP's `.metadata` at `path` unpickles with `_MetadataUnpickler`, else why not.
    torch.distributed.checkpoint unpickles that file with no restriction: check it first."""
    try:
        with path.open("rb") as handle:
            _MetadataUnpickler(handle).load()
    except _Refused as err:
        return f"{path.name} refers to {err}, which DCP metadata never holds"
    except Exception as err:  # a damaged pickle can fail in many ways
        return f"{path.name} unreadable: {type(err).__name__}: {err}"
    return None
