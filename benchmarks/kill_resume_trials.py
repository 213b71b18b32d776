"""kill -9 at a random moment, then the same command again: does the run end as the uninterrupted one?

    .venv/bin/python benchmarks/kill_resume_trials.py [--trials 10] [--steps 10] [--seed 0]
        [--out benchmarks/results/reliability.md]

Each trial starts `python -m novarl train` (bundled recipe, Hugging Face generation,
checkpoints every 2 steps) and kills it with SIGKILL after a random delay within the
run's length: during a step, a save, the final evaluation or the export. Then it runs
the same command again and checks: it exits 0; it resumed from a complete checkpoint
(no partial folder was taken for one); the steps it trained equal the uninterrupted
reference run's (reward exactly, loss to 1e-6); the run folder it wrote holds the policy
and the whole history; no temporary folder is left. The figures replace the "Kill -9
resume trials" section of the results file.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

from models import cpu_name  # noqa: E402 -- run from this folder or as a script

SECTION = "## Kill -9 resume trials"


def command(root: Path, steps: int) -> list[str]:
    return [sys.executable, "-m", "novarl", "train", f"logger.log_dir={root / 'logs'}",
            f"checkpointing.checkpoint_dir={root / 'ckpt'}", "checkpointing.enabled=true",
            "checkpointing.save_period=2", "checkpointing.keep_top_k=2", f"grpo.max_num_steps={steps}",
            "grpo.val_at_start=false", "grpo.max_val_samples=100", "policy.generation.backend=hf",
            "logger.progress_bar=false"]


def train_records(run_dir: Path) -> dict[int, dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in records if r["kind"] == "train"}


def newest_run(root: Path) -> Path:
    return max((root / "logs").glob("exp_*"), key=lambda p: int(p.name[4:]))


def trial(root: Path, steps: int, delay: float, reference: dict[int, dict]) -> dict:
    proc = subprocess.Popen(command(root, steps), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(delay)
    killed = proc.poll() is None
    proc.kill()
    proc.wait()
    saved = sorted(int(p.name[5:]) for p in (root / "ckpt").glob("step_*")) if (root / "ckpt").is_dir() else []
    again = subprocess.run(command(root, steps), capture_output=True, text=True)
    out = {"delay_s": delay, "killed": killed, "checkpoints_at_kill": saved, "exit": again.returncode}
    if again.returncode != 0:
        out["error"] = again.stderr.strip().splitlines()[-1] if again.stderr.strip() else "?"
        # Killed after the run had ended (its marker written, the process not yet gone): the same
        # command says so and exits 2 -- that run is not a resume trial.
        out["had_ended"] = "the run that reached it ended" in out["error"]
        return out
    run = newest_run(root)
    got = train_records(run)
    history = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    resumed = [r["step"] for r in history if r["kind"] == "resume"]
    out["resumed_from"] = resumed[-1] if resumed else None
    out["same_as_uninterrupted"] = sorted(got) == sorted(reference) and all(
        got[s]["reward_mean"] == reference[s]["reward_mean"]
        and abs(got[s]["loss"] - reference[s]["loss"]) <= 1e-6 for s in reference)
    out["policy_written"] = (run / "policy" / "model.safetensors").is_file()
    out["temp_left"] = [p.name for p in [*(root / "ckpt").glob(".*"), *run.parent.glob("*/.*")]]
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "reliability.md")
    args = parser.parse_args()
    rng = random.Random(args.seed)

    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        subprocess.run(command(Path(tmp) / "ref", args.steps), check=True, capture_output=True)
        length = time.perf_counter() - start
        reference = train_records(newest_run(Path(tmp) / "ref"))
    rows = []
    for i in range(args.trials):
        with tempfile.TemporaryDirectory() as tmp:
            row = trial(Path(tmp), args.steps, rng.uniform(0.3, 0.95) * length, reference)
        rows.append(row)
        print(i, row, flush=True)

    killed = [r for r in rows if r["killed"] and not r.get("had_ended")]  # an ended run is refused: no trial
    good = [r for r in killed if r["exit"] == 0 and r.get("same_as_uninterrupted") and r.get("policy_written")
            and not r.get("temp_left")]
    table = "\n".join(
        f"| {i} | {r['delay_s']:.1f} s | {'after its end' if r.get('had_ended') or not r['killed'] else 'yes'} | "
        f"{', '.join(f'step_{s}' for s in r['checkpoints_at_kill']) or '-'} | {r['exit']} | "
        f"{r.get('resumed_from') if r.get('resumed_from') is not None else 'fresh'} | "
        f"{'yes' if r.get('same_as_uninterrupted') else 'NO'} | {'yes' if r.get('policy_written') else 'NO'} | "
        f"{', '.join(r.get('temp_left') or []) or 'none'} |" for i, r in enumerate(rows))
    section = f"""{SECTION}

- date: {date.today()}
- machine: {cpu_name()} (shared), no GPU
- command: `.venv/bin/python benchmarks/kill_resume_trials.py --trials {args.trials} --steps {args.steps} --seed {args.seed}`
- each trial: `python -m novarl train` ({args.steps} steps, checkpoints every 2, HF generation) killed with
  SIGKILL after a random 30-95 % of the uninterrupted run's {length:.0f} s, then the same command again

| trial | killed after | killed? | checkpoints at the kill | exit | resumed from step | steps equal the uninterrupted run | policy/ written | temp folders left |
|---|---|---|---|---|---|---|---|---|
{table}

{len(good)} of {len(killed)} killed runs ended as the uninterrupted run: exit 0, the same steps (rewards exactly,
losses to 1e-6), the policy written, no temporary folder left.
"""
    text = args.out.read_text() if args.out.is_file() else ""
    head = text.split(SECTION)[0].rstrip() if SECTION in text else text.rstrip()
    args.out.write_text(f"{head}\n\n\n{section}" if head else section)
    print(section)


if __name__ == "__main__":
    main()
