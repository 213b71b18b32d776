"""Step time and peak memory per rank of the DTensor backend's layouts.

    .venv/bin/python benchmarks/bench_parallel.py [--steps 3] [--out benchmarks/results/parallel_cpu.md]

For the bundled tiny model (with its KV head duplicated so TP=2 can split it)
and a random-initialised ~100M-parameter Llama, runs forward+backward+AdamW
steps on a fixed synthetic batch under: 1 rank, FSDP2 x2, TP x2, and FSDP2 x2
with CPU offload -- every layout as Ray actors, so each rank's peak resident
memory (ru_maxrss) is measured the same way. The table compares the measured
growth over an import-only actor with the model state the layout should hold
per rank: fp32 weights + gradients + Adam moments = 16 bytes per parameter,
divided by the data-parallel size (FSDP2) or by the tensor-parallel size (TP splits the
decoder layers and, since models/vocab_parallel.py, the embeddings over the vocabulary;
runs before it kept the embeddings whole on each rank).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
from datetime import date
from pathlib import Path

import torch
from models import TimedPolicy, random_llama_100m, synthetic_batch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

LAYOUTS = {  # name: (ranks, tensor_parallel, cpu_offload)
    "1 rank": (1, 1, False),
    "FSDP2 x2": (2, 1, False),
    "TP x2": (2, 2, False),
    "FSDP2 x2 + CPU offload": (2, 1, True),
}


class Bench(TimedPolicy):
    """Runs on every rank: the policy plus a fixed batch, timed steps, memory."""

    def __init__(self, model_path: str, tensor_parallel: int, cpu_offload: bool, batch_size: int,
                 seq_len: int) -> None:
        from novarl.algorithms.losses import make_loss
        from novarl.backends.training.dtensor import DTensorPolicy
        from novarl.config.schema import LossConfig, PolicyConfig
        from novarl.models.scores import Logprobs

        policy = PolicyConfig(model_name=model_path, precision="float32", train_micro_batch_size=batch_size,
                              dtensor_cfg={"tensor_parallel_size": tensor_parallel, "cpu_offload": cpu_offload})
        self.policy = DTensorPolicy(policy, model_path, total_steps=100)
        self.batch = synthetic_batch(batch_size, seq_len)
        self.loss = make_loss(LossConfig())
        self.head = Logprobs()


class ImportsOnly:
    def __init__(self) -> None:
        import transformers  # noqa: F401 -- the same libraries a real rank loads

    def peak_rss_mb(self) -> float:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def make_models(folder: Path) -> dict[str, tuple[str, int]]:
    """{name: (path, parameters)}: tiny-arith with 2 KV heads, and a random ~100M Llama."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from novarl.models.loading import resolve_model_path

    source = resolve_model_path("tiny-arith")
    tokenizer = AutoTokenizer.from_pretrained(source)
    tiny = AutoModelForCausalLM.from_pretrained(source)
    tiny.config.num_key_value_heads = 2
    wide = AutoModelForCausalLM.from_config(tiny.config)
    state = {k: (v.repeat(2, 1) if k.endswith(("k_proj.weight", "v_proj.weight")) else v)
             for k, v in tiny.state_dict().items()}
    wide.load_state_dict(state)
    wide.save_pretrained(folder / "tiny")
    tokenizer.save_pretrained(folder / "tiny")
    return {"tiny-arith (2 KV heads)": (str(folder / "tiny"), wide.num_parameters()),
            "random Llama ~100M": random_llama_100m(folder / "random")}


def expected_mb(parameters: int, ranks: int, tensor_parallel: int) -> float:
    """Model state per rank: 16 bytes a parameter, every weight split over dp (FSDP2) or tp (the decoder
    layers and the tied embeddings over the vocabulary)."""
    return 16 * parameters / ranks / 2**20


def main() -> None:
    import ray

    from novarl.distributed.ray_group import RayWorkerGroup, ensure_ray

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "parallel_cpu.md")
    args = parser.parse_args()
    ensure_ray(num_cpus=2)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        models = make_models(Path(tmp))
        base = RayWorkerGroup(ImportsOnly, {}, world_size=1, name="baseline")
        baseline = base.call("peak_rss_mb")
        base.shutdown()
        for model_name, (path, params) in models.items():
            for layout, (ranks, tp, offload) in LAYOUTS.items():
                group = RayWorkerGroup(Bench, dict(model_path=path, tensor_parallel=tp, cpu_offload=offload,
                                                   batch_size=args.batch_size, seq_len=args.seq_len),
                                       world_size=ranks, name=layout)
                times = [group.call("step") for _ in range(args.steps + 1)][1:]  # first step warms up
                peaks = group.call_all("peak_rss_mb")
                group.shutdown()
                rows.append((model_name, params, layout, statistics.median(times), max(peaks),
                             max(peaks) - baseline, expected_mb(params, ranks, tp)))
                print(rows[-1], flush=True)
    ray.shutdown()
    write_report(args, rows, baseline)


def write_report(args, rows, baseline: float) -> None:
    table = "\n".join(
        f"| {m} | {p / 1e6:.2f}M | {layout} | {t:.3f} | {peak:,.0f} | {grown:,.0f} | {want:,.1f} |"
        for m, p, layout, t, peak, grown, want in rows)
    report = f"""# DTensor backend layouts on CPU: step time and peak memory per rank

- date: {date.today()}
- machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, gloo, each rank a Ray actor with 1 CPU
- software: torch {torch.__version__}, Python {platform.python_version()}
- command: `.venv/bin/python benchmarks/bench_parallel.py --steps {args.steps} --batch-size {args.batch_size} --seq-len {args.seq_len}`
- step = logprobs forward + forward/backward + AdamW on {args.batch_size} sequences x {args.seq_len} tokens, fp32;
  median of {args.steps} steps after one warm-up step
- peak RSS of an import-only actor (torch + transformers, no model): {baseline:,.0f} MB

| model | parameters | layout | median s/step | peak RSS per rank (MB) | growth over import-only (MB) | model state per rank, expected (MB) |
|---|---|---|---|---|---|---|
{table}

Model state expected = 16 bytes per parameter (fp32 weights, gradients, two Adam moments),
divided by the data-parallel size; under TP x2 the decoder-layer weights and the embeddings
(over the vocabulary) are halved. Growth also holds activations, the loaded checkpoint copy and allocator
slack. On a CPU-only host "CPU offload" has no device memory to free, so it shows its cost
(extra copies) and not its saving; its saving shows on the GPU machine.
"""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    print(report)


if __name__ == "__main__":
    main()
