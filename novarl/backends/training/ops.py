"""DeepSpeed's environment, and its C++ ops: built once, cached, never a silent wait.

DeepSpeed compiles some ops (CPU Adam for optimizer offload) with the host's
C++ compiler on first use, 30-45 s on a 2-core CPU. novarl points torch's
extension cache at a folder of its own per torch version,
`$NOVARL_CACHE_DIR/torch_extensions/<torch version>` (default `~/.cache/novarl`: one build serves
every checkout and environment with that torch; an op built against another torch is never
loaded), unless TORCH_EXTENSIONS_DIR is set, and prints a line every 10 s while a build runs.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from novarl.logging.console import info
from novarl.logging.quiet import cache_dir

PROGRESS_EVERY_S = 10.0


def deepspeed_environment() -> None:
    """Before `import deepspeed`: the accelerator (cpu unless CUDA is there) and the op cache."""
    import torch

    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(extensions_dir(torch.__version__)))


def extensions_dir(torch_version: str) -> Path:
    """novarl's cache of C++ ops built against `torch_version` (their ABI is that torch's)."""
    return cache_dir() / "torch_extensions" / torch_version


def cpu_adam():
    """DeepSpeedCPUAdam, with its op loaded from the cache or built (progress shown)."""
    deepspeed_environment()
    from deepspeed.ops.op_builder import CPUAdamBuilder

    builder = CPUAdamBuilder()
    with first_build(builder.NAME, f"DeepSpeed's {builder.NAME} op"):
        builder.load(verbose=False)
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam


@contextmanager
def first_build(op: str, what: str) -> Iterator[None]:
    """Around code that builds the C++ op `op` unless the cache has it: progress if it does not."""
    deepspeed_environment()
    folder = Path(os.environ["TORCH_EXTENSIONS_DIR"])
    if any((folder / op).glob("*.so")):
        yield
        return
    with progress(f"building {what} with the C++ compiler (first use only, about 30-45 s on 2 cores; "
                  f"cached in {folder})"):
        yield


@contextmanager
def progress(what: str) -> Iterator[None]:
    """Say what is starting, then how long it has run every PROGRESS_EVERY_S, then that it is done."""
    info(what)
    start, done = time.perf_counter(), threading.Event()

    def tick() -> None:
        while not done.wait(PROGRESS_EVERY_S):
            info(f"... still working ({time.perf_counter() - start:.0f} s)")

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()
    info(f"done in {time.perf_counter() - start:.0f} s")
