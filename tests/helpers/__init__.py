HF = "policy.generation.backend=hf"
"""Runs whose subject is not generation pin Hugging Face generation: the bundled recipe
leaves the backend unset (vLLM where installed), and vLLM's engine start-up would add
seconds to each of them; tests/test_vllm.py covers vLLM."""


def train_steps(output_dir, *, this_run_only: bool = True) -> dict:
    """Step -> train record of a run folder's metrics.jsonl. A resumed run's file first holds the
    history it carried over from its checkpoint, up to a "resume" record: left out unless
    this_run_only=False."""
    from novarl.logging.metrics import read_jsonl

    records = read_jsonl(output_dir / "metrics.jsonl")
    resumes = [i for i, r in enumerate(records) if r["kind"] == "resume"]
    if this_run_only and resumes:
        records = records[resumes[-1] + 1:]
    return {r["step"]: r for r in records if r["kind"] == "train"}


def default_generation() -> str:
    """The generation backend the bundled recipe gets when it sets none (the one measured faster
    for its tiny model on this host: Hugging Face on a CPU host)."""
    from novarl.config import BUNDLED_RECIPE, load_config
    from novarl.backends.contract.resolve import resolve_backends

    return resolve_backends(load_config(BUNDLED_RECIPE)).generation


def train_until_killed(overrides: list[str], marker, *, env: dict | None = None, timeout: float = 180) -> None:
    """`novarl train <overrides>` in a process of its own, killed with SIGKILL (kill -9) as soon as
    the path `marker` exists (a checkpoint folder), or after `timeout` seconds."""
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-m", "novarl.cli", "train", *overrides], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    while not marker.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def rank_pids(driver_pid: int) -> list[int]:
    """Process ids, ascending, of the Ray rank actors (ray::RankActor) of the run in process
    `driver_pid`: the workers of the local Ray instance it started are its descendants. Never
    another run's ranks (`pgrep -f ray::RankActor` finds every test session's on the machine)."""
    import psutil

    pids = []
    for child in psutil.Process(driver_pid).children(recursive=True):
        try:
            if "ray::RankActor" in " ".join(child.cmdline()):
                pids.append(child.pid)
        except psutil.Error:  # ended meanwhile
            pass
    return sorted(pids)


def scalar_reads():
    """A context counting the values read back to the host (on a GPU, each a wait for the device) in its
    `count`: the Python-level reads (`.item()`, `.tolist()`, `.numpy()`, `bool(t)`, `int(t)`, `float(t)`,
    which a torch-function mode sees) and those inside operators (`_local_scalar_dense`, which a dispatch
    mode sees; a Python-level `.item()` counts in both)."""
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    reads = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__bool__, torch.Tensor.__int__,
             torch.Tensor.__float__, torch.Tensor.__index__}

    class Calls(TorchFunctionMode):
        def __init__(self, counter):
            super().__init__()
            self.counter = counter

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.counter.count += func in reads
            return func(*args, **(kwargs or {}))

    class Operators(TorchDispatchMode):
        def __init__(self, counter):
            super().__init__()
            self.counter = counter

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.counter.count += func is torch.ops.aten._local_scalar_dense.default
            return func(*args, **(kwargs or {}))

    class ScalarReads:
        count = 0

        def __enter__(self):
            self.modes = [Calls(self), Operators(self)]
            for mode in self.modes:
                mode.__enter__()
            return self

        def __exit__(self, *exc):
            for mode in reversed(self.modes):
                mode.__exit__(*exc)

    return ScalarReads()
