"""GRPO through the public API on several generation layouts: throughput, weight sync, driver memory.

    .venv/bin/python benchmarks/bench_generation_scaling.py [--layouts colocated-1,colocated-2,dedicated-2+1]
        [--accounting auto|old|new] [--steps 3] [--out report.md] [--json raw.json]

Builds a random-initialised ~100M-parameter Llama with the bundled character
tokenizer (benchmarks/models.py, no download; `--model tiny-arith` for a quick
check), then runs a few GRPO steps of it with `GRPOTrainer(load_config(...))`
for each layout, each in a subprocess of its own so that the driver's peak
resident set is that layout's alone. Workload: `--prompts` x `--generations`
samples of up to `--max-new-tokens` new tokens per step (a random model rarely
stops early), Hugging Face generation unless `--backend vllm`, no evaluation, no
checkpoints. Without GPUs every rank and engine is a CPU process; the script
changes nothing else on a GPU host (the layouts then need that many GPUs, and a
layout the code refuses is reported with its message, not retried).

Layouts (`--layouts`, comma-separated):

  colocated-T     T training ranks, generation in the driver's process
                  (T=1: everything in-process; T>1: the ranks are Ray actors).
  dedicated-T+E   T training ranks and E generation engines on devices of their own
                  (`policy.generation.colocated.enabled=false`).

How a layout becomes config keys depends on the code under test (`--accounting`):

  old  (novarl up to e7d5960): cluster.gpus_per_node x num_nodes = training ranks; a
       dedicated generator is ONE extra Ray actor on top, so only E=1 exists:
       dedicated-2+1 = cluster.gpus_per_node=2 policy.generation.colocated.enabled=false
  new  (NeMo RL accounting): generation devices come out of the cluster:
       dedicated-T+E = cluster.gpus_per_node=T+E policy.generation.colocated.enabled=false
                       policy.generation.colocated.resources.gpus_per_node=E
  auto (default): "new" when the module novarl/plan/generation.py exists, else "old".

The Ray instance of each layout is started with `start_local_ray(num_cpus=max(--num-cpus,
T+E))`: Ray places one CPU bundle per rank or engine and would refuse more bundles
than this machine has cores (the processes then share the cores).

Columns of the table (per layout; "steps" are the measured steps: all but the
first, a warm-up, when `--steps` >= 2):

  ranks / engines      training ranks / dedicated generation engines (0: colocated).
  gen tok/s            sum of tokens_generated / sum of time_generation over the steps
                       (metrics.jsonl train records).
  sync s/step          mean time_weight_sync over the steps: the trainer's weights into
                       the generator (in-process copy, via the driver, or rank to engine).
  sync MB/step         mean weight_sync_mb over the steps, where the run logs it (dedicated
                       generation: the bytes sent rank to engine); "-" where it does not.
  driver MB/step       bytes of weights that passed through the driver's process per step:
                       the tensors `RemotePolicy.named_weights` yielded (wrapped in the layout's
                       subprocess), over all steps / steps run. "in-process" when the policy
                       lives in the driver (no Ray ranks); "no driver path" when the code
                       under test has no RemotePolicy.named_weights.
  driver RSS before    the driver's resident set (MiB) right before `train()`: imports,
                       config and Ray started; no model loaded yet.
  driver peak RSS      the driver's ru_maxrss (MiB) at the end of its subprocess (--json also
                       holds VmHWM, the same peak from /proc, as a cross-check).
  tree peak RSS        the largest sum of resident sets (MiB) of the driver and all its
                       descendants (Ray's own processes, rank and engine actors), sampled
                       every second during `train()`; shared pages count once per process.
  step s               median time_step over the steps.
  train() s            wall time of the whole `train()` call: start-up of the roles, the
                       steps, the export of the final policy, shut-down.
  other work (cores)   CPU time the rest of the machine used during `train()` (busy CPU
                       time from the kernel less that of the driver and its descendants),
                       in cores: near 0 on a quiet machine; well above 0 means other work
                       shared the cores and the times are not comparable (--json also holds
                       the 1-minute load average before / after each layout).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling modules (models.py) when run by path

DEFAULT_LAYOUTS = {"old": "colocated-1,colocated-2,dedicated-2+1",
                   "new": "colocated-1,colocated-2,dedicated-2+1,dedicated-1+2,dedicated-2+2"}
LAYOUT = re.compile(r"^(colocated)-(\d+)$|^(dedicated)-(\d+)\+(\d+)$")


# ----------------------------------------------------------------------------- layouts

def parse_layout(name: str) -> tuple[int, int]:
    """(training ranks, dedicated engines; 0 when colocated)."""
    match = LAYOUT.match(name)
    if match is None:
        raise SystemExit(f"--layouts: {name!r} is neither colocated-T nor dedicated-T+E")
    if match.group(1):
        return int(match.group(2)), 0
    return int(match.group(4)), int(match.group(5))


def layout_overrides(name: str, accounting: str) -> list[str] | str:
    """The config overrides for a layout, or why the code under test cannot express it."""
    ranks, engines = parse_layout(name)
    if not engines:
        return [f"cluster.gpus_per_node={ranks}", "policy.generation.colocated.enabled=true"]
    dedicated = "policy.generation.colocated.enabled=false"
    if accounting == "old":
        if engines != 1:
            return "not expressible under the old accounting (one dedicated generator actor only)"
        return [f"cluster.gpus_per_node={ranks}", dedicated]
    return [f"cluster.gpus_per_node={ranks + engines}", dedicated,
            f"policy.generation.colocated.resources.gpus_per_node={engines}"]


def detect_accounting() -> str:
    return "new" if importlib.util.find_spec("novarl.plan.generation") is not None else "old"


# ----------------------------------------------------------------------------- machine

def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def code_under_test() -> dict[str, str]:
    """Where `import novarl` resolves, and that folder's git commit (+ whether it has changes)."""
    spec = importlib.util.find_spec("novarl")
    folder = Path(spec.origin).parent if spec and spec.origin else None
    info = {"novarl": str(folder) if folder else "not found", "commit": "unknown"}
    if folder is not None:
        try:
            commit = subprocess.run(["git", "-C", str(folder), "rev-parse", "--short", "HEAD"],
                                    capture_output=True, text=True, timeout=30).stdout.strip()
            dirty = subprocess.run(["git", "-C", str(folder), "status", "--porcelain", "--", "."],
                                   capture_output=True, text=True, timeout=30).stdout.strip()
            if commit:
                info["commit"] = commit + (" + uncommitted changes in novarl/" if dirty else "")
        except (OSError, subprocess.SubprocessError):
            pass
    return info


def machine() -> dict[str, object]:
    import torch

    cuda = torch.cuda.is_available()
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {"date": datetime.now().isoformat(timespec="seconds"), "cpu": cpu_name(), "arch": platform.machine(),
            "cpu_count": os.cpu_count(), "usable_cpus": usable, "python": platform.python_version(),
            "torch": torch.__version__, "cuda": cuda, "gpus": torch.cuda.device_count() if cuda else 0,
            "gpu": torch.cuda.get_device_name(0) if cuda else None, **code_under_test()}


# ----------------------------------------------------------------------------- one layout (subprocess)

def rss_now_kib() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def max_rss_kib() -> int:
    """ru_maxrss in KiB (Linux reports KiB, macOS bytes). Linux carries the forking process's
    resident set at fork into it, which is why the parent never loads torch or the model."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak // 1024 if sys.platform == "darwin" else peak


def high_water_kib() -> int | None:
    """VmHWM: this program's own peak resident set (Linux; a cross-check of ru_maxrss)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


class TreeSampler:
    """In a thread, every `interval` seconds: the largest sum of resident sets of this process and
    its descendants (peak_kib), and their CPU time, to tell how many cores' worth of CPU other
    work on the machine took meanwhile (other_cores: the machine's busy CPU time less this
    tree's, over the wall time; approximate, a descendant that lived less than `interval`
    counts as other work)."""

    def __init__(self, interval: float = 1.0) -> None:
        self.interval, self.peak_kib, self.other_cores = interval, 0, None
        self._cpu: dict[tuple[int, float], list[float]] = {}  # (pid, start) -> [first seen, last seen]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self, psutil, me) -> None:
        total = 0
        for proc in [me, *me.children(recursive=True)]:
            try:
                with proc.oneshot():
                    rss, times, key = proc.memory_info().rss, proc.cpu_times(), (proc.pid, proc.create_time())
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            total += rss
            used = times.user + times.system
            self._cpu.setdefault(key, [used if self._first else 0.0, used])[1] = used
        self._first = False
        self.peak_kib = max(self.peak_kib, total // 1024)

    def _run(self) -> None:
        try:
            import psutil
        except ImportError:
            return
        me, self._first = psutil.Process(), True

        def busy() -> float:
            t = psutil.cpu_times()
            idle = t.idle + getattr(t, "iowait", 0.0)
            return sum(t) - idle - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)

        busy_start, wall_start = busy(), time.monotonic()
        while True:
            self._sample(psutil, me)
            if self._stop.wait(self.interval):
                break
        self._sample(psutil, me)
        tree = sum(last - first for first, last in self._cpu.values())
        wall = time.monotonic() - wall_start
        if wall > 0:
            self.other_cores = max(0.0, busy() - busy_start - tree) / wall

    def __enter__(self) -> "TreeSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def wrap_driver_weights() -> tuple[dict[str, int], str]:
    """Count the bytes RemotePolicy.named_weights yields in this process (the weights a colocated
    generator in the driver pulls from Ray ranks). (counter, how it is measured)."""
    counter = {"bytes": 0, "calls": 0}
    try:
        from novarl.distributed.remote import RemotePolicy
    except ImportError:
        return counter, "no driver path"
    original = getattr(RemotePolicy, "named_weights", None)
    if original is None:
        return counter, "no driver path"

    def named_weights(self, *args, **kwargs):
        counter["calls"] += 1
        for name, tensor in original(self, *args, **kwargs):
            counter["bytes"] += tensor.numel() * tensor.element_size()
            yield name, tensor

    RemotePolicy.named_weights = named_weights
    return counter, "RemotePolicy.named_weights"


def summarize(records: list[dict], warmup: int) -> dict[str, object]:
    train = sorted((r for r in records if r.get("kind") == "train"), key=lambda r: r["step"])
    kept = train[warmup:] if len(train) > warmup else train
    gen_time = sum(r.get("time_generation", 0.0) for r in kept)
    tokens = sum(r.get("tokens_generated", 0.0) for r in kept)
    times = sorted({k for r in kept for k in r if k.startswith("time_")})
    out: dict[str, object] = {
        "steps_run": len(train), "steps_measured": [r["step"] for r in kept],
        "tokens_generated": tokens, "time_generation_s": gen_time,
        "gen_tokens_per_s": tokens / gen_time if gen_time else None,
        "time_weight_sync_s_per_step": statistics.mean(r["time_weight_sync"] for r in kept)
        if kept and all("time_weight_sync" in r for r in kept) else None,
        "weight_sync_mb_per_step": statistics.mean(r["weight_sync_mb"] for r in kept)
        if kept and all("weight_sync_mb" in r for r in kept) else None,
        "time_step_median_s": statistics.median(r["time_step"] for r in kept) if kept else None,
        "time_means_s": {k: statistics.mean(r.get(k, 0.0) for r in kept) for k in times},
        "sync_keys": sorted({k for r in kept for k in r if "sync" in k}),
    }
    return out


def run_layout(spec: dict) -> dict:
    """Train `spec["layout"]` in this process; the measurements (or the refusal)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    result: dict[str, object] = {"layout": spec["layout"], "overrides": spec["overrides"]}
    counter, driver_path = wrap_driver_weights()
    from novarl.config import BUNDLED_RECIPE, load_config
    from novarl.logging.metrics import read_jsonl
    from novarl.trainer.api import GRPOTrainer

    ranks, engines = parse_layout(spec["layout"])
    uses_ray = ranks > 1 or engines > 0
    started_ray = False
    try:
        cfg = load_config(BUNDLED_RECIPE, overrides=[
            f"policy.model_name={spec['model']}", f"grpo.max_num_steps={spec['steps']}",
            f"grpo.num_prompts_per_step={spec['prompts']}", f"grpo.num_generations_per_prompt={spec['generations']}",
            f"policy.generation.max_new_tokens={spec['max_new_tokens']}",
            f"policy.max_total_sequence_length={spec['max_total_sequence_length']}",
            f"policy.train_micro_batch_size={spec['micro_batch']}",
            f"policy.logprob_batch_size={spec['prompts'] * spec['generations']}",
            f"policy.generation.backend={spec['backend']}", "policy.generation.vllm_cfg.enforce_eager=true",
            "grpo.max_train_seconds=null", "grpo.val_at_start=false", "grpo.val_at_end=false", "grpo.val_period=0",
            "checkpointing.enabled=false", f"logger.log_dir={spec['log_dir']}", "logger.progress_bar=false",
            "logger.print_every_n_steps=1", *spec["overrides"]])
        if uses_ray:
            from novarl.distributed.ray_group import start_local_ray

            start_local_ray(num_cpus=max(spec["num_cpus"], ranks + engines))
            started_ray = True
        result["driver_rss_before_kib"] = rss_now_kib()
        result["driver_maxrss_before_kib"] = max_rss_kib()
        start = time.perf_counter()
        with TreeSampler() as tree:
            output_dir = GRPOTrainer(cfg).train().output_dir
        result["train_wall_s"] = time.perf_counter() - start
        result["tree_peak_rss_kib"] = tree.peak_kib or None
        result["other_work_cores"] = tree.other_cores
        result.update(summarize(read_jsonl(output_dir / "metrics.jsonl"), spec["warmup"]))
        steps = int(result["steps_run"]) or 1
        if not uses_ray and counter["calls"] == 0:
            result["driver_weights"] = "in-process"
        else:
            result["driver_weights"] = driver_path
        result["driver_weight_bytes_total"] = counter["bytes"]
        result["driver_weight_calls"] = counter["calls"]
        result["driver_weight_mb_per_step"] = counter["bytes"] / 1e6 / steps
        if started_ray:
            import ray

            where = ray.remote(lambda: __import__("novarl").__file__)
            result["ray_worker_novarl"] = ray.get(where.remote(), timeout=300)
    except BaseException as err:  # a refusal (UserError, ConfigError) or a failure: reported, not raised
        lines = [line for line in str(err).strip().splitlines() if line.strip()]
        result["error"] = f"{type(err).__name__}: {' '.join(lines)[:1500]}"
    finally:
        if started_ray:
            import ray

            ray.shutdown()
    result["driver_peak_rss_kib"] = max_rss_kib()
    result["driver_vmhwm_kib"] = high_water_kib()
    import novarl

    result["driver_novarl"] = novarl.__file__
    return result


def prepare(spec: dict) -> dict:
    """The machine's description, and the model (built when it is random-100m)."""
    if spec["model"] != "random-100m":
        return {"machine": machine(), "model": spec["model"], "model_label": spec["model"]}
    from models import random_llama_100m

    path, params = random_llama_100m(Path(spec["model_dir"]))
    return {"machine": machine(), "model": path,
            "model_label": f"random-initialised Llama, {params / 1e6:.1f}M parameters, fp32"}


# ----------------------------------------------------------------------------- driver

def run_in_subprocess(spec: dict, folder: Path, timeout: float) -> dict:
    spec_path, log_path = folder / "spec.json", folder / "output.log"
    spec["result_path"] = str(folder / "result.json")
    spec_path.write_text(json.dumps(spec))
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child", str(spec_path)],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # the subprocess's own session: it and the Ray processes it started
            proc.wait()
            code = None
    wall = time.perf_counter() - start
    result_path = Path(spec["result_path"])
    if result_path.exists():
        result = json.loads(result_path.read_text())
    else:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
        why = f"timed out after {timeout:.0f} s" if code is None else f"exit code {code}"
        result = {"layout": spec["layout"], "overrides": spec["overrides"], "error": f"{why}: {' | '.join(tail)}"}
    result["subprocess_wall_s"] = wall
    result["load_1min_before_after"] = [load_before, os.getloadavg()[0] if load_before is not None else None]
    return result


def least_disturbed(runs: list[dict]) -> dict:
    """Of a layout's repeats, the one during which other work took the least CPU (the first
    when all failed); every repeat's headline numbers go with it under "repeats"."""
    done = [r for r in runs if "error" not in r] or runs[:1]
    best = dict(min(done, key=lambda r: r.get("other_work_cores") if r.get("other_work_cores") is not None
                    else float("inf")))
    if len(runs) > 1:
        best["repeats"] = [{k: r.get(k) for k in ("gen_tokens_per_s", "time_weight_sync_s_per_step",
                                                  "time_step_median_s", "driver_peak_rss_kib", "other_work_cores",
                                                  "error") if k in r} for r in runs]
    return best


def mib(kib) -> str:
    return f"{kib / 1024:,.0f}" if kib else "-"


def num(value, fmt: str) -> str:
    return format(value, fmt) if isinstance(value, (int, float)) else "-"


def load(result: dict) -> str:
    return num(result.get("other_work_cores"), ".2f")


def markdown(meta: dict, results: list[dict]) -> str:
    rows = []
    for r in results:
        ranks, engines = parse_layout(r["layout"])
        head = f"| {r['layout']} | {ranks} | {engines} |"
        if "error" in r:
            rows.append(f"{head} refused / failed: {r['error'].replace('|', '/')} ||||||||| {load(r)} |")
            continue
        driver = r.get("driver_weights")
        driver_mb = (f"{r['driver_weight_mb_per_step']:,.1f}" if driver == "RemotePolicy.named_weights" else driver)
        rows.append(
            f"{head} {num(r.get('gen_tokens_per_s'), ',.1f')} | {num(r.get('time_weight_sync_s_per_step'), '.3f')} | "
            f"{num(r.get('weight_sync_mb_per_step'), ',.1f')} | {driver_mb} | {mib(r.get('driver_rss_before_kib'))} | "
            f"{mib(r.get('driver_peak_rss_kib'))} | {mib(r.get('tree_peak_rss_kib'))} | "
            f"{num(r.get('time_step_median_s'), '.2f')} | {num(r.get('train_wall_s'), '.0f')} | {load(r)} |")
    overrides = "\n".join(f"- {r['layout']}: `{' '.join(o) if isinstance(o := r['overrides'], list) else o}`"
                          for r in results)
    gpu = f"{meta['gpus']} x {meta['gpu']}" if meta["cuda"] else "no CUDA"
    repeats = f"; {meta['repeats']} runs per layout, the least disturbed shown" if meta["repeats"] > 1 else ""
    return f"""# Generation layouts: GRPO throughput, weight sync and driver memory

- date: {meta['date']}
- machine: {meta['cpu']} ({meta['arch']}), {meta['cpu_count']} cores ({meta['usable_cpus']} usable); {gpu}
- python {meta['python']}, torch {meta['torch']}
- code under test: {meta['novarl']} (commit {meta['commit']}); accounting: {meta['accounting']}
- model: {meta['model_label']}; {meta['steps']} GRPO steps of {meta['prompts']} prompts x {meta['generations']} \
samples, up to {meta['max_new_tokens']} new tokens, {meta['backend']} generation; measured steps: \
{'2..' + str(meta['steps']) if meta['warmup'] else 'all'}; Ray num_cpus >= {meta['num_cpus']}
- command: `{meta['command']}`{repeats}

| layout | ranks | engines | gen tok/s | sync s/step | sync MB/step | driver MB/step | driver RSS before (MiB) | \
driver peak RSS (MiB) | tree peak RSS (MiB) | step s | train() s | other work (cores) |
|---|---|---|---|---|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}

Overrides per layout (on top of the workload's):
{overrides}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--layouts", help="comma-separated colocated-T / dedicated-T+E "
                        f"(default: old {DEFAULT_LAYOUTS['old']}; new {DEFAULT_LAYOUTS['new']})")
    parser.add_argument("--accounting", choices=("auto", "old", "new"), default="auto")
    parser.add_argument("--model", default="random-100m", help="random-100m (built here), or a name/folder")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=8, help="policy.train_micro_batch_size")
    parser.add_argument("--backend", default="hf", choices=("hf", "vllm"))
    parser.add_argument("--num-cpus", type=int, default=4, help="CPUs Ray is told it has (at least T+E)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per layout; the table shows the one least disturbed by other work")
    parser.add_argument("--layout-timeout", type=float, default=3600, help="seconds per layout")
    parser.add_argument("--out", type=Path, help="also write the markdown report here")
    parser.add_argument("--json", type=Path, help="write the raw numbers here")
    args = parser.parse_args()

    if args.child:
        spec = json.loads(Path(args.child).read_text())
        result = prepare(spec) if spec.get("prepare") else run_layout(spec)
        Path(spec["result_path"]).write_text(json.dumps(result, indent=2))
        return

    accounting = detect_accounting() if args.accounting == "auto" else args.accounting
    layouts = [name.strip() for name in (args.layouts or DEFAULT_LAYOUTS[accounting]).split(",") if name.strip()]
    for name in layouts:
        parse_layout(name)
    meta = {"accounting": accounting, "steps": args.steps, "prompts": args.prompts,
            "generations": args.generations, "max_new_tokens": args.max_new_tokens, "backend": args.backend,
            "num_cpus": args.num_cpus, "warmup": 1 if args.steps >= 2 else 0, "repeats": args.repeats,
            "command": " ".join([Path(sys.executable).name, *sys.argv])}
    results = []
    with tempfile.TemporaryDirectory(prefix="genscale_") as tmp:
        # The machine's description and the model come from a subprocess too: this process stays
        # small, so that the layouts' subprocesses do not inherit its resident set in ru_maxrss.
        folder = Path(tmp) / "prepare"
        folder.mkdir()
        got = run_in_subprocess({"prepare": True, "layout": "prepare", "overrides": [], "model": args.model,
                                 "model_dir": str(Path(tmp) / "m100")}, folder, args.layout_timeout)
        if "error" in got:
            raise SystemExit(f"building the model failed: {got['error']}")
        meta.update(got["machine"])
        model, meta["model_label"] = got["model"], got["model_label"]
        print(f"code under test: {meta['novarl']} ({meta['commit']}), accounting: {accounting}", flush=True)
        for i, name in enumerate(layouts):
            overrides = layout_overrides(name, accounting)
            if isinstance(overrides, str):
                results.append({"layout": name, "overrides": overrides, "error": overrides})
                print(name, overrides, flush=True)
                continue
            runs = []
            for repeat in range(args.repeats):
                folder = Path(tmp) / f"layout_{i}_{repeat}"
                folder.mkdir()
                spec = {"layout": name, "overrides": overrides, "model": model, "steps": args.steps,
                        "prompts": args.prompts, "generations": args.generations,
                        "max_new_tokens": args.max_new_tokens, "max_total_sequence_length": 48 + args.max_new_tokens,
                        "micro_batch": args.micro_batch, "backend": args.backend, "num_cpus": args.num_cpus,
                        "warmup": meta["warmup"], "log_dir": str(folder / "runs")}
                print(f"{name} (run {repeat + 1} of {args.repeats}): {' '.join(overrides)}", flush=True)
                runs.append(run_in_subprocess(spec, folder, args.layout_timeout))
                print(json.dumps(runs[-1]), flush=True)
            results.append(least_disturbed(runs))
    report = markdown(meta, results)
    print(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "layouts": results}, indent=2))


if __name__ == "__main__":
    main()
