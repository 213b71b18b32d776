"""Resumable checkpoints: `checkpoint_dir/step_N/` with the policy's sharded state
(torch.distributed.checkpoint: model, optimizer; scheduler), the driver's state
(step, data position, RNG) and the resolved config.

    step_N/policy/             the training backend's state (DCP: *.distcp, .metadata, scheduler.pt;
                               DeepSpeed: policy/deepspeed/...; Megatron: policy/megatron/...)
    step_N/config.yaml         the resolved config
    step_N/metrics.jsonl       the run's metrics up to step N
    step_N/rollouts.pt         asynchronous GRPO: the rounds in flight (token ids, logprobs, weight versions)
    step_N/manifest.json       every file above with its size and sha256, and trainer_state.json's sha256
    step_N/trainer_state.json  step, data position, RNG, summary; written last, it marks the folder complete
    step_N/run_finished.json   added once the run that wrote step_N has ended (evaluation, export, prune)

Writing: into `.tmp_step_N-<host>-<pid>`; every file is hashed and fsynced (the backends'
ranks only write; the driver syncs their files after they return), then the manifest,
the state and the folder are fsynced, the folder renamed to step_N and the parent fsynced.
A save that fails (a full disk, ...) removes its partial folder; one killed leaves it to the
sweep at the next start, which removes temporary folders whose process is gone.

Checking (`check_checkpoint`): the state, the config and the files of the backend that wrote it
(which the saved config names: its spec checks them, `TrainingSpec.checkpoint_problem`) must be there
and every file must have the size the manifest gives; when the checkpoint is about to be
loaded (resume, convert) the checksums are compared too. sha256 (hashlib, one thread per
file): 65 ms per 100 MiB where measured (a 2-core AMD EPYC with SHA-NI, 1.5 GiB/s), against
94 ms for blake2b. Checkpoints written before manifests existed load unverified, said once.

Untrusted files: nothing is unpickled before its checksum matched. DCP's `.metadata` is
a pickle that torch unpickles unrestricted, so it is also read first with an unpickler that
admits only DCP's metadata classes and torch's dtypes and sizes (dtensor_checkpoint.check_dcp_metadata):
a DTensor or Megatron checkpoint from someone else cannot run code (their .pt files load
with weights_only=True). DeepSpeed's loader (and its zero_to_fp32 export) unpickles with
weights_only=False, so its files are scanned first (deepspeed_checkpoint.check_deepspeed_pickles, which unpickles
nothing): any global beyond weights_only's and DeepSpeed's dataclasses, enums and loss
scalers makes the checkpoint unusable. Both checks run before every load for resume or convert.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from novarl.config.schema import CheckpointingConfig
from novarl.errors import UserError
from novarl.logging.console import info
from novarl.trainer.checkpoint_files import (CHECKSUM, MANIFEST_FILE, STATE_FILE,
                                             digest_all, discard_partial, fsync_path, megabytes, owner_tag,
                                             remove_dir, replace_dir, sweep_temp_folders, tree_size,
                                             write_manifest, write_synced)

if TYPE_CHECKING:
    from novarl.backends.spec import TrainingSpec

METRICS_FILE = "metrics.jsonl"
POLICY_DIR = "policy"
CRITIC_DIR = "critic"
"""PPO's value model, beside the policy, when the run has one (its files are checked like the policy's)."""
FINISHED_FILE = "run_finished.json"
ROLLOUTS_FILE = "rollouts.pt"
"""Asynchronous GRPO's rounds in flight at the checkpoint (tensors, loaded with weights_only=True)."""


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

    def rollouts(self) -> Any:
        """Asynchronous GRPO's rounds in flight at this step (None without them); read after the
        checkpoint's checksums were compared (Checkpointer.latest(verify=True))."""
        path = self.path / ROLLOUTS_FILE
        if not path.is_file():
            return self.state.get("async_rollouts")  # written into the state by an older novarl
        try:
            return torch.load(path, weights_only=True)
        except Exception as err:
            raise UserError(f"Checkpoint {self.path}'s {ROLLOUTS_FILE} is unreadable ({err}); resume from an older "
                            "checkpoint (move this one out of checkpointing.checkpoint_dir).") from None


class Checkpointer:
    def __init__(self, cfg: CheckpointingConfig, config_yaml: str) -> None:
        self.cfg = cfg
        # absolute: the policy's Ray ranks write their shards here, and their working directory may differ
        self.root = Path(cfg.checkpoint_dir).absolute()
        self.config_yaml = config_yaml
        self._said_unverified = False

    def due(self, step: int, *, last: bool) -> bool:
        return self.cfg.enabled and (step % self.cfg.save_period == 0 or last)

    def save(self, step: int, policy, state: dict[str, Any], *, metrics: Path | None = None, critic=None,
             rollouts: Any = None) -> Path:
        """Write step_N atomically (see the module's docstring); then prune to keep_top_k (the
        newest always stays). metrics: the run's metrics.jsonl, kept with the checkpoint so that
        a resumed run carries the whole history (its curve starts at step 1, not at the resume).
        rollouts: asynchronous GRPO's rounds in flight (tensors, lists, numbers and strings).
        A write the OS refuses (a full disk, ...) raises UserError; the partial folder is removed."""
        final = self.root / f"step_{step}"
        tmp = self.root / f".tmp_step_{step}-{owner_tag()}"
        newest = max(self.root.glob("step_*"), key=_step_of, default=None)
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            policy.save(tmp / POLICY_DIR)
            if critic is not None:
                critic.save(tmp / CRITIC_DIR)
            (tmp / "config.yaml").write_text(self.config_yaml)
            if metrics is not None and metrics.is_file():
                shutil.copyfile(metrics, tmp / METRICS_FILE)
            if rollouts is not None:
                torch.save(rollouts, tmp / ROLLOUTS_FILE)
            state_text = json.dumps({**state, "step": step, "rng": _rng_state()}, indent=1)
            write_manifest(tmp, state_text)
            write_synced(tmp / STATE_FILE, state_text)  # written last: marks completeness
            fsync_path(tmp)
            replace_dir(tmp, final)
        except BaseException as err:
            needed = f"a checkpoint takes about {megabytes(tree_size(newest))} ({newest.name})" if newest else None
            failure = discard_partial(tmp, err, f"Saving checkpoint step_{step} to '{self.root}'", needed=needed)
            if failure is None:
                raise
            then = (f"The checkpoints before it are intact (newest: {newest.name}): make room or fix the cause (or "
                    "set checkpointing.checkpoint_dir to another disk), and `novarl train` with the same config "
                    f"goes on from {newest.name}." if newest else "Make room or fix the cause (or set "
                    "checkpointing.checkpoint_dir to another disk), and run again.")
            raise UserError(f"{failure} {then}") from err
        info(f"checkpoint step_{step} -> {final}")
        self.prune()
        return final

    def latest(self, *, verify: bool = False, before: int | None = None) -> Checkpoint | None:
        """The newest good checkpoint (older than step `before` if given); ones that fail
        `check_checkpoint` are reported in one line each and skipped. verify: compare the
        checksums too, for a checkpoint about to be loaded (sizes are always compared)."""
        if not self.root.is_dir():
            return None
        for path in sorted(self.root.glob("step_*"), key=_step_of, reverse=True):
            if before is not None and _step_of(path) >= before:
                continue
            problem = check_checkpoint(path, verify_checksums=verify)
            if problem is None:
                if not (path / MANIFEST_FILE).is_file() and not self._said_unverified:
                    self._said_unverified = True  # once: all of a run's checkpoints are alike
                    info(f"checkpoint {path} has no {MANIFEST_FILE} (written by an older novarl): "
                         "its files are used unverified")
                return Checkpoint(path, _step_of(path), json.loads((path / STATE_FILE).read_text()))
            info(f"checkpoint {path} is not usable ({problem}); trying an older one")
        return None

    def sweep(self) -> None:
        """Remove temporary folders that killed runs left in checkpoint_dir (see `sweep_temp_folders`)."""
        sweep_temp_folders(self.root)

    def prune(self) -> None:
        """Delete checkpoints beyond keep_top_k (ranked by metric_name); the newest always stays."""
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
            if not isinstance(value, (int, float)) or summary.get("val_step") != step:
                return (0, 0.0, step)
            return (1, value if self.cfg.higher_is_better else -value, step)

        ranked = sorted((p for p in done if check_checkpoint(p) is None), key=score, reverse=True)
        keep_set = set(ranked[:keep]) | {newest}
        for path in done:
            if path not in keep_set:
                remove_dir(path)


# ------------------------------------------------------------------ checking
def check_checkpoint(path: Path, *, verify_checksums: bool = False) -> str | None:
    """None if `path` is a complete checkpoint, else what is wrong with it. Files are compared
    with the manifest by size; with verify_checksums, also by sha256, and DCP's `.metadata` is
    read with a restricted unpickler: do this before loading anything from it."""
    state = path / STATE_FILE
    if not state.is_file():
        return f"no {STATE_FILE}"
    try:
        data = json.loads(state.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return f"{STATE_FILE} unreadable: {err}"
    if not isinstance(data, dict) or data.get("step") != _step_of(path):
        return f"{STATE_FILE} does not describe step {_step_of(path)}"
    if not (path / "config.yaml").is_file():
        return "config.yaml missing"
    spec = written_by(path)
    roles = [POLICY_DIR, *([CRITIC_DIR] if (path / CRITIC_DIR).is_dir() else [])]
    problem = next(filter(None, (spec.checkpoint_problem(path / role, role) for role in roles)), None) \
        if spec else None
    problem = problem or _check_manifest(path, verify_checksums)
    if problem is None and verify_checksums and spec:  # the files are those saved: read what loading would unpickle
        problem = next(filter(None, (spec.checkpoint_problem(path / role, role, verify=True) for role in roles)), None)
    return problem


def written_by(path: Path) -> TrainingSpec | None:
    """The training backend that wrote checkpoint `path`, from the config saved in it; None where this
    novarl cannot read that config (another version's): the files are then checked against the
    manifest alone, and resuming or converting, which read the config, say what is wrong with it
    before anything is loaded."""
    from novarl.backends.registry import trains_on
    from novarl.config import load_config

    try:
        return trains_on(load_config(path / "config.yaml"))
    except (UserError, OSError, UnicodeDecodeError):
        return None


def resume_problem(state: dict[str, Any]) -> str | None:
    """None if a trainer_state.json's content is what resuming reads (the data position, the
    RNG state, the summary), else what is wrong with it."""
    sampler = state.get("sampler")
    if not isinstance(sampler, dict) or not all(_is_count(sampler.get(k)) for k in ("epoch", "position")):
        return f"{STATE_FILE} has no data position (sampler epoch and position)"
    rng = state.get("rng")
    if rng is not None and not _is_rng_state(rng):
        return f"{STATE_FILE} has a malformed RNG state"
    summary = state.get("summary", {})
    if not isinstance(summary, dict) or not all(isinstance(v, (int, float)) for v in summary.values()):
        return f"{STATE_FILE} has a malformed summary"
    return None


def _check_manifest(path: Path, verify_checksums: bool) -> str | None:
    """None when every file the manifest lists has its size (and, verifying, its checksum);
    also None without a manifest (an older checkpoint: `Checkpointer.latest` says so)."""
    if not (path / MANIFEST_FILE).is_file():
        return None
    try:
        files = json.loads((path / MANIFEST_FILE).read_text())["files"]
        entries = sorted((str(name), int(e["size"]), str(e[CHECKSUM])) for name, e in files.items())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError,
            AttributeError) as err:
        return f"{MANIFEST_FILE} unreadable: {type(err).__name__}: {err}"
    for name, size, _ in entries:
        file = path / name
        if ".." in Path(name).parts or Path(name).is_absolute():
            return f"{MANIFEST_FILE} names a file outside the checkpoint: {name}"
        if not file.is_file():
            return f"{name} missing"
        if file.stat().st_size != size:
            return f"{name} is {file.stat().st_size} bytes, {size} when saved"
    if verify_checksums:
        digests = digest_all([path / name for name, _, _ in entries])
        for (name, _, expected), (_, got) in zip(entries, digests):
            if got != expected:
                return f"{name} does not match its checksum: changed since it was saved"
    return None


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_rng_state(rng: Any) -> bool:
    if not isinstance(rng, dict):
        return False
    python, cpu = rng.get("python"), rng.get("torch")
    return (isinstance(python, list) and len(python) == 3 and isinstance(python[0], int)
            and isinstance(python[1], list) and all(isinstance(v, int) for v in python[1])
            and isinstance(cpu, list) and all(isinstance(v, int) and 0 <= v < 256 for v in cpu))


# ------------------------------------------------------------------ writing
def mark_finished(checkpoint: Path, record: dict[str, Any]) -> None:
    """Note in `checkpoint` that the run which wrote it has ended (`record`: where its results are).
    Not covered by the manifest: it is written after, and only read by `finished_record`."""
    tmp = checkpoint / f".{FINISHED_FILE}.tmp-{owner_tag()}"
    write_synced(tmp, json.dumps(record, indent=1))
    tmp.rename(checkpoint / FINISHED_FILE)
    fsync_path(checkpoint)


def finished_record(checkpoint: Path) -> dict[str, Any] | None:
    """What `mark_finished` wrote in `checkpoint`, or None if the run that wrote it did not end."""
    try:
        record = json.loads((checkpoint / FINISHED_FILE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return record if isinstance(record, dict) else None


# ------------------------------------------------------------------ failures and leftovers
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
