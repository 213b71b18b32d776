"""GRPO through the public API on several generation layouts: throughput, weight sync, driver memory.

    .venv/bin/python benchmarks/bench_generation_scaling.py [--layouts colocated-1,colocated-2,dedicated-2+1]
        [--baseline COMMIT] [--accounting auto|old|new] [--steps 3] [--repeats 1] [--out report.md] [--json raw.json]

Builds a random-initialised ~100M-parameter Llama with the bundled character
tokenizer (benchmarks/models.py, no download; `--model tiny-arith` for a quick
check), then runs a few GRPO steps of it with `GRPOTrainer(load_config(...))`
for each layout, each in a subprocess of its own so that the driver's peak
resident set is that layout's alone. Workload: `--prompts` x `--generations`
samples of up to `--max-new-tokens` new tokens per step (default 8 x 4 x 24: a
random model rarely stops early, so ~768 tokens a step, enough for 1 vs 2 engines
to show beyond fixed overheads), Hugging Face generation unless `--backend vllm`,
no evaluation, no checkpoints. On a shared machine, `--repeats N` runs each layout
N times and shows the run that other work disturbed least (see "other work" below;
--json keeps all), and `--retry-disturbed K` adds up to K more runs of a layout
whose least disturbed run still had more than `--disturbed-cores` of other work.
Without GPUs every rank and engine is a CPU process; the script changes nothing
else on a GPU host (the layouts then need that many GPUs, and a layout the code
refuses is reported with its message, not retried).

Old against new in one invocation (`--baseline COMMIT`): the script checks COMMIT out
with `git worktree add` into a temporary folder (removed at the end, also on an error
or Ctrl-C), and runs every layout both on that code ("old": the layout's subprocess,
and the Ray processes it starts, import novarl from the worktree through PYTHONPATH,
with the worktree as working directory) and on the code this script belongs to
("new": the repository above benchmarks/, likewise through PYTHONPATH). Old and new
alternate per layout and per repeat (old-new, new-old, ...) so that noise on the
machine hits both alike; each side's accounting is detected in its own subprocess
(see below), and a layout that the baseline cannot express is run on the new code
only. The report then shows, per layout, the old and new rows and a "new/old" line.
Every subprocess reports where it (and, with Ray, a Ray worker) imported novarl
from; a run that imported the other side's code is reported as failed.

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
  auto (default): "new" when the module novarl/backends/generation/layout.py exists, else "old"
       (with --baseline: the baseline's accounting is always detected, this flag is the new side's).

The Ray instance of each layout is started with `start_local_ray(num_cpus=max(--num-cpus,
T+E))`: Ray places one CPU bundle per rank or engine and would refuse more bundles
than this machine has cores (the processes then share the cores).

Columns of the table (per layout; "steps" are the measured steps: all but the
first, a warm-up, when `--steps` >= 2):

  code                 with --baseline: old (the baseline commit) or new (this checkout); the
                       "new/old" line under them divides new by old for gen tok/s, sync s/step,
                       driver peak RSS and step s, and shows driver MB/step as old -> new.
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
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from contextlib import ExitStack, contextmanager
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling modules (models.py) when run by path
from models import cpu_name  # noqa: E402 -- after the path line above

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
    return "new" if importlib.util.find_spec("novarl.backends.generation.layout") is not None else "old"


# ----------------------------------------------------------------------------- machine

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
    try:
        from importlib.metadata import version

        ray_version = version("ray")
    except Exception:  # noqa: BLE001 - not installed, or no metadata
        ray_version = "not installed"
    return {"date": datetime.now().astimezone().isoformat(timespec="seconds"), "cpu": cpu_name(),
            "arch": platform.machine(), "cpu_count": os.cpu_count(), "usable_cpus": usable,
            "memory_gib": memory_gib(), "python": platform.python_version(), "torch": torch.__version__,
            "ray": ray_version, "cuda": cuda, "gpus": torch.cuda.device_count() if cuda else 0,
            "gpu": torch.cuda.get_device_name(0) if cuda else None, "accounting": detect_accounting(),
            **code_under_test()}


def memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 1024 ** 2
    except OSError:
        pass
    return None


# ----------------------------------------------------------------------------- one layout (subprocess)

def status_kib(field: str) -> int | None:
    """A KiB field of /proc/self/status (Linux): VmRSS now, VmHWM the peak; None elsewhere."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def rss_now_kib() -> int:
    return status_kib("VmRSS") or 0


def max_rss_kib() -> int:
    """ru_maxrss in KiB (Linux reports KiB, macOS bytes). Linux carries the forking process's
    resident set at fork into it, which is why the parent never loads torch or the model."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak // 1024 if sys.platform == "darwin" else peak


def high_water_kib() -> int | None:
    """VmHWM: this program's own peak resident set (Linux; a cross-check of ru_maxrss)."""
    return status_kib("VmHWM")


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
        from novarl.backends.remote import RemotePolicy
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
        in_process = driver_path != "no driver path" and not uses_ray and counter["calls"] == 0
        result["driver_weights"] = "in-process" if in_process else driver_path
        result["driver_weight_bytes_total"] = counter["bytes"]
        result["driver_weight_calls"] = counter["calls"]
        result["driver_weight_mb_per_step"] = counter["bytes"] / 1e6 / steps
        if started_ray:
            import ray

            where = ray.remote(lambda: __import__("novarl").__file__)
            result["ray_worker_novarl"] = ray.get(where.remote(), timeout=300)
    except BaseException as err:  # a refusal (UserError, ConfigError) or a failure: reported, not raised
        traceback.print_exc()  # into the subprocess's log, which the driver prints when a run fails
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
    """The machine's description (with the novarl this subprocess imports), and the model (built
    when it is random-100m and the spec asks for it)."""
    if not spec.get("build_model", True):
        return {"machine": machine()}
    if spec["model"] != "random-100m":
        return {"machine": machine(), "model": spec["model"], "model_label": spec["model"]}
    from models import random_llama_100m

    path, params = random_llama_100m(Path(spec["model_dir"]))
    return {"machine": machine(), "model": path,
            "model_label": f"random-initialised Llama, {params / 1e6:.1f}M parameters, fp32"}


# ----------------------------------------------------------------------------- driver

REPO = Path(__file__).resolve().parents[1]  # the checkout this script belongs to: the "new" code of --baseline


class Side:
    """The code a set of runs imports. name: "old" / "new" with --baseline, "" without; root: the folder
    holding novarl/, put first on the subprocesses' PYTHONPATH and made their working directory (None:
    whatever `import novarl` finds in this environment); info: its prepare() description."""

    def __init__(self, name: str, root: Path | None, label: str = "") -> None:
        self.name, self.root, self.label = name, root, label or name
        self.info: dict = {}
        self.accounting = "old"

    def env(self) -> dict[str, str] | None:
        if self.root is None:
            return None
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(self.root), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
        return env

    def cwd(self) -> str | None:
        return str(self.root) if self.root is not None else None

    def foreign(self, module_file: str | None) -> bool:
        """Whether a novarl imported from `module_file` is not this side's."""
        if self.root is None or not module_file:
            return False
        try:
            Path(module_file).resolve().relative_to((self.root / "novarl").resolve())
        except ValueError:
            return True
        return False


def run_in_subprocess(spec: dict, folder: Path, timeout: float, side: Side | None = None) -> dict:
    spec_path, log_path = folder / "spec.json", folder / "output.log"
    spec["result_path"] = str(folder / "result.json")
    spec_path.write_text(json.dumps(spec))
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child", str(spec_path)],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=side.env() if side else None, cwd=side.cwd() if side else None)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # the subprocess's own session: it and the Ray processes it started
            proc.wait()
            code = None
        except BaseException:  # Ctrl-C / SIGTERM of this script: its own session does not get them
            os.killpg(proc.pid, 9)
            proc.wait()
            raise
    wall = time.perf_counter() - start
    result_path = Path(spec["result_path"])
    if result_path.exists():
        result = json.loads(result_path.read_text())
    else:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
        why = f"timed out after {timeout:.0f} s" if code is None else f"exit code {code}"
        result = {"layout": spec["layout"], "overrides": spec["overrides"], "error": f"{why}: {' | '.join(tail)}"}
    if side is not None and "error" not in result:
        for key in ("driver_novarl", "ray_worker_novarl"):
            if side.foreign(result.get(key)):
                result["error"] = f"{key}: imported {result[key]}, not the code under test in {side.root}"
    result["subprocess_wall_s"] = wall
    result["load_1min_before_after"] = [load_before, os.getloadavg()[0] if load_before is not None else None]
    result["log"] = str(log_path)
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


def disturbed(result: dict, cores: float) -> bool:
    other = result.get("other_work_cores")
    return "error" not in result and other is not None and other > cores


@contextmanager
def baseline_worktree(commit: str):
    """A `git worktree add --detach` of `commit` in a temporary folder: (its path, short commit).
    Removed (and pruned) when the block ends, however it ends."""
    def git(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(REPO), *argv], capture_output=True, text=True, timeout=300)

    found = git("rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}")
    if found.returncode != 0:
        raise SystemExit(f"--baseline: {commit!r} is not a commit of {REPO}")
    full = found.stdout.strip()
    short = git("rev-parse", "--short", full).stdout.strip() or full[:7]
    tmp = Path(tempfile.mkdtemp(prefix="novarl_baseline_"))
    tree = tmp / f"novarl-{short}"
    try:
        added = git("worktree", "add", "--detach", str(tree), full)
        if added.returncode != 0:
            raise SystemExit(f"git worktree add of {commit} failed: {added.stderr.strip()}")
        if not (tree / "novarl" / "__init__.py").is_file():
            raise SystemExit(f"--baseline: commit {short} has no novarl/ package")
        yield tree, short
    finally:
        if tree.exists():
            git("worktree", "remove", "--force", str(tree))
        shutil.rmtree(tmp, ignore_errors=True)
        git("worktree", "prune")


# ----------------------------------------------------------------------------- report

def mib(kib) -> str:
    return f"{kib / 1024:,.0f}" if kib else "-"


def num(value, fmt: str) -> str:
    return format(value, fmt) if isinstance(value, (int, float)) else "-"


def load(result: dict) -> str:
    return num(result.get("other_work_cores"), ".2f")


def driver_mb(result: dict) -> str:
    driver = result.get("driver_weights")
    if driver == "RemotePolicy.named_weights":
        return f"{result['driver_weight_mb_per_step']:,.1f}"
    return driver or "-"


def row(result: dict, code: str | None = None) -> str:
    ranks, engines = parse_layout(result["layout"])
    head = [result["layout"], *([code] if code is not None else []), str(ranks), str(engines)]
    if "error" in result:
        body = [f"refused / failed: {result['error'].replace('|', '/')}", *[""] * 8, load(result)]
    else:
        r = result
        body = [num(r.get("gen_tokens_per_s"), ",.1f"), num(r.get("time_weight_sync_s_per_step"), ".3f"),
                num(r.get("weight_sync_mb_per_step"), ",.1f"), driver_mb(r), mib(r.get("driver_rss_before_kib")),
                mib(r.get("driver_peak_rss_kib")), mib(r.get("tree_peak_rss_kib")),
                num(r.get("time_step_median_s"), ".2f"), num(r.get("train_wall_s"), ".0f"), load(r)]
    return "| " + " | ".join(head + body) + " |"


def ratio(new: dict, old: dict, key: str) -> str:
    a, b = new.get(key), old.get(key)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b:
        return f"x{a / b:.2f}"
    return "-"


def ratio_row(old: dict, new: dict) -> str:
    ranks, engines = parse_layout(new["layout"])
    head = [new["layout"], "**new/old**", str(ranks), str(engines)]
    if "error" in old or "error" in new:
        body = ["- (a run failed)", *[""] * 9]
    else:
        body = [ratio(new, old, "gen_tokens_per_s"), ratio(new, old, "time_weight_sync_s_per_step"), "",
                f"{driver_mb(old)} -> {driver_mb(new)}", "", ratio(new, old, "driver_peak_rss_kib"),
                ratio(new, old, "tree_peak_rss_kib"), ratio(new, old, "time_step_median_s"), "", ""]
    return "| " + " | ".join(head + body) + " |"


COLUMNS = ("gen tok/s | sync s/step | sync MB/step | driver MB/step | driver RSS before (MiB) | "
           "driver peak RSS (MiB) | tree peak RSS (MiB) | step s | train() s | other work (cores)")


def overrides_text(result: dict) -> str:
    o = result["overrides"]
    return f"`{' '.join(o)}`" if isinstance(o, list) else o


def markdown(meta: dict, sides: list[Side], entries: list[dict]) -> str:
    compare = len(sides) > 1
    rows, overrides, not_run = [], [], []
    for entry in entries:
        got = entry["sides"]
        for side in sides:
            if side.name in got:
                rows.append(row(got[side.name], side.label if compare else None))
                label = f"{entry['layout']} ({side.label})" if compare else entry["layout"]
                overrides.append(f"- {label}: {overrides_text(got[side.name])}")
        if compare and all(s.name in got for s in sides):
            rows.append(ratio_row(got[sides[0].name], got[sides[1].name]))
        not_run += [f"- {entry['layout']}: not run on {name}: {why}" for name, why in entry["not_run"].items()]
    if meta["cuda"]:
        device = (f"- GPUs: {meta['gpus']} x {meta['gpu']}; every training rank and dedicated engine has a GPU "
                  "of its own, colocated engines share their rank's")
    else:
        device = ("- **CPU only**: this machine has no GPU (no CUDA). Every training rank and generation engine is "
                  "a CPU process (torch on CPU, gloo collectives), Ray placing one CPU bundle for each, all of them "
                  "sharing the machine's cores. On a GPU host the script runs the same layouts with GPUs (one per "
                  "training rank and per dedicated engine) and changes nothing else.")
    memory = f", {meta['memory_gib']:.0f} GiB RAM" if meta.get("memory_gib") else ""
    if compare:
        code = "\n".join(
            f"- {side.label}: {side.info['novarl']} (commit {side.info['commit']}), accounting {side.accounting}"
            + (" (a git worktree in a temporary folder, removed after the run)" if side.name == "old" else "")
            for side in sides)
        title = "Generation layouts, old vs new code: GRPO throughput, weight sync and driver memory"
    else:
        code = f"- code under test: {meta['novarl']} (commit {meta['commit']}); accounting: {meta['accounting']}"
        title = "Generation layouts: GRPO throughput, weight sync and driver memory"
    runs = f"{meta['repeats']} run(s) per layout{' and code' if compare else ''}, the least disturbed shown"
    if meta["retry_disturbed"]:
        runs += (f"; up to {meta['retry_disturbed']} more where the least disturbed still had over "
                 f"{meta['disturbed_cores']} cores of other work")
    if compare:
        runs += "; old and new alternate per layout and per repeat (old-new, new-old, ...)"
    table = [f"| layout |{' code |' if compare else ''} ranks | engines | {COLUMNS} |",
             "|" + "---|" * (13 + compare), *rows]
    return f"""# {title}

- date: {meta['date']}
- machine: {meta['cpu']} ({meta['arch']}), {meta['cpu_count']} cores ({meta['usable_cpus']} usable){memory}
{device}
- python {meta['python']}, torch {meta['torch']}, ray {meta['ray']}
{code}
- model: {meta['model_label']}; {meta['steps']} GRPO steps of {meta['prompts']} prompts x {meta['generations']} \
samples, up to {meta['max_new_tokens']} new tokens, {meta['backend']} generation; measured steps: \
{'2..' + str(meta['steps']) if meta['warmup'] else 'all'}; Ray num_cpus >= {meta['num_cpus']}
- command (cwd {meta['cwd']}): `{meta['command']}`
- runs: {runs}

{chr(10).join(table)}
{chr(10) + "Not run:" + chr(10) + chr(10).join(not_run) + chr(10) if not_run else ""}
Overrides per layout (on top of the workload's):
{chr(10).join(overrides)}
"""


# ----------------------------------------------------------------------------- main

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--layouts", help="comma-separated colocated-T / dedicated-T+E "
                        f"(default: old {DEFAULT_LAYOUTS['old']}; new {DEFAULT_LAYOUTS['new']})")
    parser.add_argument("--baseline", metavar="COMMIT",
                        help="also run every layout on this commit (a temporary git worktree), old and new alternating")
    parser.add_argument("--accounting", choices=("auto", "old", "new"), default="auto",
                        help="of the code under test (with --baseline: of the new side)")
    parser.add_argument("--model", default="random-100m", help="random-100m (built here), or a name/folder")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--micro-batch", type=int, default=8, help="policy.train_micro_batch_size")
    parser.add_argument("--backend", default="hf", choices=("hf", "vllm"))
    parser.add_argument("--num-cpus", type=int, default=4, help="CPUs Ray is told it has (at least T+E)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per layout (and code); the table shows the one least disturbed by other work")
    parser.add_argument("--retry-disturbed", type=int, default=1, metavar="K",
                        help="up to K more runs of a layout whose least disturbed run had too much other work")
    parser.add_argument("--disturbed-cores", type=float, default=0.25,
                        help="'too much other work' for --retry-disturbed, in cores")
    parser.add_argument("--layout-timeout", type=float, default=3600, help="seconds per layout")
    parser.add_argument("--out", type=Path, help="also write the markdown report here")
    parser.add_argument("--json", type=Path, help="write the raw numbers here")
    args = parser.parse_args()

    if args.child:
        spec = json.loads(Path(args.child).read_text())
        result = prepare(spec) if spec.get("prepare") else run_layout(spec)
        Path(spec["result_path"]).write_text(json.dumps(result, indent=2))
        return

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the worktree and temp folders go
    executable = Path(sys.executable)
    if executable.is_relative_to(Path.cwd()):
        executable = executable.relative_to(Path.cwd())
    meta = {"steps": args.steps, "prompts": args.prompts, "generations": args.generations,
            "max_new_tokens": args.max_new_tokens, "backend": args.backend, "num_cpus": args.num_cpus,
            "warmup": 1 if args.steps >= 2 else 0, "repeats": args.repeats, "retry_disturbed": args.retry_disturbed,
            "disturbed_cores": args.disturbed_cores, "cwd": str(Path.cwd()),
            "command": " ".join([str(executable), *sys.argv])}
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="genscale_")))
        if args.baseline:
            tree, short = stack.enter_context(baseline_worktree(args.baseline))
            current = Side("new", REPO if (REPO / "novarl" / "__init__.py").is_file() else None)
            sides = [Side("old", tree, f"old {short}"), current]
            print(f"baseline {args.baseline} checked out in {tree}", flush=True)
        else:
            current = Side("", None)
            sides = [current]
        # The machine's description and the model come from subprocesses too: this process stays
        # small, so that the layouts' subprocesses do not inherit its resident set in ru_maxrss.
        for side in sides:
            folder = tmp / f"prepare_{side.name or 'run'}"
            folder.mkdir()
            got = run_in_subprocess({"prepare": True, "layout": "prepare", "overrides": [], "model": args.model,
                                     "model_dir": str(tmp / "m100"), "build_model": side is current},
                                    folder, args.layout_timeout, side)
            if "error" in got:
                raise SystemExit(f"preparing {side.label or 'the run'} failed: {got['error']}")
            side.info = got["machine"]
            side.accounting = side.info["accounting"]
            if side.foreign(side.info["novarl"] + "/__init__.py"):
                raise SystemExit(f"{side.label}: the subprocess imported {side.info['novarl']}, not {side.root}")
            if side is current:
                meta.update(side.info)
                model, meta["model_label"] = got["model"], got["model_label"]
        if args.accounting != "auto":
            current.accounting = meta["accounting"] = args.accounting
        if current.label == "new":
            current.label = f"new {current.info['commit'].split()[0]}"
        meta["sides"] = {s.name or "run": {"root": str(s.root) if s.root else None, "label": s.label,
                                           "novarl": s.info["novarl"], "commit": s.info["commit"],
                                           "accounting": s.accounting} for s in sides}
        for side in sides:
            print(f"{side.label or 'code under test'}: {side.info['novarl']} ({side.info['commit']}), "
                  f"accounting {side.accounting}", flush=True)
        layouts = [n.strip() for n in (args.layouts or DEFAULT_LAYOUTS[current.accounting]).split(",") if n.strip()]
        for name in layouts:
            parse_layout(name)

        entries = []
        for i, name in enumerate(layouts):
            entry: dict = {"layout": name, "sides": {}, "not_run": {}}
            plans = []
            for side in sides:
                overrides = layout_overrides(name, side.accounting)
                if isinstance(overrides, str):
                    print(f"{name} ({side.label or 'code under test'}): {overrides}", flush=True)
                    if side is current:  # the code under test refuses it: a row that says so
                        entry["sides"][side.name] = {"layout": name, "overrides": overrides, "error": overrides}
                    else:  # only the new code can express it: new rows only
                        entry["not_run"][side.label] = overrides
                    continue
                plans.append((side, overrides))
            runs: dict[str, list[dict]] = {side.name: [] for side, _ in plans}
            planned, retries, repeat = args.repeats, args.retry_disturbed, 0
            while repeat < planned:
                order = plans if (i + repeat) % 2 == 0 else plans[::-1]
                for side, overrides in order:
                    folder = tmp / f"layout_{i}_{side.name or 'run'}_{repeat}"
                    folder.mkdir()
                    spec = {"layout": name, "overrides": overrides, "model": model, "steps": args.steps,
                            "prompts": args.prompts, "generations": args.generations,
                            "max_new_tokens": args.max_new_tokens,
                            "max_total_sequence_length": 48 + args.max_new_tokens, "micro_batch": args.micro_batch,
                            "backend": args.backend, "num_cpus": args.num_cpus, "warmup": meta["warmup"],
                            "log_dir": str(folder / "runs")}
                    print(f"{name}{' on ' + side.label if side.label else ''} (run {repeat + 1} of {planned}): "
                          f"{' '.join(overrides)}", flush=True)
                    result = run_in_subprocess(spec, folder, args.layout_timeout, side)
                    if "error" in result:  # the child's whole log: the table keeps only the message
                        result["log_text"] = Path(result["log"]).read_text(errors="replace")[-20000:]
                    runs[side.name].append(result)
                    print(json.dumps({k: v for k, v in result.items() if k != "log_text"}), flush=True)
                    if "error" in result:
                        print(f"--- {name} on {side.label or 'code under test'} failed; the end of its log:\n"
                              f"{result['log_text'][-6000:]}\n---", flush=True)
                repeat += 1
                if repeat == planned and retries > 0 and any(
                        disturbed(least_disturbed(r), args.disturbed_cores) for r in runs.values()):
                    planned, retries = planned + 1, retries - 1
                    print(f"{name}: other work above {args.disturbed_cores} cores in every run so far: one more",
                          flush=True)
            for side, _ in plans:
                entry["sides"][side.name] = least_disturbed(runs[side.name])
            entry["all_runs"] = runs
            entries.append(entry)
            write_outputs(args, meta, sides, entries, final=False)
        report = write_outputs(args, meta, sides, entries, final=True)
    print(report)


def write_outputs(args, meta: dict, sides: list[Side], entries: list[dict], final: bool) -> str:
    """The markdown (to --out) and the raw numbers (to --json), after every layout so that an
    interrupted run leaves what it measured."""
    report = markdown(meta, sides, entries)
    if not final:
        report += "\n(partial: the run has not finished)\n"
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "layouts": entries}, indent=2))
    return report


if __name__ == "__main__":
    main()
