"""Asynchronous vs synchronous GRPO with dedicated generation, side by side in one run.

    .venv/bin/python benchmarks/bench_async.py [--steps 600] [--out benchmarks/results/async_cpu.md]
        [--extra key=value ...] [--append]

The bundled recipe (tiny-arith, 64 prompts x 8 samples a step, Hugging Face generation) on 2 Ray
ranks of one CPU each: the policy on one, a dedicated generation engine on the other. The
synchronous run generates, then trains; the asynchronous ones (grpo.async_grpo.enabled, with the
importance-sampling correction) let the engine run 1 and 2 steps ahead of training
(max_trajectory_age_steps). Reported: the loop's steps per minute (the sum of the steps' wall
time, evaluations excluded), each asynchronous run's ratio to the synchronous one (the issue's
target: >= 1.4x where generation and training take similar time), the engine's generation time
per step, the trainer's wait for rollouts and the engine's idle time (asynchronous runs), the
training time, and the held-out greedy accuracy after the same number of steps (target: within 3
points of the synchronous run).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from datetime import date
from pathlib import Path

from models import cpu_name
from novarl.cli import BUNDLED_RECIPE
from novarl.config import load_config
from novarl.trainer.api import GRPOTrainer

DEDICATED = ["cluster.gpus_per_node=2", "policy.generation.colocated.enabled=false",
             "policy.generation.colocated.resources.gpus_per_node=1", "policy.generation.backend=hf"]
ASYNC = ["grpo.async_grpo.enabled=true", "loss_fn.use_importance_sampling_correction=true"]
RUNS: dict[str, list[str]] = {
    "synchronous": [],
    "asynchronous, 1 step ahead": [*ASYNC, "grpo.async_grpo.max_trajectory_age_steps=1"],
    "asynchronous, 2 steps ahead": [*ASYNC, "grpo.async_grpo.max_trajectory_age_steps=2"],
}


def run(name: str, steps: int, folder: Path, extra: list[str]) -> dict:
    overrides = [f"grpo.max_num_steps={steps}", "logger.progress_bar=false", f"logger.log_dir={folder}",
                 *DEDICATED, *extra, *RUNS[name]]
    start = time.perf_counter()
    result = GRPOTrainer(load_config(BUNDLED_RECIPE, overrides=overrides)).train()
    records = [json.loads(line) for line in (result.output_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    loop = sum(r["time_step"] for r in train)
    return {"name": name, "overrides": [*extra, *RUNS[name]], "steps": len(train), "loop_seconds": loop,
            "steps_per_minute": 60 * len(train) / loop, "before": result.initial_accuracy,
            "after": result.final_accuracy, "wall_seconds": time.perf_counter() - start,
            **{key: sum(r.get(f"time_{key}", 0.0) for r in train) / len(train)
               for key in ("generation", "rollout_wait", "generator_idle", "training")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "async_cpu.md")
    parser.add_argument("--extra", nargs="*", default=[], help="overrides for both runs (a workload)")
    parser.add_argument("--append", action="store_true", help="add the rows and ratio to --out instead of rewriting it")
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(RUNS):
            rows.append(run(name, args.steps, Path(tmp) / str(i), args.extra))
            r = rows[-1]
            print(f"{name}: {r['steps_per_minute']:.1f} steps/min, {r['before']:.1%} -> {r['after']:.1%}", flush=True)
    sync = rows[0]
    ratio = " ".join(f"{r['name'].capitalize()} / synchronous steps per minute: "
                     f"**{r['steps_per_minute'] / sync['steps_per_minute']:.2f}x** (target >= 1.4x), held-out accuracy "
                     f"{100 * (r['after'] - sync['after']):+.1f} points (target: within 3)." for r in rows[1:])
    if args.append and args.out.exists():
        added = [row_line(r) for r in rows]
        args.out.write_text(args.out.read_text().rstrip("\n") + "\n\n" + "\n".join(
            [f"With `{' '.join(args.extra)}`:", "", TABLE_HEAD, TABLE_RULE, *added, "", ratio, ""]))
        print(f"added to {args.out}")
        return
    lines = [f"# Asynchronous GRPO vs synchronous ({date.today()}, {cpu_name()}, {os.cpu_count()} cores)", "",
             f"`.venv/bin/python benchmarks/bench_async.py --steps {args.steps}`: the bundled recipe (tiny-arith, 64 "
             "prompts x 8 samples a step, Hugging Face generation, fp32) on 2 Ray ranks of one CPU each, the policy on "
             "one and a dedicated engine on the other (overrides: " + " ".join(f"`{o}`" for o in DEDICATED) + "). "
             "Steps per minute: the steps' wall time summed (evaluations excluded). Both runs in one process, one "
             "after the other, on the same machine.", "",
             TABLE_HEAD, TABLE_RULE, *(row_line(r) for r in rows),
             "", ratio, "", "'generation': the engine's seconds on a step's rollouts; 'wait': the trainer's wait for "
             "them (asynchronous runs; the synchronous run's generation is all wait); 'idle': the engine's idle "
             "seconds before it started them (waiting for the trainer's weights and prompts).", ""]
    args.out.write_text("\n".join(lines))
    print(f"wrote {args.out}")


TABLE_HEAD = ("| run | overrides | steps/min | generation s/step | wait s/step | idle s/step | training s/step | "
              "held-out before | after | steps |")
TABLE_RULE = "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"


def row_line(r: dict) -> str:
    overrides = " ".join(f"`{o}`" for o in r["overrides"]) or "(the dedicated layout as it is)"
    return (f"| {r['name']} | {overrides} | {r['steps_per_minute']:.1f} | {r['generation']:.3f} | "
            f"{r['rollout_wait']:.3f} | {r['generator_idle']:.3f} | {r['training']:.3f} | {r['before']:.1%} | "
            f"{r['after']:.1%} | {r['steps']} |")


if __name__ == "__main__":
    main()
