"""DeepSpeed's environment, and its C++ ops: built once, cached, never a silent wait.

DeepSpeed compiles some ops (CPU Adam for optimizer offload) with the host's
C++ compiler on first use, 30-60 s on a 2-core CPU. novarl points torch's
extension cache at a folder of its own per torch installation,
`$NOVARL_CACHE_DIR/torch_extensions/<torch version>-<its folder's hash>` (default `~/.cache/novarl`:
one build serves every run of that environment; an op built against another torch is never loaded,
and two environments do not rebuild each other's: the build holds the torch headers' path), unless
TORCH_EXTENSIONS_DIR is set, and prints a line every 10 s while a build runs.

DeepSpeed's shared-memory all-reduce op (deepspeed_shm_comm), which its communication builds as it
starts on a CPU, is not built (`skip_shared_memory_op`): only DeepSpeed's inference all-reduce uses
it; ZeRO's training collectives are torch.distributed's. That spares ~40 s of compiling at a first run.
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
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(extensions_dir(torch.__version__, torch.__file__)))


def extensions_dir(torch_version: str, torch_file: str) -> Path:
    """novarl's cache of C++ ops built against the torch `torch_version` installed at `torch_file`
    (their ABI is that torch's; their build names its headers' folder)."""
    import hashlib

    where = hashlib.sha256(str(Path(torch_file).resolve().parent).encode()).hexdigest()[:10]
    return cache_dir() / "torch_extensions" / f"{torch_version}-{where}"


def skip_shared_memory_op(device) -> None:
    """DeepSpeed on a CPU (`device`): its communication starts without building deepspeed_shm_comm
    (see the module doc); on a GPU, or a DeepSpeed without the op table, nothing changes."""
    import deepspeed.ops

    compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
    if device.type == "cpu" and isinstance(compatible, dict):
        compatible["deepspeed_shm_comm"] = False


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
