"""Code-execution rewards: what the sandbox costs per program, and programs scored per second.

    .venv/bin/python benchmarks/bench_rewards.py [--out benchmarks/results/rewards_cpu.md]

1. Start-up: a bare `python -c pass` (this interpreter, with its site-packages: what a program run
   with plain subprocess costs) against one program through the sandbox (novarl/rewards/sandbox.py:
   namespaces, read-only host files, tmpfs folder, limits; the runner forks the program), with and
   without namespaces (reward.sandbox.isolate). Median of N sequential runs, alternated.
2. Throughput: `code_tests` scoring a batch of short programs (an a + b solution, 3 stdin/stdout
   tests each: 3 runs of the program per completion, as in ROLL's data) with reward.sandbox.workers
   = 2, and the same batch of assert-style tests (1 run each): completions scored per second.
3. Model-based rewards per second (a tiny judge, a tiny reward model) and the share of a GRPO step
   each domain's verifier takes on the bundled tiny model with three domains.
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


def model_rewards(count: int) -> dict[str, float]:
    """Rewards per second of the tiny judge (the bundled tiny-arith answering the yes_no template, 8 new
    tokens, in an HF engine of its own) and of a tiny reward model (tiny-arith's shape with a one-output
    head, random weights), on `count` completions."""
    import tempfile

    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from novarl.models.bundled import BUNDLED_MODELS

    done = [Completion(Prompt(f"{i}+{i}=", [1], str(2 * i), source=f"{i}+{i}="), [1], [0.0], str(2 * i), "stop", 0)
            for i in range(count)]
    out = {}
    judge = RewardScorer.from_spec("llm_judge", settings=RewardConfig(function="llm_judge", judge={
        "model_name": "tiny-arith", "max_new_tokens": 8, "batch_size": 64}))
    judge.score(done[:4])
    t = time.perf_counter()
    judge.score(done)
    out["judge"] = count / (time.perf_counter() - t)
    with tempfile.TemporaryDirectory() as folder:
        source = Path(BUNDLED_MODELS["tiny-arith"])
        torch.manual_seed(0)
        AutoModelForSequenceClassification.from_config(
            AutoConfig.from_pretrained(source, num_labels=1)).save_pretrained(folder)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            Path(folder, name).write_bytes((source / name).read_bytes())
        model = RewardScorer.from_spec("reward_model", settings=RewardConfig(
            function="reward_model", reward_model={"model_name": folder, "batch_size": 64}))
        model.score(done[:4])
        t = time.perf_counter()
        model.score(done)
        out["reward_model"] = count / (time.perf_counter() - t)
    return out


def step_share(steps: int) -> dict[str, float]:
    """A GRPO run on the bundled tiny model with three reward domains (exact match, code tests, the tiny
    judge), 16 prompts x 4 samples a step drawn 8 / 4 / 4: each verifier's seconds and the step's."""
    import tempfile

    from novarl.config import load_config
    from novarl.logging.metrics import read_jsonl
    from novarl.trainer.api import GRPOTrainer

    with tempfile.TemporaryDirectory() as folder:
        rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10, 40) for b in (40, 41)]
        rows += [{"prompt": f"{a}+{b}=", "answer": "", "tag": "code", "tests": [f"assert {a} + {b} == {a + b}"]}
                 for a in range(10, 40) for b in (42, 43)]
        rows += [{"prompt": f"{a}+{b}=", "answer": str(a + b), "tag": "judge"} for a in range(10, 40) for b in (44, 45)]
        data = Path(folder, "train.jsonl")
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        cfg = load_config({
            "policy": {"model_name": "tiny-arith", "generation": {"backend": "hf", "max_new_tokens": 4}},
            "grpo": {"num_prompts_per_step": 16, "num_generations_per_prompt": 4, "max_num_steps": steps,
                     "val_at_start": False, "val_at_end": False},
            "data": {"train_data_path": str(data), "split_validation_size": 0.05,
                     "domain_interleave_probs": {"default": 0.5, "code": 0.25, "judge": 0.25}},
            "reward": {"function": "exact_match", "domains": {
                "code": {"function": "code_tests", "tags": ["code"]},
                "judge": {"function": "llm_judge", "tags": ["judge"]}},
                "judge": {"model_name": "tiny-arith", "max_new_tokens": 8}},
            "checkpointing": {"enabled": False}, "logger": {"log_dir": folder, "progress_bar": False}})
        result = GRPOTrainer(cfg).train()
        records = [r for r in read_jsonl(result.output_dir / "metrics.jsonl") if r["kind"] == "train"][1:]
    mean = lambda key: statistics.mean(r.get(key, 0.0) for r in records)  # noqa: E731
    return {"step": mean("time_step"), "exact_match": mean("domain/default/verifier_seconds"),
            "code_tests": mean("domain/code/verifier_seconds"), "llm_judge": mean("domain/judge/verifier_seconds")}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/rewards_cpu.md"))
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--programs", type=int, default=200)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    start = startup(args.runs)
    stdio = throughput(args.programs, 2, assert_style=False)
    asserts = throughput(args.programs, 2, assert_style=True)
    models = model_rewards(256)
    share = step_share(args.steps)
    overhead_ms = (start["isolated"] - start["bare"]) * 1000
    lines = [
        "# Code-execution rewards: the sandbox's cost and throughput",
        "",
        f"{date.today()}, {cpu_name()} ({os.cpu_count()} cores), Linux {os.uname().release}, run as "
        f"{'root' if os.getuid() == 0 else 'a user'}; the sandbox's isolation here: {start['isolation']}.",
        "",
        f"`.venv/bin/python benchmarks/bench_rewards.py --out {args.out} --runs {args.runs} "
        f"--programs {args.programs} --steps {args.steps}`",
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
        "Model-based rewards, 256 completions in batches of 64, in this process on the CPU:",
        "",
        "| reward | scored / s |",
        "|---|---|",
        f"| `llm_judge`: the bundled tiny-arith (0.3M) as the judge, `yes_no` template, 8 new tokens | "
        f"{models['judge']:.1f} |",
        f"| `reward_model`: a tiny-arith-shaped reward model (one-output head) | {models['reward_model']:.1f} |",
        "",
        f"The share of a step: GRPO on tiny-arith, 16 prompts x 4 samples a step drawn 8 / 4 / 4 from three reward "
        f"domains (exact match, `code_tests`, the tiny judge); mean of steps 2-{args.steps}:",
        "",
        "| | seconds a step | share of the step |",
        "|---|---|---|",
        f"| the whole step | {share['step']:.2f} | 100 % |",
        *(f"| `{name}` (its domain's 16 samples) | {share[name]:.3f} | {100 * share[name] / share['step']:.1f} % |"
          for name in ("exact_match", "code_tests", "llm_judge")),
        "",
        "Reading it:",
        "- The runner starts as `python -I -S` (no site-packages: programs get the standard library unless "
        "reward.sandbox.site_packages is true), sets up its namespaces, then forks each run of the program: one "
        "interpreter start per completion, however many tests it has, and every test still runs in a fresh "
        "process with its own limits.",
        "- The judge and the reward model here are tiny, so these rates are the machinery's, not a real judge's: "
        "a 7B judge generates its answers at the engine's speed (vLLM on its own GPUs, not placed yet).",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
