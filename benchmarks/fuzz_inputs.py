"""The large fuzz of bad input: tests/test_fuzz.py's generators at full size, and ~100 `train` runs.

    .venv/bin/python benchmarks/fuzz_inputs.py [--mutations 300] [--train-runs 100] [--seed 0]
                                               [--out benchmarks/results/reliability.md]

Part 1, `validate` and `plan`: every bad value listed for every setting of the schema
(not a sample of them, as in the test), the YAML / key, override, data, prompt-file,
model-folder and reward-function cases, key paths (dotted overrides up to 100,000 levels
deep, unknown names under `env`), and `--mutations` random one-byte edits of the bundled
recipe. The cases run in-process (`novarl.cli.main`, as a user's shell would call it
but without the interpreter start) in a worker process that the driver kills and replaces
when a case runs past twice its limit: that case counts as a hang.

Part 2, `train` in a subprocess each (`python -m novarl train`, a tiny workload of 2 steps):
the test's train cases, the bad model folders, rewards and data files of part 1 through
`train`, then random combinations of extreme but valid settings (temperatures, learning
rates, clip ranges, seeds, batch shapes) up to `--train-runs` runs in all.

Each case is counted by its exit code; a traceback on stderr, an exit code other than 0 or 2,
a run past its limit, or an exit other than the one the case expects (0 for valid input, 2
for bad; either for random edits and random settings) is listed by name.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import platform
import queue
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models import cpu_name  # noqa: E402
from tests.test_fuzz import (CONFIG_LIMIT_S, TRAIN, Case, all_cases, base_args, data_cases, model_cases,  # noqa: E402
                             model_folder, overrides, refused_at_load, reward, reward_cases, train_cases)

KILL_NINE_HEADING = "## Kill -9 resume trials"


# ============================================================ part 1: in-process, in a worker
def key_path_cases(rng: random.Random) -> list[Case]:
    """Dotted key paths past the nesting limit (64 levels), alone and with a nested value, and
    names under `env` that NeMo RL does not have: each refused naming it; NeMo RL's own
    environments are accepted (said in a warning)."""
    cases = [Case(f"key-path:{depth}-levels", overrides(".".join(["a"] * depth) + "=1"), 2, limit_s=CONFIG_LIMIT_S,
                  says=f"the key path has {depth:,} levels")
             for depth in (65, 100, 1000, 5000, 100_000)]
    cases += [Case(f"key-path:{prefix}-x-{depth}-levels", overrides(".".join([prefix] * depth) + "=1"), 2,
                   limit_s=CONFIG_LIMIT_S, says="levels")
              for prefix in ("policy", "grpo.seed", "env") for depth in (65, 5000)]
    cases.append(Case("key-path:60-levels-with-a-nested-value",
                      overrides(".".join(["a"] * 60) + "={b: {c: {d: {e: {f: 1}}}}}"), 2, limit_s=CONFIG_LIMIT_S,
                      says="nested more than 64 levels deep"))
    letters = "abcdefghijklmnopqrstuvwxyz_"
    names = ["zz_unknown_key", "maht", "Math", "math_", "MATH", "code_", "nemo-gym", "", *(
        "".join(rng.choice(letters) for _ in range(rng.randrange(1, 12))) for _ in range(20))]
    cases += [Case(f"env:unknown-{name or 'empty'}", overrides(f"env.{name}.num_workers=1" if name else "env.=1"), 2,
                   limit_s=CONFIG_LIMIT_S, says=f"env.{name}" if name else "") for name in names]
    cases += [Case(f"env:{item}", overrides(item), 2, limit_s=CONFIG_LIMIT_S, says=key) for item, key in (
        ("env.zz_unknown_key=1", "env.zz_unknown_key"), ("env.math.zz=1", "env.math.zz"),
        ("env.code.enabled=true", "env.code"), ("env=[1]", "env"), ("env.math=3", "env.math"))]
    cases += [Case(f"env-valid:{name}", overrides(f"env.{name}.num_workers=1"), 0) for name in ("dapo", "code", "vlm")]
    return cases


def part1_cases(seed: int, mutations: int) -> list[Case]:
    """The test's cases at full size, the key paths, and `plan` on each model folder (plan reads
    config.json only: a folder with damaged weights may plan fine, so either exit code is right)."""
    plans = [Case(f"plan:{c.id}", c.make, None, "plan", c.limit_s) for c in model_cases()]
    return [*all_cases(per_field=99, mutations=mutations, seed=seed), *key_path_cases(random.Random(seed)), *plans]


def run_worker(start: int, seed: int, mutations: int) -> None:
    """Run cases[start:] in this process, one JSON line per case on stdout ("start" before it)."""
    from novarl.cli import main

    cases = part1_cases(seed, mutations)
    out = sys.__stdout__
    for index in range(start, len(cases)):
        case = cases[index]
        out.write(json.dumps({"start": index}) + "\n")
        out.flush()
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp) / "case"
            folder.mkdir()
            argv = [case.command, *base_args(folder), *case.make(folder)]
            err, began = io.StringIO(), time.monotonic()
            try:
                with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
                    code = main(argv)
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else 1
            except BaseException as exc:  # noqa: BLE001 -- what escapes main() is what this counts
                code, err = 1, io.StringIO(f"Traceback (escaped main): {type(exc).__name__}: {exc}")
            seconds = time.monotonic() - began
        text = err.getvalue()
        text = text if len(text) < 4000 else f"{text[:2000]}\n...\n{text[-2000:]}"
        out.write(json.dumps({"index": index, "code": code, "seconds": seconds, "stderr": text}) + "\n")
        out.flush()


def run_part1(seed: int, mutations: int) -> list[dict]:
    cases = part1_cases(seed, mutations)
    results: list[dict] = []
    index = 0
    while index < len(cases):
        proc = subprocess.Popen([sys.executable, __file__, "--worker", str(index), "--seed", str(seed),
                                 "--mutations", str(mutations)], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=forward_lines, args=(proc, lines), daemon=True).start()
        current = None
        while True:
            limit = 2 * cases[current].limit_s + 10 if current is not None else 300
            try:
                line = lines.get(timeout=limit)
            except queue.Empty:  # the case runs past twice its limit
                proc.kill()
                results.append(outcome(cases[current], None, limit, "", hang=True))
                index = current + 1
                break
            if line is None:  # the worker ended: all done, or it died in `current`
                proc.wait()
                if current is not None:
                    results.append(outcome(cases[current], proc.returncode, 0.0, "(the worker process died)"))
                    index = current + 1
                else:
                    index = len(cases)
                break
            record = json.loads(line)
            if "start" in record:
                current = record["start"]
                continue
            results.append(outcome(cases[record["index"]], record["code"], record["seconds"], record["stderr"]))
            current = None
            if len(results) % 100 == 0:
                print(f"part 1: {len(results)}/{len(cases)} cases", file=sys.stderr, flush=True)
    return results


def forward_lines(proc: subprocess.Popen, lines: queue.Queue) -> None:
    """The worker's stdout, line by line, then None when it closes."""
    for line in proc.stdout:
        lines.put(line)
    lines.put(None)


def outcome(case: Case, code: int | None, seconds: float, stderr: str, *, hang: bool = False) -> dict:
    """One case's result and everything wrong with it (empty when it kept the contract)."""
    problems = []
    if hang:
        problems.append("hang")
    if "Traceback" in stderr:
        problems.append("traceback")
    if code is not None and code not in (0, 2):
        problems.append(f"exit {code}")
    elif code is not None and case.expect is not None and code != case.expect:
        problems.append(f"exit {code}, expected {case.expect}")
    if code is not None and not hang and seconds > case.limit_s:
        problems.append(f"{seconds:.1f} s > {case.limit_s:g} s")
    if code == 2 and "novarl: error: " not in stderr:
        problems.append("no 'novarl: error:' message")
    error = stderr.find("novarl: error: ")
    lines = stderr[error:].splitlines() if error >= 0 else stderr.strip().splitlines()[-1:]
    last = " ".join(line.strip() for line in lines[:3])
    return {"id": case.id, "command": case.command, "code": code, "seconds": round(seconds, 2),
            "problems": problems, "last_line": last[:300]}


# ============================================================ part 2: train, in subprocesses
EXTREMES: dict[str, tuple[str, ...]] = {
    "policy.generation.temperature": ("1e-30", "1e-6", "1e6", "1e30"),
    "policy.generation.top_p": ("1e-30", "0.5"),
    "policy.generation.top_k": ("1", "1000000"),
    "policy.generation.max_new_tokens": ("1", "200"),
    "policy.max_seq_length": ("8", "64", "100000"),
    "policy.optimizer.kwargs.lr": ("0", "1e-30", "10", "1e30", "-1"),
    "policy.max_grad_norm": ("0", "1e-30", "1e30", "null"),
    "loss_fn.reference_policy_kl_penalty": ("1e-9", "1e30"),
    "loss_fn.kl_estimator": ("k1", "k2"),
    "loss_fn.ratio_clip_min": ("0", "0.999"),
    "loss_fn.ratio_clip_max": ("0", "1e30"),
    "loss_fn.ratio_clip_c": ("1.0000001", "1e30"),
    "loss_fn.token_level_loss": ("false",),
    "grpo.seed": ("-1", "0", str(2**63 - 1)),
    "grpo.num_generations_per_prompt": ("1", "32"),
    "grpo.normalize_rewards": ("false",),
    "grpo.use_leave_one_out_baseline": ("true",),
    "grpo.overlong_filtering": ("true",),
    "policy.generation.stop_token_ids": ("[2]", f"[{', '.join(map(str, range(19)))}]"),
    "policy.precision": ("bfloat16", "float16"),
    "policy.train_micro_batch_size": ("1", "1000"),
    "policy.logprob_batch_size": ("1", "1000"),
    "grpo.max_val_samples": ("1",),
    "grpo.val_at_end": ("true",),
}


def train_specs(count: int, rng: random.Random) -> list[Case]:
    """The train runs: fixed cases first, random extreme settings to make up `count`."""
    def through_train(case: Case, limit_s: float = 120) -> Case:
        return Case(f"train:{case.id}", lambda folder, make=case.make: [*TRAIN, *make(folder)], case.expect,
                    "train", limit_s, case.says)

    fixed = [*train_cases(), *(through_train(c) for c in model_cases()),
             *(through_train(c) for c in reward_cases() if c.id.partition(":")[2] in
               ("raises", "nan", "huge", "over_float32", "sleeps", "string", "ok", "at_limit")),
             *(through_train(c) for c in data_cases() if c.id.partition(":")[2] in
               ("invalid-json", "prompt-int", "non-utf8", "too-few-prompts", "answer-nan", "positional"))]
    fixed += [Case(f"train:reward:{fn}", lambda f, fn=fn: [*TRAIN, *reward(fn)(f)], 2, "train", 120)
              for fn in ("late_nan", "late_huge", "late_sleep")]
    two_ranks = ["cluster.gpus_per_node=2", "policy.train_micro_batch_size=4", "policy.logprob_batch_size=4"]
    fixed.insert(0, Case("train:2-ranks:weights-refused-on-the-ray-ranks",  # the UserError crosses back from Ray
                         lambda f: [*TRAIN, *two_ranks, *model_folder(refused_at_load)(f)], 2, "train", 180,
                         says="Cannot load model"))
    cases = fixed[:count]
    for i in range(count - len(cases)):
        picked = rng.sample(sorted(EXTREMES), 3)
        settings = [f"{key}={rng.choice(EXTREMES[key])}" for key in picked]
        cases.append(Case(f"train-extreme:{i}:{' '.join(settings)}",
                          lambda f, s=settings: [*TRAIN, "grpo.max_num_steps=4", *s], None, "train", 180))
    return cases


def run_part2(cases: list[Case]) -> list[dict]:
    results = []
    for number, case in enumerate(cases, start=1):
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp) / "case"
            folder.mkdir()
            argv = [sys.executable, "-m", "novarl", case.command, *base_args(folder), *case.make(folder)]
            began = time.monotonic()
            try:
                proc = subprocess.run(argv, cwd=folder, capture_output=True, text=True, timeout=2 * case.limit_s + 10)
                results.append(outcome(case, proc.returncode, time.monotonic() - began, proc.stderr))
            except subprocess.TimeoutExpired as timeout:
                stderr = timeout.stderr.decode(errors="replace") if isinstance(timeout.stderr, bytes) else ""
                results.append(outcome(case, None, time.monotonic() - began, stderr, hang=True))
        print(f"part 2: {number}/{len(cases)} runs, {case.id[:100]}: {results[-1]['code']} "
              f"{' '.join(results[-1]['problems'])}", file=sys.stderr, flush=True)
    return results


# ============================================================ report
def summary(results: list[dict]) -> dict:
    codes = Counter("hang" if r["code"] is None else r["code"] for r in results)
    return {"cases": len(results), "codes": dict(sorted(codes.items(), key=str)),
            "tracebacks": sum("traceback" in r["problems"] for r in results),
            "hangs": sum("hang" in r["problems"] for r in results),
            "off_contract": [r for r in results if r["problems"]],
            "max_seconds": max((r["seconds"] for r in results), default=0.0)}


def table(part: str, s: dict) -> str:
    codes = ", ".join(f"exit {code}: {n}" for code, n in s["codes"].items())
    return (f"| {part} | {s['cases']} | {codes} | {s['tracebacks']} | {s['hangs']} | {len(s['off_contract'])} | "
            f"{s['max_seconds']:.1f} |")


def listing(s: dict) -> str:
    if not s["off_contract"]:
        return "none\n"
    return "".join(f"- `{r['id'][:120]}`: {', '.join(r['problems'])} -- {r['last_line'][:240]}\n"
                   for r in s["off_contract"])


def report(args: argparse.Namespace, part1: dict, part2: dict, seconds: float) -> str:
    import os

    import torch
    import transformers

    command = (f".venv/bin/python benchmarks/fuzz_inputs.py --mutations {args.mutations} "
               f"--train-runs {args.train_runs} --seed {args.seed}")
    return f"""# Reliability: bad input

## Fuzz of bad input (`benchmarks/fuzz_inputs.py`)

- date: {date.today()}
- machine: {cpu_name()}, {os.cpu_count()} cores (shared), {platform.system()} {platform.machine()}, no GPU used
- software: Python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}
- command: `{command}` ({seconds / 60:.0f} minutes)
- contract: bad input ends with `novarl: error: <one paragraph>` on stderr, exit code 2, no traceback, within
  the case's time limit, nothing already written lost; valid input exits 0. `tests/test_fuzz.py` runs the same
  generators smaller (one case per setting and value kind sampled, 30 edits, 6 train runs) in the suite.

| part | cases | exit codes | tracebacks | hangs | off contract | slowest case (s) |
|---|---|---|---|---|---|---|
{table("validate / plan, in-process", part1)}
{table("train, one subprocess each", part2)}

Part 1: every bad value of every setting in the schema (wrong type, inf / nan, below its bound, over 64 bits,
path names over 255 bytes), YAML keys that are null / booleans / numbers, nesting up to 100,000 deep, a
billion-laughs alias bomb and its `${{...}}` twin, malformed overrides, data rows and files, prompt templates,
model folders (no config.json, damaged or mismatched config.json, empty / garbage / truncated safetensors,
tokenizer files), reward functions that raise, return nan / inf / 1e308 / strings / None, sleep, spin,
backtrack, `plan --gpu-memory-gb nan / inf / 0 / -1`, `plan` on each bad model folder, dotted override
paths 65 to 100,000 levels deep, names under `env` NeMo RL does not have (misspellings and random ones), and
{args.mutations} random one-byte edits of the bundled recipe.
Part 2: the bad model folders, rewards and data through `train` (2 steps, 4 prompts x 2
samples), rewards that turn bad only inside the first step, and random combinations of extreme but valid
settings (4 steps); the time of each run includes the interpreter and torch start (5-10 s here).

### Cases off contract, part 1

{listing(part1)}
### Cases off contract, part 2

{listing(part2)}
"""


def write_report(path: Path, text: str) -> None:
    """Write `text`, keeping the kill -9 section another benchmark fills in."""
    kept = f"{KILL_NINE_HEADING}\n\n(filled by the checkpoint work)\n"
    if path.is_file() and KILL_NINE_HEADING in path.read_text():
        old = path.read_text()
        kept = old[old.index(KILL_NINE_HEADING):]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{text}\n{kept}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mutations", type=int, default=300, help="random one-byte edits of the bundled recipe")
    parser.add_argument("--train-runs", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "reliability.md")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        run_worker(args.worker, args.seed, args.mutations)
        return
    began = time.monotonic()
    part1 = summary(run_part1(args.seed, args.mutations))
    part2 = summary(run_part2(train_specs(args.train_runs, random.Random(args.seed))))
    text = report(args, part1, part2, time.monotonic() - began)
    write_report(args.out, text)
    print(text)


if __name__ == "__main__":
    main()
