"""Resumable checkpoints: `checkpoint_dir/step_N/` with the policy's sharded state
(torch.distributed.checkpoint: model, optimizer; scheduler), the driver's state
(step, data position, RNG) and the resolved config.

A checkpoint is written under a temporary name and renamed when complete, so a
run killed mid-save never leaves a folder that looks valid. On resume, folders
that fail the completeness check are reported and skipped in favour of the
newest good one.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from novarl.config.schema import CheckpointingConfig
from novarl.logging.console import info

STATE_FILE = "trainer_state.json"
METRICS_FILE = "metrics.jsonl"
POLICY_DIR = "policy"


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int
    state: dict[str, Any]

    def history(self) -> list[dict[str, Any]]:
        """The metrics records of the run up to this step (none for a checkpoint saved without them)."""
        from novarl.logging.metrics import read_jsonl

        path = self.path / METRICS_FILE
        try:
            records = read_jsonl(path) if path.is_file() else []
        except (OSError, ValueError):  # a damaged copy costs the curve its past, not the run
            info(f"{path} is unreadable: the resumed run's metrics start at step {self.step + 1}")
            return []
        return [r for r in records if isinstance(r, dict) and isinstance(r.get("step"), int)
                and r["step"] <= self.step]


class Checkpointer:
    def __init__(self, cfg: CheckpointingConfig, config_yaml: str) -> None:
        self.cfg = cfg
        self.root = Path(cfg.checkpoint_dir)
        self.config_yaml = config_yaml

    def due(self, step: int, *, last: bool) -> bool:
        return self.cfg.enabled and (step % self.cfg.save_period == 0 or last)

    def save(self, step: int, policy, state: dict[str, Any], *, metrics: Path | None = None) -> Path:
        """Write step_N atomically; then prune to keep_top_k (the newest always stays).
        metrics: the run's metrics.jsonl, kept with the checkpoint so that a resumed run
        carries the whole history (its curve starts at step 1, not at the resume)."""
        final = self.root / f"step_{step}"
        tmp = self.root / f".tmp_step_{step}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        policy.save(tmp / POLICY_DIR)
        state = {**state, "step": step, "rng": _rng_state()}
        (tmp / "config.yaml").write_text(self.config_yaml)
        if metrics is not None and metrics.is_file():
            shutil.copyfile(metrics, tmp / METRICS_FILE)
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))  # written last: marks completeness
        replace_dir(tmp, final)
        info(f"checkpoint step_{step} -> {final}")
        self._prune()
        return final

    def latest(self) -> Checkpoint | None:
        """The newest complete checkpoint; incomplete or corrupt ones are reported and skipped."""
        if not self.root.is_dir():
            return None
        for path in sorted(self.root.glob("step_*"), key=_step_of, reverse=True):
            problem = check_checkpoint(path)
            if problem is None:
                return Checkpoint(path, _step_of(path), json.loads((path / STATE_FILE).read_text()))
            info(f"checkpoint {path} is not usable ({problem}); trying an older one")
        return None

    def _prune(self) -> None:
        keep = self.cfg.keep_top_k
        if keep is None:
            return
        done = sorted(self.root.glob("step_*"), key=_step_of)
        newest = done[-1] if done else None

        def score(path: Path) -> tuple[int, float, int]:
            """(measured at this step, metric, step): checkpoints whose metric was measured
            at their own step rank first, by the metric; the rest, and ties, by recency."""
            summary = json.loads((path / STATE_FILE).read_text()).get("summary", {})
            value, step = summary.get(self.cfg.metric_name), _step_of(path)
            if value is None or summary.get("val_step") != step:
                return (0, 0.0, step)
            return (1, value if self.cfg.higher_is_better else -value, step)

        ranked = sorted((p for p in done if check_checkpoint(p) is None), key=score, reverse=True)
        keep_set = set(ranked[:keep]) | {newest}
        for path in done:
            if path not in keep_set:
                remove_dir(path)


def replace_dir(new: Path, final: Path) -> None:
    """Put `new` at `final`; an older `final` is moved aside first, so a crash leaves
    either the old or the new folder at `final`, never a half-deleted one."""
    old = final.with_name(f".trash_{final.name}")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    new.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def remove_dir(path: Path) -> None:
    """Rename, then delete: a crash mid-delete never leaves a folder that passes as a checkpoint."""
    trash = path.with_name(f".trash_{path.name}")
    shutil.rmtree(trash, ignore_errors=True)
    path.rename(trash)
    shutil.rmtree(trash, ignore_errors=True)


def check_checkpoint(path: Path) -> str | None:
    """None if `path` is a complete checkpoint, else what is wrong with it."""
    state = path / STATE_FILE
    if not state.is_file():
        return f"no {STATE_FILE}"
    try:
        data = json.loads(state.read_text())
    except (OSError, json.JSONDecodeError) as err:
        return f"{STATE_FILE} unreadable: {err}"
    if not isinstance(data, dict) or data.get("step") != _step_of(path):
        return f"{STATE_FILE} does not describe step {_step_of(path)}"
    policy = path / POLICY_DIR
    if (policy / "deepspeed").is_dir():  # written by the DeepSpeed backend
        engine = policy / "deepspeed"
        if not any(engine.glob("*model_states.pt")) or not any(engine.glob("*optim_states.pt")):
            return "DeepSpeed engine state missing"
        return None
    if (policy / "megatron").is_dir():  # written by the Megatron backend
        return _check_megatron(policy / "megatron")
    if not (policy / ".metadata").is_file() or not any(policy.glob("*.distcp")):
        return "policy shards missing"
    if not (policy / "scheduler.pt").is_file():
        return "scheduler state missing"
    return None


def _check_megatron(folder: Path) -> str | None:
    try:
        layout = json.loads((folder / "layout.json").read_text())
        tp, pp, dp = (int(layout["parallel"][k]) for k in ("tp", "pp", "dp"))
        ep = int(layout["parallel"].get("ep", 1)) if layout.get("experts") else 0
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as err:
        return f"Megatron layout unreadable: {err}"
    for p in range(pp):
        for t in range(tp):
            if not (folder / f"model_tp{t}_pp{p}.pt").is_file():
                return f"Megatron model shard tp{t}_pp{p} missing"
        for e in range(ep):
            if not (folder / f"experts_ep{e}_pp{p}.pt").is_file():
                return f"Megatron experts of expert-parallel rank {e}, stage {p} missing"
    for rank in range(tp * pp * dp):
        if not (folder / f"optim_rank{rank}.pt").is_file():
            return f"Megatron optimizer state of rank {rank} missing"
    if not (folder / "scheduler.pt").is_file():
        return "scheduler state missing"
    return None


def restore_rng(state: dict[str, Any]) -> None:
    rng = state.get("rng")
    if rng:
        random.setstate(_to_tuple(rng["python"]))
        torch.set_rng_state(torch.tensor(rng["torch"], dtype=torch.uint8))


def _rng_state() -> dict[str, Any]:
    # The driver's CPU generators; generation is also re-seeded from (seed, step) every step.
    return {"python": random.getstate(), "torch": torch.get_rng_state().tolist()}


def _to_tuple(value: Any) -> Any:
    return tuple(_to_tuple(v) for v in value) if isinstance(value, list) else value


def _step_of(path: Path) -> int:
    try:
        return int(path.name.removeprefix("step_"))
    except ValueError:
        return -1
