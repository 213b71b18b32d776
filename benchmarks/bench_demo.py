"""The demo (`novarl train` on the bundled recipe) end to end, on an idle and on a loaded machine.

    .venv/bin/python benchmarks/bench_demo.py [--runs 2] [--load 2] [--out benchmarks/results/demo_cpu.md]

Runs the command `make demo` runs, `--runs` times with the machine as it is and
`--runs` times beside `--load` busy processes (one spinning core each, a stand-in
for a shared or slower machine), one after the other, and reports for each run the
held-out greedy accuracy before and after, the steps trained, the wall time of the
command and of the training loop. The demo is sized by steps, so load should change
the time, not the result.
"""

from __future__ import annotations

import argparse
import multiprocessing
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

from models import cpu_name  # noqa: E402 -- run from this folder or as a script

NOVARL = Path(sys.executable).with_name("novarl")
RESULT = re.compile(r"accuracy: before ([\d.]+)% -> after ([\d.]+)% \((\d+)")


def spin() -> None:
    while True:
        pass


def run_demo(log_dir: Path) -> dict[str, float]:
    start = time.perf_counter()
    proc = subprocess.run([str(NOVARL), "train", f"logger.log_dir={log_dir}", "logger.progress_bar=false"],
                          capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"the demo failed:\n{proc.stderr[-3000:]}")
    match = RESULT.search(proc.stdout)
    if match is None:
        raise SystemExit(f"no result line in the demo's output:\n{proc.stdout}")
    before, after, steps = float(match.group(1)), float(match.group(2)), int(match.group(3))
    loop = sum(float(t) for t in re.findall(r'"time_step": ([\d.e-]+)', next(log_dir.glob("exp_*/metrics.jsonl"))
                                            .read_text()))
    return {"before": before, "after": after, "steps": steps, "wall_s": wall, "loop_s": loop,
            "stderr_lines": len(proc.stderr.splitlines())}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=2, help="runs per condition")
    parser.add_argument("--load", type=int, default=2, help="busy processes beside the loaded runs")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "demo_cpu.md")
    args = parser.parse_args()

    rows = []
    for condition in ("idle", f"{args.load} busy processes"):
        spinners = []
        if condition != "idle":
            spinners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.load)]
            for p in spinners:
                p.start()
        try:
            for i in range(args.runs):
                with tempfile.TemporaryDirectory() as tmp:
                    row = run_demo(Path(tmp))
                rows.append((condition, row))
                print(condition, row, flush=True)
        finally:
            for p in spinners:
                p.kill()
    afters = [r["after"] for _, r in rows]
    table = "\n".join(
        f"| {c} | {r['before']:.1f}% | {r['after']:.1f}% | {r['steps']} | {r['loop_s']:.0f} s | {r['wall_s']:.0f} s | "
        f"{r['stderr_lines']} |" for c, r in rows)
    report = f"""# The demo, end to end

- date: {date.today()}
- machine: {cpu_name()}, {multiprocessing.cpu_count()} cores
- command: `.venv/bin/python benchmarks/bench_demo.py --runs {args.runs} --load {args.load}` (each run is
  `novarl train logger.progress_bar=false`, what `make demo` runs, with the environment already built)
- workload: the bundled recipe: tiny-arith (298k parameters), 600 GRPO steps of 64 prompts x 8 samples,
  the generation backend novarl picks for it, greedy evaluation on the 1,000 held-out prompts every 100 steps

| machine | held-out before | after | steps | training loop | command wall time | stderr lines |
|---|---|---|---|---|---|---|
{table}

Held-out greedy accuracy after the demo: {min(afters):.1f}-{max(afters):.1f}% (median {statistics.median(afters):.1f}%)
over {len(rows)} runs. "stderr lines" counts everything the run printed there: novarl's `[novarl]` lines
(progress bar off), and any third-party output.
"""
    args.out.write_text(report)
    print(report)


if __name__ == "__main__":
    main()
