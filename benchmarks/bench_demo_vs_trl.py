"""novarl's demo recipe against Hugging Face TRL's GRPOTrainer: the same model, data, batch and threads.

    .venv/bin/python benchmarks/bench_demo_vs_trl.py [--steps 40] [--accuracy-steps 300] [--skip-accuracy]
        [--threads 2] [--keep-dir DIR] [--out benchmarks/results/demo_vs_trl_cpu.md]

The workload is the demo's (`novarl train`, novarl/config/recipes/tiny_arith.yaml): the bundled
tiny-arith Llama (298k parameters, character tokenizer), two-digit addition (7,100 train prompts,
1,000 held out), 64 prompts x 8 samples a step (512 completions, one optimizer step: TRL in 2
accumulated micro-batches of 256, novarl as its recipe says, in packed rows with each group's prompt
once), <= 4 new tokens at temperature 1, top_p 1, exact-match reward, group-normalised
advantages, clip 0.2, no KL, token-level loss over the whole step, AdamW 4e-4 with the recipe's
warm-up + linear decay, gradient clipping at 1.0, fp32 on the CPU. TRL (its own virtual environment,
.cache/trl-venv, made on first use with the same torch and transformers versions as .venv) runs
GRPOTrainer with the matching settings in a child process (benchmarks/trl_child.py), generating with
transformers' `generate`. Both get the same number of torch threads (OMP_NUM_THREADS, and
torch.set_num_threads in the TRL child). The runs go one after the other, never at the same time.

1. Speed: `--steps` steps of each, no evaluation; the median seconds per optimizer step after the
   first `--warmup` steps (novarl: `time_step` of metrics.jsonl; TRL: on_step_begin -> on_step_end).
2. Accuracy after the same wall time: TRL trains `--accuracy-steps` steps, taking W seconds (its
   training loop, first step's start to last step's end); novarl then trains with
   grpo.max_train_seconds=W and grpo.max_num_steps set to the steps it can do in W, estimated from
   its speed run: 0.97 x (W - the first step's extra time) / the median step time, rounded down
   (3 % short, so that its learning-rate schedule, sized by max_num_steps, runs to its end before
   the time budget can stop it; the median, not the mean, so that a burst of load on a shared
   machine during the speed run does not shrink it). If novarl then uses less than 90 % of W, or
   the time budget stops it, it runs once more, with 0.97 x the steps that run did x W / the time
   it took, and the second run counts. Both final models, and the bundled model before training,
   are scored by one evaluator, `novarl eval -c <bundled recipe>`: greedy accuracy on the 1,000
   held-out prompts.

Writes nothing outside .cache/trl-venv, a temporary folder (or --keep-dir) and --out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from importlib.metadata import version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import cpu_name  # noqa: E402 -- after the path line above

ROOT = Path(__file__).resolve().parents[1]
NOVARL = Path(sys.executable).with_name("novarl")
RECIPE = ROOT / "novarl" / "config" / "recipes" / "tiny_arith.yaml"
MODEL = ROOT / "novarl" / "models" / "tiny_arith"
TRL_VENV = ROOT / ".cache" / "trl-venv"
TRL_CHILD = Path(__file__).resolve().with_name("trl_child.py")
TRL_VERSION = "1.16.0"  # the newest on PyPI; its requirements accept transformers 5.19.0 (pip check: no conflicts)
MARGIN = 0.97  # novarl's estimated steps in W are cut by 3 %: its schedule must end before the time budget
RETRY_BELOW = 0.9  # novarl's accuracy run is redone once, sized by itself, if it used less of W than this
ACCURACY = re.compile(r"accuracy of .*: ([\d.]+)% on (\d+) prompts")


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def run(cmd: list[str], *, env: dict[str, str], what: str, log_file: Path | None = None) -> str:
    """Run `cmd`; its output goes to `log_file` (or is captured); on failure, its tail and exit."""
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    output = proc.stdout + proc.stderr
    if log_file:
        log_file.write_text(output)
    if proc.returncode:
        tail = "\n".join(line for line in output.splitlines() if "is ignored: it is neither" not in line)[-4000:]
        sys.exit(f"{what} failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")
    return proc.stdout


def base_version(name: str) -> str:
    return version(name).split("+")[0]


def ensure_trl_venv() -> Path:
    """The TRL environment: torch and transformers pinned to .venv's versions, then trl, accelerate and
    datasets. Made once; a stamp file with the pins makes later calls a no-op."""
    pins = [f"torch=={base_version('torch')}", f"transformers=={base_version('transformers')}"]
    stamp = TRL_VENV / ".installed"
    wanted = " ".join([*pins, f"trl=={TRL_VERSION}", "accelerate", "datasets"])
    python = TRL_VENV / "bin" / "python"
    if stamp.is_file() and stamp.read_text().strip() == wanted and python.exists():
        return python
    log(f"installing TRL into {TRL_VENV} ({wanted}); a few minutes the first time")
    env = dict(os.environ)
    if not python.exists():
        run([shutil.which("python3") or "python3", "-m", "venv", str(TRL_VENV)], env=env, what="python3 -m venv")
    pip = [str(python), "-m", "pip", "install", "-q"]
    run([*pip, "--upgrade", "pip"], env=env, what="pip upgrade")
    # torch first, alone, as the Makefile does; then transformers; then TRL with both pinned again
    # so that pip cannot move them.
    run([*pip, pins[0]], env=env, what="pip install torch")
    run([*pip, *pins], env=env, what="pip install transformers")
    run([*pip, *pins, f"trl=={TRL_VERSION}", "accelerate", "datasets"], env=env, what="pip install trl")
    stamp.write_text(wanted + "\n")
    return python


def trl_versions(python: Path) -> dict[str, str]:
    code = ("import json; from importlib.metadata import version as v; print(json.dumps({n: v(n) for n in "
            "('trl', 'torch', 'transformers', 'accelerate', 'datasets')}))")
    return json.loads(subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True).stdout)


def child_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1")
    return env


def export_train_split(path: Path) -> int:
    """The bundled train split as novarl feeds it: prompt, answer, `tokenizer(prompt).input_ids`."""
    from transformers import AutoTokenizer

    from novarl.data.arithmetic import arithmetic_examples

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    examples = arithmetic_examples("train")
    with path.open("w") as f:
        for ex in examples:
            f.write(json.dumps({"prompt": ex.prompt, "answer": ex.answer,
                                "prompt_ids": list(tokenizer(ex.prompt).input_ids)}) + "\n")
    return len(examples)


def novarl_train(work: Path, name: str, env: dict[str, str], steps: int, seconds: float | None = None) -> dict:
    """`novarl train` on the bundled recipe without evaluation; its train records and policy folder."""
    log_dir = work / name
    cmd = [str(NOVARL), "train", f"logger.log_dir={log_dir}", "logger.progress_bar=false",
           f"grpo.max_num_steps={steps}", "grpo.val_at_start=false", "grpo.val_period=0", "grpo.val_at_end=false"]
    if seconds is not None:
        cmd.append(f"grpo.max_train_seconds={seconds:.3f}")
    log(f"novarl: {' '.join(cmd[1:])}")
    run(cmd, env=env, what="novarl train", log_file=work / f"{name}.log")
    (exp,) = sorted(log_dir.glob("exp_*"))
    records = [json.loads(line) for line in (exp / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"records": [r for r in records if r["kind"] == "train"], "policy": exp / "policy", "cmd": cmd}


def trl_train(python: Path, work: Path, name: str, env: dict[str, str], train_jsonl: Path, steps: int,
              threads: int, save: bool) -> dict:
    out_json = work / f"{name}.json"
    cmd = [str(python), str(TRL_CHILD), "--model", str(MODEL), "--train-jsonl", str(train_jsonl),
           "--steps", str(steps), "--out-json", str(out_json), "--work-dir", str(work / f"{name}_out"),
           "--threads", str(threads)]
    if save:
        cmd += ["--save-dir", str(work / f"{name}_model")]
    log(f"TRL: {steps} steps")
    run(cmd, env=env, what="TRL GRPOTrainer", log_file=work / f"{name}.log")
    result = json.loads(out_json.read_text())
    result["model"] = work / f"{name}_model"
    return result


def evaluate(model: Path, env: dict[str, str]) -> float:
    """Held-out greedy accuracy (%) by novarl's evaluator with the bundled recipe (data, reward,
    max_new_tokens), the same for every model."""
    out = run([str(NOVARL), "eval", str(model), "-c", str(RECIPE)], env=env, what=f"novarl eval {model}")
    match = ACCURACY.search(out)
    if not match:
        sys.exit(f"could not read the accuracy from novarl eval's output:\n{out}")
    if int(match.group(2)) != 1000:
        sys.exit(f"novarl eval scored {match.group(2)} prompts, not the 1,000 held-out ones:\n{out}")
    return float(match.group(1))


def median_after(values: list[float], warmup: int) -> float:
    return statistics.median(values[warmup:])


def steps_in(wall: float, step_seconds: list[float], warmup: int, source: str) -> dict:
    """The novarl steps that fit in `wall` seconds at the given run's pace: MARGIN x (wall - the first
    step's extra time) / the median step (after the warm-up when the run has more steps), rounded down."""
    median = statistics.median(step_seconds[warmup:] if len(step_seconds) > warmup else step_seconds)
    first_extra = max(0.0, step_seconds[0] - median)
    return {"steps": max(1, math.floor(MARGIN * (wall - first_extra) / median)), "median": median,
            "first_extra": first_extra, "source": source}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="steps of each for the speed part")
    parser.add_argument("--accuracy-steps", type=int, default=300, help="TRL's steps for the accuracy part")
    parser.add_argument("--skip-accuracy", action="store_true")
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out of the medians")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of both (2: this machine's cores)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--keep-dir", type=Path, help="keep the runs' logs, metrics and models here (default: a "
                        "temporary folder, removed at the end)")
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error(f"--steps must be larger than --warmup ({args.warmup})")
    if not args.skip_accuracy and args.accuracy_steps < 1:
        parser.error("--accuracy-steps must be at least 1")

    python = ensure_trl_venv()
    versions = trl_versions(python)
    novarl_versions = {n: version(n) for n in ("torch", "transformers")}
    for name, v in novarl_versions.items():
        if versions[name] != v:
            log(f"warning: {name} {versions[name]} in the TRL environment, {v} in .venv")
    env = child_env(args.threads)

    with tempfile.TemporaryDirectory(prefix="bench_demo_vs_trl_") as tmp:
        work = Path(tmp)
        if args.keep_dir:
            if args.keep_dir.exists() and any(args.keep_dir.iterdir()):
                sys.exit(f"--keep-dir {args.keep_dir} is not empty")
            work = args.keep_dir
            work.mkdir(parents=True, exist_ok=True)
        train_jsonl = work / "train.jsonl"
        n_train = export_train_split(train_jsonl)

        # 1. speed, one after the other
        started = time.perf_counter()
        nv = novarl_train(work, "novarl_speed", env, args.steps)
        tr = trl_train(python, work, "trl_speed", env, train_jsonl, args.steps, args.threads, save=False)
        nv_steps = [r["time_step"] for r in nv["records"]]
        tr_steps = tr["step_seconds"]
        if len(nv_steps) != args.steps or len(tr_steps) != args.steps:
            sys.exit(f"expected {args.steps} steps each, got novarl {len(nv_steps)}, TRL {len(tr_steps)}")
        speed = {
            "novarl": median_after(nv_steps, args.warmup), "trl": median_after(tr_steps, args.warmup),
            "novarl_phases": {p: median_after([r[f"time_{p}"] for r in nv["records"]], args.warmup)
                              for p in ("generation", "training", "weight_sync")},
            "trl_generation": median_after(tr["generation_seconds"], args.warmup),
            "novarl_mean_all": statistics.fmean(nv_steps), "trl_mean_all": statistics.fmean(tr_steps),
        }
        log(f"median s/step: novarl {speed['novarl']:.3f}, TRL {speed['trl']:.3f}")

        acc = None
        if not args.skip_accuracy:
            before = evaluate(MODEL, env)
            tr_acc = trl_train(python, work, "trl_acc", env, train_jsonl, args.accuracy_steps, args.threads,
                               save=True)
            wall = tr_acc["loop_seconds"]
            plan = steps_in(wall, nv_steps, args.warmup, "its speed part")
            nv_acc = novarl_train(work, "novarl_acc", env, plan["steps"], seconds=wall)
            used = sum(r["time_step"] for r in nv_acc["records"])
            first_try = None
            if len(nv_acc["records"]) < plan["steps"] or used < RETRY_BELOW * wall:
                # The machine ran faster or slower than in the speed part: once more, sized by this run.
                first_try = {"max_steps": plan["steps"], "steps": len(nv_acc["records"]), "seconds": used}
                plan = {"steps": max(1, math.floor(MARGIN * first_try["steps"] * wall / used)),
                        "source": "its first accuracy run"}
                log(f"novarl's first accuracy run: {first_try['steps']} of {first_try['max_steps']} steps in "
                    f"{used:.1f} s of W = {wall:.1f} s; again with {plan['steps']} steps")
                nv_acc = novarl_train(work, "novarl_acc2", env, plan["steps"], seconds=wall)
            nv_done = len(nv_acc["records"])
            acc = {
                "before": before, "wall": wall, "trl_steps": tr_acc["steps"], "trl_sum": sum(tr_acc["step_seconds"]),
                "trl_after": evaluate(tr_acc["model"], env),
                "novarl_plan": plan, "novarl_first_try": first_try, "novarl_steps": nv_done,
                "novarl_sum": sum(r["time_step"] for r in nv_acc["records"]),
                "novarl_after": evaluate(nv_acc["policy"], env),
                "novarl_stopped_on_time": nv_done < plan["steps"],
                "trl_reward_last": statistics.fmean(tr_acc["batch_rewards"][-10:]),
                "novarl_reward_last": statistics.fmean(r["reward_mean"] for r in nv_acc["records"][-10:]),
            }
            log(f"accuracy: before {before:.1f}%, TRL {acc['trl_after']:.1f}%, novarl {acc['novarl_after']:.1f}%")
        total = time.perf_counter() - started

    report = render(args, speed, acc, versions, novarl_versions, tr["threads"], n_train, total)
    print(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report)


def render(args, speed: dict, acc: dict | None, versions: dict, novarl_versions: dict, trl_threads: int,
           n_train: int, total: float) -> str:
    command = ".venv/bin/python benchmarks/bench_demo_vs_trl.py " + " ".join(sys.argv[1:])
    ratio = speed["novarl"] / speed["trl"]
    phases = ", ".join(f"{p} {s:.3f}" for p, s in speed["novarl_phases"].items())
    lines = [
        "# novarl's demo recipe vs TRL's GRPOTrainer (CPU)", "",
        f"- date: {date.today()}; machine: {cpu_name()}, CPU only, {os.cpu_count()} cores; "
        f"torch threads: {args.threads} in both (OMP_NUM_THREADS; TRL child: torch.set_num_threads, "
        f"reads back {trl_threads})",
        f"- command: `{command.strip()}`",
        f"- novarl: `novarl train` on the bundled recipe (novarl/config/recipes/tiny_arith.yaml), torch "
        f"{novarl_versions['torch']}, transformers {novarl_versions['transformers']}, Hugging Face generation "
        f"(the backend novarl picks for this model on CPU), one in-process rank",
        f"- TRL {versions['trl']} GRPOTrainer (accelerate {versions['accelerate']}, datasets {versions['datasets']}), "
        f"torch {versions['torch']}, transformers {versions['transformers']}, in .cache/trl-venv, generation with "
        f"transformers `generate` (no vLLM), child script benchmarks/trl_child.py",
        f"- workload: bundled tiny-arith Llama (298k parameters, fp32), two-digit addition ({n_train:,} train "
        "prompts, the raw prompt text with the BOS the tokenizer adds, no chat template, in both; TRL's "
        "prompt ids checked equal to novarl's), 64 prompts x 8 samples = 512 completions per optimizer step "
        "(TRL: 2 accumulated micro-batches of 256; novarl: as its recipe says, packed rows), <= 4 new tokens, temperature 1.0, top_p 1.0, no top_k, "
        "exact-match reward, group-normalised advantages (TRL scale_rewards=\"group\"), clip 0.2 both sides, "
        "no KL (beta 0), one optimizer step per generated batch (TRL num_iterations=1, "
        "steps_per_generation=gradient_accumulation_steps=2), token-level loss over the whole step (TRL "
        "loss_type=\"dapo\": divides by the active tokens of the whole accumulated batch, like novarl's "
        "token_level_loss; \"bnpo\" would divide each micro-batch by its own count), AdamW lr 4e-4 betas "
        "(0.9, 0.999) eps 1e-8 weight decay 0, the recipe's schedule (10 warm-up steps from 0.1x, then linear "
        "to 0.1x at the last step; the same torch SequentialLR passed to TRL), max_grad_norm 1.0, seed 42, "
        "no evaluation, checkpoints or hub logging during training",
        f"- runs one after the other, never at the same time; whole benchmark {total / 60:.1f} min", "",
        "## Speed", "",
        f"{args.steps} steps of each; medians over the steps after the first {args.warmup} (novarl: "
        "`time_step` of metrics.jsonl; TRL: a TrainerCallback's on_step_begin -> on_step_end, perf_counter).", "",
        "| | novarl | TRL | novarl / TRL |", "|---|---|---|---|",
        f"| median s per optimizer step | {speed['novarl']:.3f} | {speed['trl']:.3f} | x{ratio:.2f} |",
        f"| mean s per step, warm-up included | {speed['novarl_mean_all']:.3f} | {speed['trl_mean_all']:.3f} | "
        f"x{speed['novarl_mean_all'] / speed['trl_mean_all']:.2f} |", "",
        f"- novarl's phases (median s): {phases} (generation: sampling only; reward and advantages are "
        "outside the phases, in the step)",
        f"- TRL's generation phase (median s): {speed['trl_generation']:.3f} (GRPOTrainer._generate_and_score_"
        "completions, timed by wrapping it: generate, decode, reward, advantages); the rest of its step, "
        f"{speed['trl'] - speed['trl_generation']:.3f} s of the median step, is the 2 training micro-batches "
        "and the optimizer step",
    ]
    if acc:
        plan, first_try = acc["novarl_plan"], acc["novarl_first_try"]
        if first_try:
            sizing = (f"from its first accuracy run: {MARGIN} x {first_try['steps']} steps x W / "
                      f"{first_try['seconds']:.1f} s")
        else:
            sizing = (f"from its speed part: {MARGIN} x (W - {plan['first_extra']:.2f} s, its first step's extra "
                      f"time) / {plan['median']:.3f} s, its median step")
        lines += [
            "", "## Held-out accuracy after the same wall time", "",
            f"TRL trained {acc['trl_steps']} steps in W = {acc['wall']:.1f} s (its training loop, first step's "
            f"start to last step's end; sum of its step times {acc['trl_sum']:.1f} s). novarl then ran with "
            f"grpo.max_train_seconds={acc['wall']:.1f} and grpo.max_num_steps={plan['steps']} ({sizing}, "
            "rounded down: a little short of W, so that the learning-rate schedule, sized by max_num_steps, "
            "runs to its end before the time budget can stop it). "
            "Both final models and the bundled model scored by one evaluator: `novarl eval <folder> -c "
            "novarl/config/recipes/tiny_arith.yaml`, greedy, the 1,000 held-out prompts, <= 4 new tokens.", "",
            "| | steps | training time (s) | held-out greedy accuracy | train reward, last 10 steps |",
            "|---|---|---|---|---|",
            f"| bundled model, before training | 0 | 0 | {acc['before']:.1f} % | |",
            f"| TRL | {acc['trl_steps']} | {acc['wall']:.1f} | {acc['trl_after']:.1f} % | "
            f"{acc['trl_reward_last']:.3f} |",
            f"| novarl | {acc['novarl_steps']} | {acc['novarl_sum']:.1f} | {acc['novarl_after']:.1f} % | "
            f"{acc['novarl_reward_last']:.3f} |", "",
        ]
        if first_try:
            lines.append(f"- novarl's first accuracy run, sized by its speed part, did {first_try['steps']} of "
                         f"{first_try['max_steps']} steps in {first_try['seconds']:.1f} s of W = {acc['wall']:.1f} s "
                         f"(the machine's pace had changed): it was run once more, sized by that run, and the "
                         "table shows the second")
        if acc["novarl_stopped_on_time"]:
            lines.append(f"- novarl stopped on the time budget at step {acc['novarl_steps']} of "
                         f"{plan['steps']}: its schedule did not reach its end (the machine was slower than in "
                         f"{plan['source']})")
        lines.append("- novarl's training time is the sum of its `time_step`s; it starts a step while under "
                     "max_train_seconds, so it may pass W by up to one step")
    lines += [
        "", "## Settings not matched exactly", "",
        "- sampling draws and prompt order: the same distributions and seed 42, different random streams. novarl "
        "samples each row from its own seeded counter-based stream and orders prompts with its own seeded "
        "sampler; TRL samples with `generate`'s multinomial on torch's global generator and orders prompts with "
        "its RepeatSampler (which drops the last 60 of the 7,100 prompts of each pass: 110 x 64 = 7,040)",
        "- advantage epsilon: novarl divides by the group's std + 1e-6, TRL by std + 1e-4 (hard-coded); both "
        "unbiased std, both give 0 to a group whose rewards are all equal",
        "- work each does by design, measured as part of each: novarl generates from its own copy of the "
        "weights (synced each step: weight_sync) and computes the sampled tokens' logprobs from the generation "
        "logits (its logprob check); TRL generates with the training model itself and computes the per-token "
        "entropy in its training forward (always on in GRPOTrainer, for its metrics). Neither runs a separate "
        "old-logprob forward (one optimizer step per generated batch). novarl's training forward packs "
        "each group's prompt once and its samples' completions after it, with its own attention (novarl_varlen); "
        "its generation computes each group's prompt once (a shared KV cache); it leaves samples whose "
        "advantage is 0 out of the update (no gradient without a KL penalty); TRL's uses transformers' "
        "default (SDPA) on left-padded prompts + right-padded completions with an attention mask",
        "- logging: novarl writes one metrics.jsonl line per step and prints every 25 steps; TRL logs its "
        "averaged metrics every 25 steps (logging_steps=25) to the console only",
        "- novarl's threads are set by OMP_NUM_THREADS only (its in-process rank does not call "
        "torch.set_num_threads, and novarl/ is not edited for this benchmark); torch reads back the same "
        "count",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
