"""Every policy-gradient algorithm novarl has, on the bundled task, from the same start.

    .venv/bin/python benchmarks/bench_algorithms.py [--steps 600] [--only dapo gspo] \
        [--out benchmarks/results/algorithms_cpu.md]

Runs the bundled recipe (tiny-arith at 27.8 % held-out greedy accuracy, 64 prompts x 8 samples
a step, Hugging Face generation, one process) once per algorithm, each selected by the
overrides in ALGORITHMS and nothing else, and reports the held-out greedy accuracy before
and after, the gain, the steps and the seconds. The issue's bar: +20 points each.
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import date
from pathlib import Path

from models import cpu_name
from novarl.cli import BUNDLED_RECIPE
from novarl.config import load_config
from novarl.trainer.api import GRPOTrainer

ALGORITHMS: dict[str, list[str]] = {
    "GRPO": [],
    "RLOO": ["grpo.adv_estimator.name=rloo"],
    "REINFORCE++ (baseline)": ["grpo.adv_estimator.name=reinforce_plus_plus"],
    "REINFORCE++ (KL in the reward)": ["grpo.adv_estimator.name=reinforce_plus_plus", "loss_fn.use_kl_in_reward=true",
                                       "loss_fn.reference_policy_kl_penalty=0.01"],
    "REINFORCE (no ratio)": ["loss_fn.disable_ppo_ratio=true", "grpo.adv_estimator.name=rloo"],
    "Dr. GRPO": ["grpo.normalize_rewards=false", "loss_fn.loss_agg_mode=seq-mean-token-sum-norm"],
    "GSPO": ["loss_fn.sequence_level_importance_ratios=true", "loss_fn.token_level_loss=false"],
    # DAPO's overlong penalty is left out: the task's answers are 3-4 tokens of a 4-token budget, so any
    # buffer would penalise right answers (it is tested by hand in tests/test_algorithms.py)
    "DAPO": ["loss_fn.ratio_clip_max=0.28", "loss_fn.loss_agg_mode=token-mean", "grpo.use_dynamic_sampling=true",
             "grpo.batch_multiplier=1.5"],
    # a critic with the policy's settings (value: {}), NeMo RL's GAE defaults (gamma 1, lambda 0.95, whitened)
    "PPO (critic, GAE)": ["grpo.adv_estimator.name=gae", "value={}"],
    # CISPO differs from GRPO only where the ratio moves away from 1: with several optimizer steps per batch,
    # beside GRPO in the same setting
    "GRPO (4 updates a batch)": ["policy.train_global_batch_size=128", "policy.train_micro_batch_size=128"],
    "CISPO (4 updates a batch)": ["loss_fn.use_cispo=true", "policy.train_global_batch_size=128",
                                  "policy.train_micro_batch_size=128"],
    "GRPO + VAPO's NLL": ["loss_fn.positive_example_nll_weight=0.1"],
}


def run(name: str, steps: int, folder: Path) -> dict:
    overrides = [f"grpo.max_num_steps={steps}", "logger.progress_bar=false", f"logger.log_dir={folder}",
                 "policy.generation.backend=hf", *ALGORITHMS[name]]
    start = time.perf_counter()
    result = GRPOTrainer(load_config(BUNDLED_RECIPE, overrides=overrides)).train()
    return {"name": name, "before": result.initial_accuracy, "after": result.final_accuracy, "steps": steps,
            "seconds": time.perf_counter() - start, "overrides": ALGORITHMS[name]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--only", nargs="*", help="names from ALGORITHMS (default: all)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "algorithms_cpu.md")
    parser.add_argument("--append", action="store_true", help="add the rows to --out's table instead of rewriting it")
    args = parser.parse_args()
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(args.only or ALGORITHMS):
            rows.append(run(name, args.steps, Path(tmp) / str(i)))
            r = rows[-1]
            print(f"{name}: {r['before']:.1%} -> {r['after']:.1%} ({100 * (r['after'] - r['before']):+.1f} points) "
                  f"in {r['seconds']:.0f} s", flush=True)
    if args.append and args.out.exists():
        lines = args.out.read_text().rstrip("\n").splitlines()
        end = max(i for i, line in enumerate(lines) if line.startswith("| ")) + 1  # after the table's last row
        args.out.write_text("\n".join([*lines[:end], *(row_line(r) for r in rows), *lines[end:], ""]))
        print(f"added {len(rows)} row(s) to {args.out}")
        return
    lines = [f"# Algorithms on the bundled task ({date.today()}, {cpu_name()}, {os.cpu_count()} cores)", "",
             f"`.venv/bin/python benchmarks/bench_algorithms.py --steps {args.steps}`: the bundled recipe (tiny-arith, "
             "64 prompts x 8 samples a step, Hugging Face generation, one process, fp32, lr 4e-4 with warm-up and "
             "decay) "
             "with only each row's overrides; held-out greedy accuracy on the 1,000 held-out sums before and after; "
             "seconds include the two evaluations. Each row is one run with the recipe's seed. The bar: +20 points.",
             "", "| algorithm | overrides | before | after | gain (points) | steps | seconds |",
             "|---|---|---:|---:|---:|---:|---:|"]
    lines += [row_line(r) for r in rows]
    lines.append("")
    args.out.write_text("\n".join(lines))
    print(f"wrote {args.out}")


def row_line(r: dict) -> str:
    overrides = " ".join(f"`{o}`" for o in r["overrides"]) or "(the recipe as it is)"
    return (f"| {r['name']} | {overrides} | {r['before']:.1%} | {r['after']:.1%} | "
            f"{100 * (r['after'] - r['before']):+.1f} | {r['steps']} | {r['seconds']:.0f} |")


if __name__ == "__main__":
    main()
