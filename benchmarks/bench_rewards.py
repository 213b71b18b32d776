"""Code-execution rewards: what the sandbox costs per program, and programs scored per second.

    .venv/bin/python benchmarks/bench_rewards.py [--out benchmarks/results/rewards_cpu.md]

1. Start-up: a bare `python -c pass` (this interpreter, with its site-packages: what a program run
   with plain subprocess costs) against one program through the sandbox (novarl/rewards/sandbox.py:
   namespaces, read-only host files, tmpfs folder, limits; the runner forks the program), with and
   without namespaces (reward.sandbox.isolate). Median of N sequential runs, alternated.
2. Throughput: `code_tests` scoring a batch of short programs (an a + b solution, 3 stdin/stdout
   tests each: 3 runs of the program per completion, as in ROLL's data) with reward.sandbox.workers
   = 2, and the same batch of assert-style tests (1 run each): completions scored per second.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

from models import cpu_name

from novarl.config.sections.data import RewardConfig
from novarl.rewards.sandbox import LocalSandbox, Program
from novarl.rewards.scorer import RewardScorer
from novarl.types import Completion, Prompt

SOLUTION = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
FUNCTION = "```python\ndef add(a, b):\n    return a + b\n```"


def startup(runs: int) -> dict[str, float]:
    bare, isolated, limits_only = [], [], []
    sandboxed, plain = LocalSandbox(), LocalSandbox(isolate=False)
    for _ in range(runs):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        bare.append(time.perf_counter() - t)
        t = time.perf_counter()
        outcome = sandboxed.run(Program("pass"))
        isolated.append(time.perf_counter() - t)
        t = time.perf_counter()
        plain.run(Program("pass"))
        limits_only.append(time.perf_counter() - t)
    return {"bare": statistics.median(bare), "isolated": statistics.median(isolated),
            "limits": statistics.median(limits_only), "isolation": outcome.isolation}


def completions(count: int, assert_style: bool) -> list[Completion]:
    made = []
    for i in range(count):
        if assert_style:
            columns = {"tests": [f"assert add({i}, {j}) == {i + j}" for j in range(3)]}
            text = FUNCTION
        else:
            columns = {"test_cases": json.dumps([{"stdin": f"{i} {j}", "expected_stdout": str(i + j)}
                                                 for j in range(3)]), "case_type": "input"}
            text = SOLUTION
        made.append(Completion(Prompt("p", [1], None, columns=columns), [1], [0.0], text, "stop", 0))
    return made


def throughput(count: int, workers: int, assert_style: bool) -> dict[str, float]:
    settings = RewardConfig(function="code_tests", sandbox={"workers": workers})
    scorer = RewardScorer.from_spec("code_tests", settings=settings)
    batch = completions(count, assert_style)
    scorer.score(batch[:workers])  # warm-up
    t = time.perf_counter()
    rewards = scorer.score(batch)
    seconds = time.perf_counter() - t
    assert rewards == [1.0] * count, rewards
    return {"seconds": seconds, "per_second": count / seconds}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/rewards_cpu.md"))
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--programs", type=int, default=200)
    args = parser.parse_args()
    start = startup(args.runs)
    stdio = throughput(args.programs, 2, assert_style=False)
    asserts = throughput(args.programs, 2, assert_style=True)
    overhead_ms = (start["isolated"] - start["bare"]) * 1000
    lines = [
        "# Code-execution rewards: the sandbox's cost and throughput",
        "",
        f"{date.today()}, {cpu_name()} ({os.cpu_count()} cores), Linux {os.uname().release}, run as "
        f"{'root' if os.getuid() == 0 else 'a user'}; the sandbox's isolation here: {start['isolation']}.",
        "",
        f"`.venv/bin/python benchmarks/bench_rewards.py --out {args.out} --runs {args.runs} "
        f"--programs {args.programs}`",
        "",
        f"Start-up, median of {args.runs} sequential runs each (alternated):",
        "",
        "| one program | ms |",
        "|---|---|",
        f"| bare `python -c pass` (subprocess, site-packages loaded) | {start['bare'] * 1000:.1f} |",
        f"| sandbox, namespaces (the default) | {start['isolated'] * 1000:.1f} |",
        f"| sandbox, limits only (isolate: false) | {start['limits'] * 1000:.1f} |",
        "",
        f"The sandbox adds **{overhead_ms:+.1f} ms** per program over a bare `python -c` start (target: <= 50 ms).",
        "",
        f"Throughput, `code_tests` on {args.programs} completions, reward.sandbox.workers = 2:",
        "",
        "| tests | runs per completion | seconds | completions scored / s |",
        "|---|---|---|---|",
        f"| stdin/stdout, 3 cases | 3 | {stdio['seconds']:.2f} | **{stdio['per_second']:.1f}** |",
        f"| assert-style, 3 asserts | 1 | {asserts['seconds']:.2f} | **{asserts['per_second']:.1f}** |",
        "",
        "Target: >= 20 short programs scored per second on 2 cores.",
        "",
        "Reading it:",
        "- The runner starts as `python -I -S` (no site-packages: programs get the standard library unless "
        "reward.sandbox.site_packages is true), sets up its namespaces, then forks each run of the program: one "
        "interpreter start per completion, however many tests it has, and every test still runs in a fresh "
        "process with its own limits.",
        "- Judge and reward-model rewards, and the share of a step the rewards take on a bundled task, are not "
        "measured yet (issue 34's model-based rewards are not built).",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
