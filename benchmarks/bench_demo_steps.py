"""Time the demo's GRPO steps on this machine.

    .venv/bin/python benchmarks/bench_demo_steps.py [--steps 100] [--out benchmarks/results/demo_steps.md]

Runs the bundled default recipe (tiny-arith, 64 prompts x 8 samples, 4 new
tokens) without evaluation and reports, from the run's metrics.jsonl: median
seconds per step and per phase, generation tokens per second (generated
tokens / generation time) and training tokens per second (prompt + completion
tokens through forward + backward / training time).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
from datetime import date
from pathlib import Path

import torch

from models import cpu_name
from novarl.cli import BUNDLED_RECIPE
from novarl.config import load_config
from novarl.logging.metrics import read_jsonl
from novarl.trainer.api import GRPOTrainer

PHASES = ("generation", "logprobs", "training", "weight_sync", "step")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out of the medians")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "demo_steps.md")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(BUNDLED_RECIPE, overrides=[
            f"grpo.max_num_steps={args.steps}", "grpo.max_train_seconds=null", "grpo.val_at_start=false",
            "grpo.val_at_end=false", "grpo.val_period=0", f"logger.log_dir={tmp}", "logger.progress_bar=false",
            f"logger.print_every_n_steps={args.steps}"])
        result = GRPOTrainer(cfg).train()
        steps = [r for r in read_jsonl(result.output_dir / "metrics.jsonl") if r["kind"] == "train"]
    steps = steps[args.warmup:]
    med = {p: statistics.median(r[f"time_{p}"] for r in steps) for p in PHASES}
    gen_tps = sum(r["tokens_generated"] for r in steps) / sum(r["time_generation"] for r in steps)
    train_tps = sum(r["tokens_total"] for r in steps) / sum(r["time_training"] for r in steps)
    rows = "\n".join(f"| {p} | {med[p]:.4f} |" for p in PHASES)
    report = f"""# Demo GRPO step timings

- date: {date.today()}
- machine: {cpu_name()}, {torch.get_num_threads()} torch threads, {platform.system()} {platform.machine()}
- software: torch {torch.__version__}, Python {platform.python_version()}
- command: `.venv/bin/python benchmarks/bench_demo_steps.py --steps {args.steps}`
- workload: bundled recipe (tiny-arith, 297,984 parameters, fp32), 64 prompts x 8 samples = 512 sequences
  per step, <= 4 new tokens, DTensor/FSDP2 world size 1 + Hugging Face generation; medians over steps
  {args.warmup + 1}-{args.steps}

| phase | median seconds per step |
|---|---|
{rows}

- generation: {gen_tps:,.0f} generated tokens/s
- training (forward + backward + optimizer): {train_tps:,.0f} tokens/s (prompt + completion tokens)
"""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    print(report)


if __name__ == "__main__":
    main()
