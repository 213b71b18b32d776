"""The bundled tasks' results: examples/configs/grpo_tiny_math.yaml (the math-style task) or, with
`--task tools`, examples/configs/grpo_tiny_tools.yaml (the multi-turn tool task), as shipped.

    .venv/bin/python benchmarks/bench_tiny_math.py [--out benchmarks/results/tiny_math_cpu.md]
    .venv/bin/python benchmarks/bench_tiny_math.py --task tools [--out benchmarks/results/agents_cpu.md]

Runs the recipe (Hugging Face generation, one process) and reports the held-out greedy accuracy at
every evaluation, the gain, and the wall time. The issues' targets: +20 points on CPU (the tool task:
within 10 minutes).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from datetime import date
from pathlib import Path

from models import cpu_name
from novarl.config import load_config
from novarl.logging.metrics import read_jsonl
from novarl.trainer.api import GRPOTrainer

CONFIGS = Path(__file__).resolve().parents[1] / "examples" / "configs"
TASKS = {
    "math": (CONFIGS / "grpo_tiny_math.yaml", "tiny_math_cpu.md", "The bundled math-style task",
             "word problems x {samples} samples, tiny-math, reward math_verify", "the 1,000 validation problems, the "
             "answer checked by math-verify", "+20 points"),
    "tools": (CONFIGS / "grpo_tiny_tools.yaml", "agents_cpu.md", "The bundled tool task",
              "products x {samples} episodes of up to 2 turns in the tool environment (multiply), tiny-tools",
              "the 1,000 validation products, greedy episodes (a tool call, its answer, the model's answer), exact "
              "match", "+20 points in 10 minutes"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=sorted(TASKS), default="math")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    recipe, results, title, what, measured, target = TASKS[args.task]
    out = args.out or Path(__file__).parent / "results" / results
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(recipe, overrides=[f"logger.log_dir={tmp}", "logger.progress_bar=false",
                                             "policy.generation.backend=hf"])
        start = time.perf_counter()
        result = GRPOTrainer(cfg).train()
        seconds = time.perf_counter() - start
        evals = [(r["step"], r["accuracy"]) for r in read_jsonl(result.output_dir / "metrics.jsonl")
                 if r["kind"] == "eval"]
    gain = 100 * (result.final_accuracy - result.initial_accuracy)
    command = "benchmarks/bench_tiny_math.py" + ("" if args.task == "math" else f" --task {args.task}")
    lines = [f"# {title} ({date.today()}, {cpu_name()}, {os.cpu_count()} cores)", "",
             f"`.venv/bin/python {command}`: `examples/configs/{recipe.name}` as shipped "
             f"({cfg.grpo.max_num_steps} GRPO steps of {cfg.grpo.num_prompts_per_step} "
             f"{what.format(samples=cfg.grpo.num_generations_per_prompt)}, Hugging Face generation, one process); "
             f"held-out greedy accuracy on {measured}.", "",
             "| step | held-out accuracy |", "|---:|---:|"]
    lines += [f"| {step} | {accuracy:.1%} |" for step, accuracy in evals]
    lines += ["", f"Gain: {gain:+.1f} points ({result.initial_accuracy:.1%} -> {result.final_accuracy:.1%}) in "
              f"{seconds / 60:.1f} minutes (target: {target}).", ""]
    out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
