"""Memory per rank and step time of the training strategies, measured and predicted.

    .venv/bin/python benchmarks/bench_memory.py [--out benchmarks/results/memory_cpu.md] [--models tiny,100m]

For the bundled tiny model and a random ~100M-parameter Llama: one rank, DDP
(DeepSpeed ZeRO-0), ZeRO-1, ZeRO-2, ZeRO-3 and FSDP2, two ranks each, as Ray
actors (gloo). Each layout trains 4 optimizer steps on a fixed batch; then each
rank reports (novarl/distributed/memory.py; the peak is reset after a warm-up step):

- model states: bytes of live tensors after the last backward (parameters,
  gradients, optimizer state), against `novarl.plan.memory`'s params + grads +
  optimizer for the same strategy (fp32 Adam: 4 + 4 + 8 bytes per parameter);
- peak: the model states at rest after a warm-up step (live tensors) plus the rise of
  the process's resident set above that during 3 more steps, against the planner's
  total (model states, activations, gathered parameters). On CPU the rise includes
  allocator slack and the autograd graph's temporaries.

Step time is the median of steps 2-4 (forward, backward, optimizer step).
Each layout's workers start after the previous ones are gone (RayWorkerGroup waits
for Ray to free their resources).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from datetime import date
from pathlib import Path

from models import random_llama_100m

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

LAYOUTS = (  # (label, backend, ranks, ZeRO stage, planner strategy)
    ("1 rank", "dtensor", 1, None, "ddp"),
    ("DDP x2 (ZeRO-0)", "deepspeed", 2, 0, "ddp"),
    ("ZeRO-1 x2", "deepspeed", 2, 1, "zero1"),
    ("ZeRO-2 x2", "deepspeed", 2, 2, "zero2"),
    ("ZeRO-3 x2", "deepspeed", 2, 3, "zero3"),
    ("FSDP2 x2", "dtensor", 2, None, "fsdp2"),
)
WORKLOADS = {  # model -> (rows per step, micro-batch per rank, sequence length)
    "tiny": (512, 256, 16),
    "100m": (8, 4, 128),
}


def batch(rows: int, length: int, vocab: int):
    import torch

    from novarl.types import TrainBatch

    gen = torch.Generator().manual_seed(0)
    loss_mask = torch.ones(rows, length, dtype=torch.bool)
    loss_mask[:, : length // 2] = False  # the prompt half
    return TrainBatch.from_rows(torch.randint(3, vocab, (rows, length), generator=gen),
                                torch.ones(rows, length, dtype=torch.bool), loss_mask, torch.randn(rows, generator=gen))


def measure(model_path: str, layout: tuple, workload: tuple[int, int, int]) -> dict[str, float]:
    from novarl.algorithms.losses import make_loss
    from novarl.config import load_config
    from novarl.distributed.ray_group import RayWorkerGroup
    from novarl.backends.remote import RemotePolicy
    from novarl.models.scores import Logprobs
    from novarl.trainer.stages import train_on_batch

    label, backend, ranks, stage, _ = layout
    rows, micro, length = workload
    cfg = load_config(None, overrides=[
        f"policy.model_name={model_path}", f"policy.train_micro_batch_size={micro}", "policy.precision=float32",
        f"policy.logprob_batch_size={micro}", f"policy.max_total_sequence_length={length}",
        f"cluster.gpus_per_node={ranks}",
        *(["policy.deepspeed_cfg.enabled=true", f"policy.deepspeed_cfg.zero_stage={stage}"]
          if backend == "deepspeed" else [])])
    if backend == "deepspeed":
        from novarl.backends.training.deepspeed import DeepSpeedPolicy as Policy

        extra = {"accumulation_steps": max(rows // ranks // micro, 1)}
    else:
        from novarl.backends.training.dtensor import DTensorPolicy as Policy

        extra = {}
    group = RayWorkerGroup(Policy, dict(policy=cfg.policy, model_path=model_path, total_steps=10,
                                        **extra), world_size=ranks, name=label)
    policy = RemotePolicy(group)
    try:
        from transformers import AutoConfig

        train = batch(rows, length, AutoConfig.from_pretrained(model_path).vocab_size)
        train.old_logprobs = policy.forward(train, Logprobs())
        loss = make_loss(cfg.loss_fn)
        train_on_batch(policy, Logprobs(), train, loss, rows)  # warm-up: lazy imports and first allocations
        group.call_all_actors("reset_memory_peak")
        times = []
        for _ in range(3):
            start = time.perf_counter()
            train_on_batch(policy, Logprobs(), train, loss, rows)
            times.append(time.perf_counter() - start)
        policy.forward_backward(train, loss, Logprobs())  # gradients held, as at the end of a backward
        reports = group.call_all_actors("memory")
    finally:
        policy.shutdown()
    # peak = the model states at rest (after the warm-up step) + the resident set's rise above
    # them during training (activations, autograd temporaries, communication buffers)
    return {"tensors": max(r["tensors"] for r in reports),
            "peak": max(r["tensors_at_reset"] + r["rss_peak_since_reset"] for r in reports),
            "step_s": statistics.median(times)}


def predict(model_path: str, layout: tuple, workload: tuple[int, int, int]) -> dict[str, float]:
    from novarl.plan.memory import Parallelism, Workload, estimate_memory
    from novarl.backends.contract.model_shape import ModelShape

    _, _, ranks, _, strategy = layout
    _, micro, length = workload
    got = estimate_memory(ModelShape.from_name(model_path), strategy=strategy,
                          workload=Workload(sequence_length=length, micro_batch_size=micro, precision="float32"),
                          parallel=Parallelism(data_parallel_size=ranks))
    return {"states": got.model_states, "total": got.training}


def main() -> None:
    import torch

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "memory_cpu.md")
    parser.add_argument("--models", default="tiny,100m")
    args = parser.parse_args()
    from novarl.models.loading import resolve_model_path

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"tiny": ("tiny-arith (0.30M)", resolve_model_path("tiny-arith"))}
        if "100m" in args.models:
            paths["100m"] = ("random Llama (~100M)", random_llama_100m(Path(tmp) / "m100")[0])
        for key in args.models.split(","):
            name, path = paths[key]
            for layout in LAYOUTS:
                got, want = measure(path, layout, WORKLOADS[key]), predict(path, layout, WORKLOADS[key])
                rows.append((name, layout[0], got, want))
                print(rows[-1], flush=True)
    import ray

    ray.shutdown()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report(rows, torch.__version__))
    print(args.out.read_text())


def report(rows: list, torch_version: str) -> str:
    mb = 1e6
    lines = []
    for name, label, got, want in rows:
        ddp = next(g for n, lab, g, _ in rows if n == name and lab.startswith("DDP"))
        lines.append(
            f"| {name} | {label} | {got['tensors'] / mb:,.1f} | {want['states'] / mb:,.1f} | "
            f"{(got['tensors'] - want['states']) / want['states']:+.0%} | {got['peak'] / mb:,.0f} | "
            f"{want['total'] / mb:,.0f} | {(got['peak'] - want['total']) / want['total']:+.0%} | "
            f"{ddp['tensors'] / got['tensors']:.2f}x | {got['step_s']:.3f} |")
    table = "\n".join(lines)
    return f"""# Memory per rank and step time: DDP, ZeRO-1/2/3, FSDP2 (measured vs planned)

- date: {date.today()}
- machine: {platform.machine()}, {os.cpu_count()} cores, no GPU; torch {torch_version}; DeepSpeed CPU
  accelerator; fp32, Adam; ranks are Ray actors on gloo, one core each
- command: `.venv/bin/python benchmarks/bench_memory.py`
- workloads: tiny = 512 rows x 16 tokens, micro-batch 256 per rank; ~100M = 8 rows x 128
  tokens, micro-batch 4 per rank
- states: live tensor bytes on the rank after a backward (params + grads + optimizer state),
  measured vs `novarl.plan.memory` (params + grads + optimizer); peak: states at rest plus
  the resident set's rise during training, vs the planner's training total (with
  activations). MB = 1e6 bytes; each figure is the larger of the ranks.

| model | layout | states (MB) | planned states (MB) | error | peak (MB) | planned total (MB) | error | DDP / this (states) | step (s) |
|---|---|---|---|---|---|---|---|---|---|
{table}
"""


if __name__ == "__main__":
    main()
