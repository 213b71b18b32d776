"""Third-party noise kept out of the user's terminal.

novarl's progress bar and `[novarl]` lines are what a user watches. The
libraries under it log a lot that a user can do nothing about: vLLM's
per-engine WARNING lines and load bars, torch's C++ notices (NUMA binding),
FutureWarnings raised inside vLLM and DeepSpeed, transformers' and the hub's
progress bars. Each setting below is a default: a variable the user already
set wins (`VLLM_LOGGING_LEVEL=INFO novarl train` shows vLLM's log again).

Environment variables are set before the libraries are imported, so they
reach the processes novarl starts too (Ray actors inherit the driver's
environment when novarl starts the local Ray instance).
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path


def cache_dir() -> Path:
    """novarl's cache folder: `$NOVARL_CACHE_DIR`, else `~/.cache/novarl`."""
    return Path(os.environ.get("NOVARL_CACHE_DIR", "~/.cache/novarl")).expanduser()


QUIET_ENVIRONMENT = {
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "VLLM_LOGGING_LEVEL": "ERROR",
    "TORCH_CPP_LOG_LEVEL": "ERROR",
    "TOKENIZERS_PARALLELISM": "false",
}
"""Variables set when the user has not set them."""

NOISY_MODULES = ("vllm", "deepspeed", "megatron", "torch.distributed", "transformers")
"""FutureWarnings and DeprecationWarnings raised from these are not the user's to act on."""


def quiet_third_party() -> None:
    """Set the defaults above and filter library warnings in this process. Idempotent."""
    for name, value in QUIET_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    # DeepSpeed, imported by transformers and peft when present, warns about its accelerator
    # unless told which: the one this host has.
    from novarl import host

    os.environ.setdefault("DS_ACCELERATOR", "cuda" if host.has_cuda() else "cpu")
    # vLLM's torch.compile and kernel caches beside novarl's own instead of ~/.cache/vllm.
    os.environ.setdefault("VLLM_CACHE_ROOT", str(cache_dir() / "vllm"))
    # vLLM logs a few lines while it is imported, before it configures its own logger: the level
    # set here holds for those too.
    try:
        logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"].upper())
    except ValueError:  # not a level name: vLLM itself will say so
        pass
    filter_library_warnings()


def filter_library_warnings() -> None:
    """In this process: library FutureWarnings / DeprecationWarnings hidden (a user's own code's still
    show), and megatron-core's UserWarnings about what the host lacks (Transformer Engine, Apex), which
    novarl's own checks say when the config needs them. Rank processes call it too (Ray prints what
    they warn on the driver's terminal)."""
    for module in NOISY_MODULES:
        for category in (FutureWarning, DeprecationWarning):
            warnings.filterwarnings("ignore", category=category, module=module.replace(".", r"\.") + r"(\.|$)")
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron(\.|$)")
