"""One forward fewer: the demo's step time with the old logprobs from a separate policy
forward before training, and from the training forward itself (the default when a
generated batch gets one optimizer step).

    .venv/bin/python benchmarks/bench_old_logprobs.py [--steps 40] [--rounds 2] [--out benchmarks/results/old_logprobs_cpu.md]

Runs the bundled recipe (tiny-arith, 64 prompts x 8 samples, <= 4 new tokens, Hugging Face
generation, no evaluation) in a subprocess per path and round, the two paths alternating;
the "separate forward" path is the same code with `novarl.trainer.stages.one_forward_fewer`
made to answer False (what a run with several optimizer steps per batch does). Reports the
median seconds per step and per phase over each run's steps after the first 5, and the
ratio of the two paths' medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import cpu_name  # noqa: E402 -- after the path line above

PHASES = ("generation", "logprobs", "training", "weight_sync", "step")
CHILD = """
import json, sys
import novarl.trainer.grpo as grpo
import novarl.trainer.stages as stages
from novarl.cli import BUNDLED_RECIPE
from novarl.config import load_config
from novarl.logging.metrics import read_jsonl
from novarl.trainer.api import GRPOTrainer
separate, steps, folder = sys.argv[1] == "separate", int(sys.argv[2]), sys.argv[3]
if separate:
    grpo.one_forward_fewer = stages.one_forward_fewer = lambda cfg, inputs: False
cfg = load_config(BUNDLED_RECIPE, overrides=[
    f"logger.log_dir={folder}", "logger.progress_bar=false", f"grpo.max_num_steps={steps}", "grpo.val_period=0",
    "grpo.val_at_start=false", "grpo.val_at_end=false", "policy.generation.backend=hf"])
result = GRPOTrainer(cfg).train()
print(json.dumps([r for r in read_jsonl(result.output_dir / "metrics.jsonl") if r["kind"] == "train"]))
"""


def run(path: str, steps: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as folder:
        out = subprocess.run([sys.executable, "-c", CHILD, path, str(steps), folder], capture_output=True, text=True,
                             check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    records: dict[str, list[dict]] = {"separate": [], "fewer": []}
    for _ in range(args.rounds):
        for path in records:
            records[path].extend(run(path, args.steps)[args.warmup:])
    medians = {path: {phase: statistics.median(r[f"time_{phase}"] for r in rows if f"time_{phase}" in r)
                      for phase in PHASES} for path, rows in records.items()}
    lines = [
        "# One forward fewer: old logprobs from the training forward", "",
        f"- date: {date.today()}; machine: {cpu_name()}, CPU only",
        f"- command: `.venv/bin/python benchmarks/bench_old_logprobs.py --steps {args.steps} --rounds {args.rounds}`",
        f"- workload: bundled recipe (tiny-arith, 64 prompts x 8 samples, <= 4 new tokens), HF generation, one rank; "
        f"{args.rounds} run(s) of {args.steps} steps per path, alternating; medians over each run's steps after "
        f"the first {args.warmup}", "",
        "| phase | separate forward (s) | from the training forward (s) | ratio |", "|---|---|---|---|"]
    for phase in PHASES:
        before, after = medians["separate"][phase], medians["fewer"][phase]
        lines.append(f"| {phase} | {before:.4f} | {after:.4f} | x{after / before:.2f} |")
    mismatch = max(r["logprob_mismatch"] for r in records["fewer"])
    lines += ["", f"- largest logprob_mismatch from the training forward: {mismatch:.2e} (the check still runs)"]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        args.out.write_text(report)


if __name__ == "__main__":
    main()
