"""The Python API of the seeds: `novarl.train(...)` and `GRPOTrainer`."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from novarl.config import BUNDLED_RECIPE, NovaRLConfig, dump_config, load_config
from novarl.data.arithmetic import Example
from novarl.data.datasets import BUNDLED_DATASETS
from novarl.errors import RunFailed, UserError
from novarl.logging.metrics import JsonlSink, read_jsonl
from novarl.plan.resolve import world_size
from novarl.trainer.checkpoint import POLICY_DIR, Checkpoint, Checkpointer

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
    """True when grpo.max_train_seconds ended the run before grpo.max_num_steps."""
    extras: dict[str, Any] = field(default_factory=dict)


class GRPOTrainer:
    """GRPO on the configured backends.

        trainer = GRPOTrainer.from_pretrained("tiny-arith", max_num_steps=100)
        result = trainer.train()

    config: a NovaRLConfig, a dict, a YAML path, or None for the bundled recipe
    (`novarl train`'s default: tiny model, arithmetic task); keyword overrides go on top.
    """

    def __init__(self, config: NovaRLConfig | Mapping[str, Any] | str | Path | None = None, *,
                 reward_fn: str | RewardFn | None = None, train_examples: Sequence[Example] | None = None,
                 checkpoints_in_run_folder: bool = False, **overrides: Any) -> None:
        if isinstance(config, NovaRLConfig):
            if overrides:
                config = load_config(config.model_dump(by_alias=True, exclude_unset=True), **overrides)
            self.config = config
        else:
            self.config = load_config(BUNDLED_RECIPE if config is None else config, **overrides)
        self.reward_fn = reward_fn
        self.roles = None
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
        run_dir = new_run_dir(Path(cfg.logger.log_dir))
        if self.checkpoints_in_run_folder and "checkpoint_dir" not in cfg.checkpointing.model_fields_set:
            cfg = cfg.model_copy(update={"checkpointing": cfg.checkpointing.model_copy(
                update={"checkpoint_dir": str(run_dir / "checkpoints")})})
        sink = JsonlSink(run_dir / "metrics.jsonl")
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
        import torch

        from novarl.distributed.local import default_device
        from novarl.logging.console import info
        from novarl.logging.plots import plot_reward_curve
        from novarl.trainer.grpo import run_grpo
        from novarl.trainer.setup import build_roles

        checkpointer = Checkpointer(cfg.checkpointing, dump_config(cfg)) if cfg.checkpointing.enabled else None
        start = pick_checkpoint(checkpointer, resume, cfg)
        (run_dir / "config.yaml").write_text(dump_config(cfg))
        torch.manual_seed(cfg.grpo.seed)
        roles = self.roles = build_roles(cfg, inputs, default_device())
        info(f"output folder: {run_dir}")
        model_dir = run_dir / "policy"
        try:
            summary = run_grpo(cfg, inputs, roles, sink, checkpointer, start)
            save_atomically(model_dir, lambda tmp: roles.policy.save_hf(tmp, inputs.tokenizer))
        except RunFailed as err:
            newest = checkpointer.latest() if checkpointer else None
            where = (f"the newest good checkpoint is {newest.path}; `novarl train` with the same config "
                     "resumes from it" if newest else "no checkpoint was written (checkpointing.enabled)")
            raise RunFailed(f"{err} Metrics so far are in {run_dir}; {where}.") from None
        finally:
            roles.shutdown()
        sink.close()
        plot = plot_reward_curve(read_jsonl(sink.path), run_dir / "reward_curve.png",
                                 title=f"GRPO on {cfg.policy.model_name}")
        info(f"saved the policy to {model_dir} and the reward curve to {plot}")
        return TrainResult(metrics=summary, output_dir=run_dir, model_dir=model_dir,
                           initial_accuracy=summary.get("initial_accuracy"),
                           final_accuracy=summary.get("val_accuracy"), steps=int(summary.get("steps", 0)),
                           accuracy_source="held-out" if inputs.val_source == "held-out" else "training-set",
                           stopped_early=bool(summary.get("stopped_on_time_budget")))


def pick_checkpoint(checkpointer: Checkpointer | None, resume: bool | None,
                    config: NovaRLConfig) -> Checkpoint | None:
    if checkpointer is None:
        if resume:
            raise UserError("Resuming needs checkpointing.enabled=true and its checkpoint_dir.")
        return None
    latest = checkpointer.latest()
    if resume and latest is None:
        raise UserError(f"Nothing to resume: no complete checkpoint in "
                        f"checkpointing.checkpoint_dir='{checkpointer.root}'.")
    if resume is False and latest is not None:
        raise UserError(f"checkpointing.checkpoint_dir='{checkpointer.root}' already holds checkpoints "
                        f"(newest: {latest.path.name}); resume, or give another checkpoint_dir.")
    if latest is not None:
        check_resumable(latest, config)
    return latest


def check_resumable(latest: Checkpoint, config: NovaRLConfig) -> None:
    """Refuse to continue a checkpoint of another experiment, or one already finished."""
    saved = load_config(latest.path / "config.yaml")
    keys = ("policy.model_name", "policy.tokenizer.name", "policy.dtensor_cfg.tensor_parallel_size",
            "policy.optimizer.name")
    differ = [k for k in keys if _get(saved, k) != _get(config, k)]
    where = f"checkpointing.checkpoint_dir='{latest.path.parent}'"
    if (latest.path / POLICY_DIR / "deepspeed").is_dir() and world_size(saved) != world_size(config):
        raise UserError(f"{where} holds a DeepSpeed checkpoint written by {world_size(saved)} ranks; ZeRO's "
                        f"partitions load only on as many ranks, and this config has {world_size(config)} "
                        "(cluster.gpus_per_node x cluster.num_nodes). `novarl convert` turns it into a "
                        "Hugging Face folder on any number.")
    if differ:
        shown = ", ".join(f"{k}: {_get(saved, k)!r} there, {_get(config, k)!r} here" for k in differ)
        raise UserError(f"{where} holds a checkpoint of another run ({shown}). Give another checkpoint_dir, "
                        "or delete that folder to start over.")
    if latest.step >= config.grpo.max_num_steps:
        raise UserError(f"{where} is already at step {latest.step}, and grpo.max_num_steps="
                        f"{config.grpo.max_num_steps}: nothing left to train. Raise grpo.max_num_steps to go on, "
                        "or give another checkpoint_dir.")


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
    config: a YAML path or a dict; None starts from the bundled recipe (as `novarl train`).
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
    """Write into a temporary sibling, then rename: a crash never leaves a half folder at `path`."""
    import shutil

    from novarl.trainer.checkpoint import replace_dir

    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp)
    replace_dir(tmp, path)
