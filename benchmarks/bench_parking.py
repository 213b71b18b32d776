"""What parking costs a colocated run (novarl/distributed/parking.py), side by side with the training step it
sits beside: a DTensor policy of Qwen2.5-1.5B's shape (random weights, bf16 compute, fp32 masters, fused AdamW)
on one GPU trains a step on issue 35's equal-length batch (16 x 2,048 tokens, micro-batches of 4), then parks
its optimizer state and weights as a weight sync does and wakes them as the next step does, several times.

Reported: the bytes parked, the seconds to park and to wake (each ended by a device synchronisation), the
host<->device bandwidth they reach, the device memory they hand back (torch's reserved bytes), and the ratio
of a park + wake cycle to the training step's seconds: what parking adds to a colocated step (the generation
between them not counted). That a parked policy trains on as one never parked is tests/test_parking.py's.

    python benchmarks/bench_parking.py [--out benchmarks/results/parking_gpu_<device>.md] [--tiny]

On a CPU host (`--tiny`, for checking the script) host storages park into host buffers
(NOVARL_PARK_ON_CPU's way): the figures say nothing there. Needs only torch, transformers and pydantic, as
bench_train_gpu.py (scripts/gpu_bench.sh runs it after that benchmark and the GPU tests, when time is left).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(call) -> float:
    synchronize()
    tic = time.perf_counter()
    call()
    synchronize()
    return time.perf_counter() - tic


def measure(shape: str, tiny: bool, cycles: int) -> dict:
    import tempfile

    import torch

    from bench_train_gpu import batch_lengths, make_batch, novarl_policy, novarl_step, save_model, SHAPES
    from novarl.distributed.parking import GROUPS

    on_gpu = torch.cuda.is_available()
    folder = Path(tempfile.mkdtemp(prefix="novarl-parking-"))
    params = save_model(folder, shape)
    lengths, prompt = batch_lengths("equal", tiny)
    batch = make_batch(lengths, prompt, SHAPES[shape]["vocab_size"])
    policy = novarl_policy(str(folder), "fixed", True, 4, max(lengths))
    step = novarl_step(policy, batch, [])
    step()  # the first: compiles, and makes the optimizer's state
    step_s = statistics.median(timed(step) for _ in range(2))
    reserved = torch.cuda.memory_reserved() if on_gpu else 0
    parked, park_s, wake_s, handed_back = [], [], [], []
    for _ in range(cycles):
        synchronize()
        tic = time.perf_counter()
        freed = sum(policy.park(group, host_too=not on_gpu) for group in GROUPS)
        synchronize()
        park_s.append(time.perf_counter() - tic)
        handed_back.append(reserved - (torch.cuda.memory_reserved() if on_gpu else 0))
        parked.append(freed)
        wake_s.append(timed(lambda: policy.parking.wake()))
    after = timed(step)
    park, wake = statistics.median(park_s), statistics.median(wake_s)
    return {"device": torch.cuda.get_device_name() if on_gpu else "CPU", "shape": shape, "params": params,
            "parked_gb": parked[-1] / 1e9, "park_s": park, "wake_s": wake, "step_s": step_s, "step_after_s": after,
            "handed_back_gb": min(handed_back) / 1e9, "park_gbps": parked[-1] / 1e9 / park,
            "wake_gbps": parked[-1] / 1e9 / wake, "cycle_over_step": (park + wake) / step_s, "cycles": cycles}


def report(result: dict, commit: str) -> str:
    return "\n".join([
        f"# Parking beside a training step: {result['device']}",
        "",
        f"Commit {commit}; `python benchmarks/bench_parking.py`; a DTensor policy of {result['shape']}'s shape "
        f"({result['params'] / 1e9:.2f} B parameters, bf16 compute, fp32 masters, fused AdamW) on one device, "
        f"issue 35's equal-length batch; medians of {result['cycles']} park + wake cycles.",
        "",
        "| parked GB | park s | wake s | park GB/s | wake GB/s | handed back GB | step s | (park + wake) / step |",
        "|---|---|---|---|---|---|---|---|",
        f"| {result['parked_gb']:.2f} | {result['park_s']:.3f} | {result['wake_s']:.3f} | {result['park_gbps']:.1f} | "
        f"{result['wake_gbps']:.1f} | {result['handed_back_gb']:.2f} | {result['step_s']:.3f} | "
        f"{result['cycle_over_step']:.1%} |",
        "",
        f"The step after the cycles took {result['step_after_s']:.3f} s.",
    ]) + "\n"


def main() -> None:
    import subprocess

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny model and batch (checks the script)")
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    result = measure("tiny" if args.tiny else "qwen2.5-1.5b", args.tiny, args.cycles)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                            check=False).stdout.strip() or "unknown"
    text = report(result, commit)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
