"""Megatron-core vs the DTensor backend on the same model: step time, tokens/s and, on
GPUs, model FLOPs utilisation (MFU).

    .venv/bin/python benchmarks/bench_megatron.py [--steps 3] [--batch-size 8] [--seq-len 64]
        [--out benchmarks/results/megatron_cpu.md]

For the bundled tiny model (its KV head duplicated so TP=2 splits it) and a random
~100M-parameter Llama, every layout runs as Ray actors, one per rank, a fixed
synthetic batch: one step = logprobs forward + forward/backward + optimizer step.
On a host without CUDA, megatron-core runs under NOVARL_MEGATRON_ON_CPU=1 (CUDA
requests mapped to the CPU; no fused kernels), so its figures there compare code
paths, not what Megatron does on GPUs: run it on the GPU machine for those, where
MFU = (6 N tokens for training + 2 N tokens for the logprob pass) / (step time x
GPUs x peak bf16 FLOP/s).
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

import torch
from bench_parallel import make_models
from models import synthetic_batch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}
"""Dense bf16 tensor-core peaks (SXM parts), by name fragment."""

LAYOUTS = {  # name: (backend, ranks, tensor_parallel, pipeline_parallel)
    "DTensor, 1 rank": ("dtensor", 1, 1, 1),
    "Megatron, 1 rank": ("megatron", 1, 1, 1),
    "DTensor TP x2": ("dtensor", 2, 2, 1),
    "Megatron TP x2": ("megatron", 2, 2, 1),
    "Megatron PP x2": ("megatron", 2, 1, 2),
}


class Bench:
    """Runs on every rank: a policy on `backend` plus a fixed batch, timed steps."""

    def __init__(self, model_path: str, backend: str, tensor_parallel: int, pipeline_parallel: int,
                 batch_size: int, seq_len: int, precision: str) -> None:
        from novarl.algorithms.losses import make_loss
        from novarl.config.schema import LossConfig, PolicyConfig
        from novarl.models.scores import Logprobs

        policy = PolicyConfig(
            model_name=model_path, precision=precision, train_micro_batch_size=batch_size,
            dtensor_cfg={"tensor_parallel_size": tensor_parallel if backend == "dtensor" else 1},
            megatron_cfg={"enabled": backend == "megatron", "tensor_model_parallel_size": tensor_parallel,
                          "pipeline_model_parallel_size": pipeline_parallel,
                          "optimizer": {"lr": 1e-4, "weight_decay": 0.0}})
        if backend == "megatron":
            from novarl.backends.training.megatron import MegatronPolicy

            self.policy = MegatronPolicy(policy, model_path, total_steps=100,
                                         emulate_cuda=not torch.cuda.is_available())
        else:
            from novarl.backends.training.dtensor import DTensorPolicy

            self.policy = DTensorPolicy(policy, model_path, total_steps=100)
        self.batch = synthetic_batch(batch_size, seq_len)
        self.loss = make_loss(LossConfig())
        self.head = Logprobs()

    def step(self) -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        self.batch.old_logprobs = self.policy.forward(self.batch, self.head)
        self.policy.forward_backward(self.batch, self.loss, self.head)
        self.policy.optim_step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - start


def peak_flops() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((flops for part, flops in PEAK_BF16_FLOPS.items() if part in name), None)


def main() -> None:
    import ray

    from novarl.distributed.ray_group import RayWorkerGroup, ensure_ray

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "megatron_cpu.md")
    args = parser.parse_args()
    on_gpu = torch.cuda.is_available()
    precision = "bfloat16" if on_gpu else "float32"
    gpus = torch.cuda.device_count() if on_gpu else 0
    ensure_ray(num_cpus=os.cpu_count() if on_gpu else 2)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("NOVARL_MEGATRON_CHECKPOINT_DIR", str(Path(tmp) / "megatron"))
        for model_name, (path, params) in make_models(Path(tmp)).items():
            for layout, (backend, ranks, tp, pp) in LAYOUTS.items():
                if on_gpu and ranks > gpus:
                    continue
                group = RayWorkerGroup(Bench, dict(model_path=path, backend=backend, tensor_parallel=tp,
                                                   pipeline_parallel=pp, batch_size=args.batch_size,
                                                   seq_len=args.seq_len, precision=precision),
                                       world_size=ranks, gpus_per_rank=1 if on_gpu else 0, name=layout)
                times = [group.call("step") for _ in range(args.steps + 1)][1:]  # the first warms up
                group.shutdown()
                seconds = statistics.median(times)
                tokens = args.batch_size * args.seq_len
                flops = 8 * params * tokens  # 6 N T training + 2 N T logprob forward
                peak = peak_flops()
                mfu = flops / (seconds * ranks * peak) if peak else None
                rows.append((model_name, params, layout, seconds, tokens / seconds, mfu))
                print(rows[-1], flush=True)
    ray.shutdown()
    write_report(args, rows, precision)


def write_report(args, rows, precision: str) -> None:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else \
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, no GPU (Megatron under " \
        "NOVARL_MEGATRON_ON_CPU=1)"
    table = "\n".join(f"| {m} | {p / 1e6:.2f}M | {layout} | {t:.3f} | {tps:,.0f} | "
                      f"{'-' if mfu is None else f'{100 * mfu:.1f} %'} |" for m, p, layout, t, tps, mfu in rows)
    report = f"""# Megatron-core vs DTensor: step time and MFU

- date: {date.today()}
- machine: {device}
- software: torch {torch.__version__}, Python {platform.python_version()}
- command: `.venv/bin/python benchmarks/bench_megatron.py --steps {args.steps} --batch-size {args.batch_size} --seq-len {args.seq_len}`
- step = logprobs forward + forward/backward + optimizer step on {args.batch_size} sequences x {args.seq_len} tokens,
  {precision}; median of {args.steps} steps after one warm-up; each rank a Ray actor

| model | parameters | layout | median s/step | tokens/s | MFU |
|---|---|---|---|---|---|
{table}
"""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    print(report)


if __name__ == "__main__":
    main()
