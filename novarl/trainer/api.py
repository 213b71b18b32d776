"""The Python API of the seeds: `novarl.train(...)` and `GRPOTrainer`."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from novarl.config import NovaRLConfig, dump_config, load_config
from novarl.config.loading import with_warnings
from novarl.trainer.starting import load_api_config
from novarl.data.arithmetic import Example
from novarl.data.datasets import BUNDLED_DATASETS
from novarl.errors import CheckpointLoadFailed, RunFailed, UserError
from novarl.logging.metrics import JsonlSink, read_jsonl
from novarl.logging.trackers import open_trackers
from novarl.backends.registry import trains_on
from novarl.trainer.checkpoint import STATE_FILE, Checkpoint, Checkpointer, mark_finished

if TYPE_CHECKING:
    from novarl.trainer.setup import Roles

RewardFn = Callable[..., float]


@dataclass(frozen=True)
class TrainResult:
    metrics: dict[str, float]
    """Last step's metrics and the final evaluation (val_accuracy, ...)."""
    output_dir: Path
    """The run's folder: metrics.jsonl, config.yaml, reward_curve.png, policy/."""
    model_dir: Path
    """The final policy as a Hugging Face folder (transformers and vLLM load it as is)."""
    initial_accuracy: float | None = None
    final_accuracy: float | None = None
    steps: int = 0
    accuracy_source: str = "held-out"
    """Where the evaluation prompts came from: "held-out", or "training-set" when the data has no held-out split."""
    stopped_early: bool = False
    """True when the run ended before grpo.max_num_steps: on grpo.max_train_seconds, or once an evaluation
    reached grpo.stop_at_validation_threshold (`stopped_by` says which)."""
    stopped_by: str | None = None
    """The key that ended the run early: "grpo.max_train_seconds" or "grpo.stop_at_validation_metric"."""
    extras: dict[str, Any] = field(default_factory=dict)


class GRPOTrainer:
    """GRPO on the configured backends.

        trainer = GRPOTrainer.from_pretrained("tiny-arith", max_num_steps=100)
        result = trainer.train()

    config: a NovaRLConfig, a dict, a YAML path, or None: the recipe for the model the
    overrides name (model_name=...): the bundled one (tiny model, arithmetic task) for a bundled
    model, NeMo RL's grpo_math_1B sizes for any other, fitted to this host and said in the log
    (trainer/starting.py). Keyword overrides go on top. tensor_parallel_size= (and
    context_parallel_size=) without a cluster size takes this host's visible GPUs as
    cluster.gpus_per_node, and refuses what they cannot hold.
    """

    def __init__(self, config: NovaRLConfig | Mapping[str, Any] | str | Path | None = None, *,
                 reward_fn: str | RewardFn | None = None, train_examples: Sequence[Example] | None = None,
                 checkpoints_in_run_folder: bool = False, **overrides: Any) -> None:
        if isinstance(config, NovaRLConfig):
            if overrides:  # read again from what it sets, as a dict is (tensor_parallel_size= sizes the cluster)
                config = with_warnings(load_api_config(config.model_dump(by_alias=True, exclude_unset=True), overrides),
                                       config.load_warnings, config.load_notes)
            self.config = config
        else:
            self.config = load_api_config(config, overrides)
        self.reward_fn = reward_fn
        self.roles: Roles | None = None
        """The policy, reference and generator of the last `train()`, kept for inspection."""
        self.train_examples = list(train_examples) if train_examples is not None else None
        self.checkpoints_in_run_folder = checkpoints_in_run_folder
        """Checkpoints to <run folder>/checkpoints unless the config sets checkpointing.checkpoint_dir."""

    @classmethod
    def from_pretrained(cls, name_or_path: str, config: Mapping[str, Any] | str | Path | None = None,
                        **overrides: Any) -> "GRPOTrainer":
        """A trainer for the model `name_or_path` (hub id, folder, or bundled name), with overrides."""
        return cls(config, model_name=name_or_path, **overrides)

    def train(self, resume: bool | None = None) -> TrainResult:
        """Run GRPO. resume: None continues from the newest good checkpoint in
        checkpointing.checkpoint_dir if there is one; True requires one; False
        requires there is none (a fresh run never overwrites checkpoints).

        Everything that bad input can fail is checked before the run folder is made;
        a start that fails later (a worker, an engine) removes the folder it made."""
        from novarl.logging.console import info
        from novarl.logging.quiet import quiet_third_party
        from novarl.plan.auto import apply_auto
        from novarl.trainer.setup import prepare_inputs

        quiet_third_party()
        cfg, why = apply_auto(self.config)
        for line in why:
            info(line)
        inputs = prepare_inputs(cfg, self.reward_fn, self.train_examples)
        sweep_run_folders(Path(cfg.logger.log_dir))
        run_dir = new_run_dir(Path(cfg.logger.log_dir))
        if self.checkpoints_in_run_folder and "checkpoint_dir" not in cfg.checkpointing.model_fields_set:
            cfg = cfg.model_copy(update={"checkpointing": cfg.checkpointing.model_copy(
                update={"checkpoint_dir": str(run_dir / "checkpoints")})})
        try:
            trackers = open_trackers(cfg.logger, run_dir, cfg.model_dump(mode="json", by_alias=True))
        except BaseException:
            shutil.rmtree(run_dir, ignore_errors=True)
            raise
        for tracker in trackers:
            info(f"tracker: {tracker.where}")
        sink = JsonlSink(run_dir / "metrics.jsonl", trackers)
        try:
            return self._run(cfg, inputs, run_dir, sink, resume)
        except BaseException:
            sink.close()
            if not sink.count("train"):  # nothing trained: leave no folder behind
                shutil.rmtree(run_dir, ignore_errors=True)
            raise
        finally:
            sink.close()

    def _run(self, cfg: NovaRLConfig, inputs, run_dir: Path, sink: JsonlSink, resume: bool | None) -> TrainResult:
        from novarl.logging.console import info
        from novarl.logging.plots import plot_reward_curve

        checkpointer = Checkpointer(cfg.checkpointing, dump_config(cfg)) if cfg.checkpointing.enabled else None
        if checkpointer is not None:
            checkpointer.sweep()
        start = pick_checkpoint(checkpointer, resume, cfg)
        (run_dir / "config.yaml").write_text(dump_config(cfg))
        info(f"output folder: {run_dir}")
        model_dir = run_dir / "policy"
        try:
            summary = self._train_and_export(cfg, inputs, sink, checkpointer, start, model_dir)
        except RunFailed as err:
            newest = checkpointer.latest() if checkpointer else None
            where = (f"the newest good checkpoint is {newest.path}; `novarl train` with the same config "
                     "resumes from it" if newest else "no checkpoint was written (checkpointing.enabled)")
            raise RunFailed(f"{err} Metrics so far are in {run_dir}; {where}.") from None
        plot = plot_reward_curve(read_jsonl(sink.path), run_dir / "reward_curve.png",
                                 title=f"GRPO on {cfg.policy.model_name}")
        sink.log_image(plot, "reward_curve")
        sink.close()
        if checkpointer is not None:
            finish_checkpoints(checkpointer, int(summary.get("steps", 0)), run_dir=run_dir, model_dir=model_dir)
        info(f"saved the policy to {model_dir} and the reward curve to {plot}")
        stopped_by = "grpo.max_train_seconds" if summary.get("stopped_on_time_budget") else \
            "grpo.stop_at_validation_metric" if summary.get("stopped_on_validation_metric") else None
        return TrainResult(metrics=summary, output_dir=run_dir, model_dir=model_dir,
                           initial_accuracy=summary.get("initial_accuracy"),
                           final_accuracy=summary.get("val_accuracy"), steps=int(summary.get("steps", 0)),
                           accuracy_source=inputs.val_source,
                           stopped_early=stopped_by is not None, stopped_by=stopped_by)

    def _train_and_export(self, cfg: NovaRLConfig, inputs, sink: JsonlSink, checkpointer: Checkpointer | None,
                          start: Checkpoint | None, model_dir: Path) -> dict[str, float]:
        """Build the roles, run GRPO from `start` (none left to train: the final evaluation only) and
        write the policy as a Hugging Face folder at model_dir; the roles are shut down after.

        A checkpoint that fails to load (it passed `check_checkpoint`, but torch, the backend or the
        data position refused it) is reported in one line and the next older good one used, on roles
        built anew: a failed load may have left them half-loaded, or stopped their Ray ranks.
        A second failure in a row, or none older to use, raises UserError."""
        import torch

        from novarl.distributed.lifecycle import Stoppable
        from novarl.distributed.local import default_device
        from novarl.logging.console import info
        from novarl.models.loading import export_format
        from novarl.trainer.grpo import run_grpo
        from novarl.trainer.setup import build_roles

        before_resume = sink.path.stat().st_size
        failed: Checkpoint | None = None
        while True:
            torch.manual_seed(cfg.grpo.seed)
            roles = self.roles = build_roles(cfg, inputs, default_device())
            try:
                summary = run_grpo(without_done_evaluation(cfg, start), inputs, roles, sink, checkpointer, start)
                fmt = export_format(cfg.policy.precision, cfg.checkpointing.model_save_format,
                                    on_gpu=default_device().type == "cuda")
                roles.release_generator()  # a colocated engine's memory back before the export wakes the weights
                save_atomically(model_dir, lambda tmp: roles.policy.save_hf(tmp, inputs.tokenizer, fmt))
                return summary
            except CheckpointLoadFailed as err:
                if checkpointer is None or start is None:
                    raise
                reason = err.reason
                if failed is not None:
                    raise UserError(f"Checkpoints {failed.path} and {start.path} both failed to load (the last: "
                                    f"{reason}); two in a row point at this environment rather than at the files. "
                                    "Fix the cause, or delete them to resume from an older one.") from err
                info(f"checkpoint {start.path} could not be loaded ({reason}); trying an older one")
                failed, start = start, newest_resumable(checkpointer, before=start.step)
                if start is None:
                    raise UserError(f"Checkpoint {failed.path} could not be loaded ({reason}), and "
                                    f"'{checkpointer.root}' holds no older usable one. Delete that checkpoint "
                                    "to start over, or fix the cause and run again.") from err
                check_resumable(start, cfg)
                os.truncate(sink.path, before_resume)  # the failed attempt's history and "resume" record
            finally:
                roles.shutdown()
                if isinstance(inputs.episodes, Stoppable):  # an agents' endpoint
                    inputs.episodes.shutdown()


def pick_checkpoint(checkpointer: Checkpointer | None, resume: bool | None,
                    config: NovaRLConfig) -> Checkpoint | None:
    """The checkpoint to go on from: the newest one that passes every check (checksums
    included); None for a fresh run. Raises UserError when `resume` cannot be honoured or the
    checkpoint is of another run, or of one that already finished (see `check_resumable`)."""
    from novarl.logging.console import info

    if checkpointer is None:
        if resume:
            raise UserError("Resuming needs checkpointing.enabled=true and its checkpoint_dir.")
        return None
    if resume is False:
        latest = checkpointer.latest()
        if latest is not None:
            raise UserError(f"checkpointing.checkpoint_dir='{checkpointer.root}' already holds checkpoints "
                            f"(newest: {latest.path.name}); resume, or give another checkpoint_dir.")
        return None
    latest = newest_resumable(checkpointer)
    if resume and latest is None:
        raise UserError(f"Nothing to resume: no complete checkpoint in "
                        f"checkpointing.checkpoint_dir='{checkpointer.root}'.")
    if latest is not None:
        check_resumable(latest, config)
        if latest.step == config.grpo.max_num_steps:
            info(f"checkpoint {latest.path} is the run's last step, but the run did not end (killed during its "
                 "final evaluation, export or clean-up): finishing it")
    return latest


def newest_resumable(checkpointer: Checkpointer, *, before: int | None = None) -> Checkpoint | None:
    """The newest checkpoint (older than step `before` if given) that passes `check_checkpoint`
    with its checksums and whose trainer state resuming can read; each one skipped is
    reported in one line."""
    from novarl.logging.console import info
    from novarl.trainer.checkpoint import resume_problem

    latest = checkpointer.latest(verify=True, before=before)
    while latest is not None and (problem := resume_problem(latest.state)) is not None:
        info(f"checkpoint {latest.path} is not usable ({problem}); trying an older one")
        latest = checkpointer.latest(verify=True, before=latest.step)
    return latest


def check_resumable(latest: Checkpoint, config: NovaRLConfig) -> None:
    """Refuse to continue a checkpoint of another experiment, or one already finished: past
    grpo.max_num_steps, or at it with the run that wrote it ended (`mark_finished`). At
    max_num_steps without that mark, the run was killed after its last save: it is finished
    (final evaluation, export, prune) rather than refused."""
    from novarl.trainer.checkpoint import CRITIC_DIR, finished_record

    saved = load_config(latest.path / "config.yaml")
    keys = ("policy.model_name", "policy.hf_config_overrides", "policy.tokenizer.name",
            "policy.dtensor_cfg.tensor_parallel_size", "policy.optimizer.name")
    differ = [k for k in keys if _get(saved, k) != _get(config, k)]
    where = f"checkpointing.checkpoint_dir='{latest.path.parent}'"
    written_by, spec = trains_on(saved), trains_on(config)
    if written_by.name != spec.name:
        raise UserError(f"{where} holds a checkpoint of the {written_by.name} training backend, and this config trains "
                        f"on {spec.name}: resume with the config of the run that wrote it, or turn the checkpoint into "
                        "a Hugging Face folder with `novarl convert` and start from that.")
    problem = spec.resume_problem(saved, config)
    if problem:
        raise UserError(f"{where} {problem}")
    has_critic = (latest.path / CRITIC_DIR).is_dir()
    if has_critic != (config.value is not None):
        raise UserError(f"{where} holds a checkpoint {'with' if has_critic else 'without'} PPO's critic "
                        f"({CRITIC_DIR}/), and this config has {'none' if has_critic else 'one'} "
                        f"(grpo.adv_estimator.name={config.grpo.adv_estimator.name}): resume with the config of the "
                        "run that wrote it, or give another checkpoint_dir.")
    if has_critic and saved.value is not None:
        differ += [k for k in ("value.model_name", "value.tokenizer.name") if _get(saved, k) != _get(config, k)]
    if differ:
        shown = ", ".join(f"{k}: {_get(saved, k)!r} there, {_get(config, k)!r} here" for k in differ)
        raise UserError(f"{where} holds a checkpoint of another run ({shown}). Give another checkpoint_dir, "
                        "or delete that folder to start over.")
    finished = finished_record(latest.path)
    stop = (config.grpo.stop_at_validation_metric, config.grpo.stop_at_validation_threshold)
    if finished and latest.state.get("summary", {}).get("stopped_on_validation_metric") \
            and (saved.grpo.stop_at_validation_metric, saved.grpo.stop_at_validation_threshold) == stop:
        raise UserError(f"{where} is at step {latest.step}, where the run that wrote it stopped: its evaluation's "
                        f"{stop[0]} reached grpo.stop_at_validation_threshold={stop[1]:g} (its policy is in "
                        f"{finished.get('model_dir')}). Raise the threshold (or unset grpo.stop_at_validation_metric) "
                        "to go on, or give another checkpoint_dir.")
    if latest.step > config.grpo.max_num_steps or (latest.step == config.grpo.max_num_steps and finished):
        ended = (f" (the run that reached it ended: its policy is in {finished.get('model_dir')})"
                 if finished and latest.step == config.grpo.max_num_steps else "")
        raise UserError(f"{where} is already at step {latest.step}, and grpo.max_num_steps="
                        f"{config.grpo.max_num_steps}: nothing left to train{ended}. Raise grpo.max_num_steps "
                        "to go on, or give another checkpoint_dir.")


def finish_checkpoints(checkpointer: Checkpointer, step: int, *, run_dir: Path, model_dir: Path) -> None:
    """After a run's ending (evaluation, export, curve): prune (again: a run killed while pruning,
    then finished, did not) and mark its last checkpoint, so that the same command refuses to redo it."""
    checkpointer.prune()
    last = checkpointer.root / f"step_{step}"
    if (last / STATE_FILE).is_file():
        mark_finished(last, {"run_dir": str(run_dir), "model_dir": str(model_dir)})


def without_done_evaluation(cfg: NovaRLConfig, start: Checkpoint | None) -> NovaRLConfig:
    """`cfg`, without the final evaluation when `start` is the last step and already holds it (the run
    was killed after it, during the export): its result and record come with the checkpoint."""
    summary = start.state.get("summary", {}) if start is not None else {}
    if start is None or start.step != cfg.grpo.max_num_steps or summary.get("val_step") != start.step:
        return cfg
    return cfg.model_copy(update={"grpo": cfg.grpo.model_copy(update={"val_at_end": False})})


def _get(config: NovaRLConfig, path: str):
    value = config
    for part in path.split("."):
        value = getattr(value, part)
    return value


def train(model: str | None = None, dataset: str | Sequence[Mapping[str, Any]] | None = None,
          reward_fn: str | RewardFn | None = None, config: Mapping[str, Any] | str | Path | None = None,
          **overrides: Any) -> TrainResult:
    """Train with GRPO in one call.

    model: hub id, local folder, or bundled name ("tiny-arith").
    dataset: a bundled task name ("arithmetic"), a .jsonl/.parquet file, or a
      list of {"prompt": ..., "answer": ...} dicts.
    reward_fn: a callable fn(completion, answer) -> float, a registered name
      ("exact_match"), or "module:function".
    config: a YAML path or a dict; None starts from the recipe for `model` (as `novarl train`
      does): the bundled tiny recipe for a bundled model, NeMo RL's grpo_math_1B sizes otherwise.
    overrides: keyword overrides (see `load_config`), e.g. max_num_steps=200.

    Each call is a new run: checkpoints (when enabled) go to <run folder>/checkpoints
    unless checkpointing.checkpoint_dir is given.
    """
    examples = None
    if isinstance(dataset, str):
        key = "data__dataset_name" if dataset in BUNDLED_DATASETS else "data__train_data_path"
        overrides.setdefault(key, dataset)
    elif dataset is not None:
        examples = [_example_from(row, i) for i, row in enumerate(dataset)]
    if model is not None:
        overrides["model_name"] = model
    return GRPOTrainer(config, reward_fn=reward_fn, train_examples=examples, checkpoints_in_run_folder=True,
                       **overrides).train()


def _example_from(row: Any, index: int) -> Example:
    if isinstance(row, Example):
        return row
    if isinstance(row, Mapping) and "prompt" in row and "answer" in row:
        return Example(prompt=str(row["prompt"]), answer=str(row["answer"]))
    raise UserError(f"dataset[{index}] must be a dict with 'prompt' and 'answer', got {row!r}.")


def new_run_dir(log_dir: Path) -> Path:
    """A fresh numbered folder log_dir/exp_NNN; earlier runs are never touched."""
    log_dir.mkdir(parents=True, exist_ok=True)
    numbers = [int(p.name[4:]) for p in log_dir.glob("exp_*") if p.name[4:].isdigit()]
    number = max(numbers, default=0) + 1
    while True:
        path = log_dir / f"exp_{number:03d}"
        try:
            path.mkdir()
            return path
        except FileExistsError:
            number += 1


def save_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """Write into a temporary sibling (`.<name>.tmp-<host>-<pid>`), fsync it, then rename: a crash never
    leaves a half folder at `path`, and the next save to `path` (or the next run's sweep) removes the
    temporary a killed writer left. A write the OS refuses (a full disk, ...) removes the temporary
    and raises UserError."""
    from novarl.trainer.checkpoint_files import discard_partial, fsync_tree, owner_tag, replace_dir, sweep_temp_folders

    sweep_temp_folders(path.parent, only=path.name)
    tmp = path.with_name(f".{path.name}.tmp-{owner_tag()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write(tmp.absolute())  # the writer may be a Ray rank, whose working directory is not necessarily ours
        fsync_tree(tmp)
        replace_dir(tmp, path)
    except BaseException as err:
        failure = discard_partial(tmp, err, f"Writing '{path}'")
        if failure is None:
            raise
        raise UserError(f"{failure} Free some space or fix the cause, then run again.") from err


def sweep_run_folders(log_dir: Path) -> None:
    """Remove the temporary copies killed runs left in log_dir's run folders (a `.policy.tmp-*`
    from an export cut short) and in their checkpoints/ (`novarl.train`'s checkpoint_dir)."""
    from novarl.trainer.checkpoint_files import sweep_temp_folders

    for run in sorted(log_dir.glob("exp_*")):
        sweep_temp_folders(run)
        sweep_temp_folders(run / "checkpoints")
