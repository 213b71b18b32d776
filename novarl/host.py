"""What this host has, found without importing what is asked about: a CUDA GPU (without torch
where it is not imported yet, so `novarl validate` and `plan` stay light) and installed packages
(without importing them or their parent packages). The lowest layer: it imports nothing of novarl.
Callers use `host.has_cuda()` through the module, so that tests can set what the host has."""

from __future__ import annotations

from pathlib import Path


def has_cuda() -> bool:
    """Whether this host has a CUDA GPU. Without torch imported, the driver's device files decide:
    /dev/nvidia0, ... (none where CUDA_VISIBLE_DEVICES hides them all)."""
    import os
    import sys

    if "torch" in sys.modules:
        return sys.modules["torch"].cuda.is_available()
    if os.environ.get("CUDA_VISIBLE_DEVICES", "unset").strip() in ("", "-1"):
        return False
    return any(Path("/dev").glob("nvidia[0-9]*"))


def cuda_device_count() -> int:
    """The CUDA devices this process sees (CUDA_VISIBLE_DEVICES honoured); 0 without a GPU.
    Imports torch only where the driver's device files are there."""
    if not has_cuda():
        return 0
    import torch

    return torch.cuda.device_count()


def installed(module: str) -> bool:
    """Whether `module` can be imported, without importing it or its parent packages
    (importlib's find_spec of 'a.b' imports 'a': megatron's, for one, is not light)."""
    import importlib.util
    import sys

    top, _, rest = module.partition(".")
    if top in sys.modules:
        return importlib.util.find_spec(module) is not None
    spec = importlib.util.find_spec(top)
    if spec is None or not rest:
        return spec is not None
    folders = [Path(p) for p in spec.submodule_search_locations or ()]
    path = Path(*rest.split("."))
    return any((f / path).is_dir() or (f / path).with_suffix(".py").is_file() for f in folders)
