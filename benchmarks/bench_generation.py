"""Hugging Face vs vLLM generation: throughput, weight-sync time, GRPO step time.

    .venv/bin/python benchmarks/bench_generation.py [--out benchmarks/results/generation_cpu.md]

For the bundled tiny model and a random-initialised ~100M-parameter Llama:
sampled generation of 512 sequences (tokens per second, median of 3 calls
after a warm-up), and the time to load the trainer's full weights into the
generator (median of 3), and to send them from one process to another over
the weight-transfer group a dedicated generator uses. Then 40 GRPO steps of
the demo recipe: HF and vLLM colocated, and vLLM on its own Ray actor, with the
median per-step time split.
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

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def measure(backend: str, path: str, new_tokens: int) -> dict[str, float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from novarl.config.schema import GenerationConfig
    from novarl.types import Prompt, SamplingConfig

    tokenizer = AutoTokenizer.from_pretrained(path)
    if backend == "vllm":
        from novarl.backends.generation.vllm import VllmGeneration

        gen = VllmGeneration(path, tokenizer, GenerationConfig(vllm_cfg={"enforce_eager": True}),
                             precision="float32", max_seq_length=64)
    else:
        from novarl.backends.generation.hf import HFGeneration

        gen = HFGeneration(path, tokenizer, precision="float32", max_seq_length=64)
    texts = [f"{a}+{b}=" for a in range(10, 74) for b in (11, 22, 33, 44, 55, 66, 77, 88)]
    prompts = [Prompt(text=t, token_ids=tokenizer(t).input_ids) for t in texts]
    rates = []
    for i in range(4):
        start = time.perf_counter()
        out = gen.generate(prompts, SamplingConfig(max_new_tokens=new_tokens, temperature=1.0, seed=i))
        if i:  # the first call warms up
            rates.append(sum(len(c.token_ids) for c in out) / (time.perf_counter() - start))
    weights = list(AutoModelForCausalLM.from_pretrained(path).state_dict().items())
    syncs = []
    for version in range(3):
        start = time.perf_counter()
        gen.update_weights(iter(weights), version=version + 1)
        syncs.append(time.perf_counter() - start)
    del gen
    return {"tokens_per_s": statistics.median(rates), "sync_s": statistics.median(syncs)}


def bridge_peer(rank: int, port: int, path: str, results) -> None:
    """One end of the weight-transfer group: rank 0 sends the model's weights 4 times."""
    from transformers import AutoModelForCausalLM

    from novarl.distributed.weight_sync import WeightBridge

    bridge = WeightBridge("127.0.0.1", port, rank, 2)
    weights = list(AutoModelForCausalLM.from_pretrained(path).state_dict().items()) if rank == 0 else None
    times = []
    for _ in range(4):
        start = time.perf_counter()
        sent = bridge.send(weights) if rank == 0 else sum(t.numel() * t.element_size() for _, t in bridge.receive())
        times.append(time.perf_counter() - start)
    if rank == 1:
        results.put((statistics.median(times[1:]), sent))


def bridge_transfer(path: str) -> tuple[float, int]:
    """(median seconds, bytes) to move the full weights over the gloo weight-transfer group
    between two processes, as policy rank 0 -> dedicated generator does each step."""
    import multiprocessing as mp
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=bridge_peer, args=(rank, port, path, results)) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    got = results.get(timeout=600)
    for proc in procs:
        proc.join()
    return got


LARGE_STEP = ["grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "policy.generation.max_new_tokens=32",
              "policy.max_total_sequence_length=64", "policy.train_micro_batch_size=16", "policy.logprob_batch_size=16"]
"""The ~100M model's GRPO step: 16 samples of up to 32 new tokens (a random model rarely stops)."""


def grpo_steps(backend: str, log_dir: str, *, dedicated: bool = False, model: str | None = None) -> dict[str, float]:
    """Median per-step times: the demo recipe (40 steps, from step 6), or with `model` the
    LARGE_STEP workload on it (6 steps, from step 3)."""
    from novarl.cli import BUNDLED_RECIPE
    from novarl.config import load_config
    from novarl.logging.metrics import read_jsonl
    from novarl.trainer.api import GRPOTrainer

    steps, skip = (6, 2) if model else (40, 5)
    large = [f"policy.model_name={model}", *LARGE_STEP] if model else []
    cfg = load_config(BUNDLED_RECIPE, overrides=[
        *large, f"grpo.max_num_steps={steps}", "grpo.max_train_seconds=null", "grpo.val_at_start=false",
        "grpo.val_at_end=false", "grpo.val_period=0", f"logger.log_dir={log_dir}", "logger.progress_bar=false",
        "logger.print_every_n_steps=40", f"policy.generation.backend={backend}",
        "policy.generation.vllm_cfg.enforce_eager=true", f"policy.generation.colocated.enabled={not dedicated}"])
    result = GRPOTrainer(cfg).train()
    steps = [r for r in read_jsonl(result.output_dir / "metrics.jsonl") if r["kind"] == "train"][skip:]
    return {k: statistics.median(r[f"time_{k}"] for r in steps)
            for k in ("generation", "logprobs", "training", "weight_sync", "step")}


def main() -> None:
    import torch

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "generation_cpu.md")
    args = parser.parse_args()
    from novarl.models.loading import resolve_model_path

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    rows, steps, bridge = [], {}, []
    with tempfile.TemporaryDirectory() as tmp:
        models = {"tiny-arith (0.30M)": (resolve_model_path("tiny-arith"), 4),
                  "random Llama (~100M)": (random_llama_100m(Path(tmp) / "m100")[0], 32)}
        for name, (path, new_tokens) in models.items():
            for backend in ("hf", "vllm"):
                got = measure(backend, path, new_tokens)
                rows.append((name, backend, new_tokens, got["tokens_per_s"], got["sync_s"]))
                print(rows[-1], flush=True)
            bridge.append((name, *bridge_transfer(path)))
            print(bridge[-1], flush=True)
        for name, (path, _) in models.items():
            model = None if name.startswith("tiny") else path
            for label, backend, dedicated in (("hf, colocated", "hf", False), ("vllm, colocated", "vllm", False),
                                              ("vllm, dedicated (2 Ray actors)", "vllm", True)):
                folder = str(Path(tmp) / f"{len(steps)}_{backend}")
                steps[name, label] = grpo_steps(backend, folder, dedicated=dedicated, model=model)
                print(name, label, steps[name, label], flush=True)
    table = "\n".join(f"| {m} | {b} | 512 x {n} | {tps:,.0f} | {sync * 1000:.1f} |" for m, b, n, tps, sync in rows)
    bridge_rows = "\n".join(f"| {m} | {nbytes / 1e6:,.1f} | {sec * 1000:.1f} | {nbytes / sec / 1e9:.2f} |"
                            for m, sec, nbytes in bridge)
    step_rows = "\n".join(
        f"| {m} | {b} | {s['generation']:.3f} | {s['logprobs']:.3f} | {s['training']:.3f} | {s['weight_sync']:.4f} | "
        f"{s['step']:.3f} |" for (m, b), s in steps.items())
    report = f"""# Generation backends on CPU: Hugging Face vs vLLM

- date: {date.today()}
- machine: {platform.machine()}, {os.cpu_count()} cores, no GPU; torch {torch.__version__}; vLLM CPU build
  (`vllm-cpu`), in-process engine, enforce_eager, fp32
- command: `.venv/bin/python benchmarks/bench_generation.py`

## Sampled generation and weight sync

512 prompts (`ab+cd=`), temperature 1, median of 3 calls after a warm-up; weight sync = the
trainer's full fp32 state dict loaded into the generator, median of 3.

| model | backend | sequences x max new tokens | generated tokens/s | weight sync (ms) |
|---|---|---|---|---|
{table}

## Weight transfer to a dedicated generator

Policy rank 0 -> generator over novarl's gloo weight-transfer group (two processes on this
host), full fp32 weights, median of 3 after a warm-up; loading them into the engine is the
"weight sync" column above.

| model | MB per update | transfer (ms) | GB/s |
|---|---|---|---|
{bridge_rows}

## GRPO step (seconds)

Tiny model: the demo recipe (64 prompts x 8, up to 4 new tokens), median of steps 6-40.
~100M model: 4 prompts x 4, up to 32 new tokens, micro-batch 16, median of steps 3-6.

| model | generation | generation | logprobs | training | weight sync | step |
|---|---|---|---|---|---|---|
{step_rows}
"""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    print(report)


if __name__ == "__main__":
    main()
