"""Experiment trackers: TensorBoard, Weights & Biases and MLflow, behind one interface.

Enabled by NeMo RL's keys (`logger.tensorboard_enabled`, `wandb_enabled`, `mlflow_enabled`;
`logger.wandb.{project, name, entity}`, `logger.mlflow.{experiment_name, run_name,
tracking_uri, artifact_location}`), each an optional extra imported only when enabled. Each
gets the run's config once, every record metrics.jsonl gets (training steps as `train/<key>`,
evaluations as `validation/<key>`, at their step), and the reward curve at the end. Their
files go under the run folder as NeMo RL lays them out: `tensorboard/`, `wandb/`; MLflow
writes where its tracking URI says (`logger.mlflow.tracking_uri`, else $MLFLOW_TRACKING_URI,
else MLflow's default). W&B follows its own environment: `WANDB_MODE=offline` writes the run
under `wandb/` for `wandb sync` later.

The trackers live in the driver process only; the ranks' metrics reach them through the
driver's records.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Protocol

from novarl.config.schema import LoggerConfig
from novarl.errors import UserError

PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
            "mlflow": ("mlflow", "mlflow")}
"""Tracker -> (module it needs, the novarl extra that installs it)."""

PREFIXES = {"train": "train", "eval": "validation"}
"""metrics.jsonl record kinds the trackers get, and their prefix there (NeMo RL's)."""


class Tracker(Protocol):
    where: str
    """For the log: what it is and where it writes."""

    def log_config(self, config: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def log_image(self, path: Path, name: str) -> None: ...
    def close(self) -> None: ...


def enabled(logger: LoggerConfig) -> list[str]:
    return [name for name in PACKAGES if getattr(logger, f"{name}_enabled")]


def missing_packages(logger: LoggerConfig) -> list[str]:
    """One line per enabled tracker whose package is not installed (torch-free)."""
    import importlib.util

    return [f"logger.{name}_enabled: the {PACKAGES[name][0]} package is not installed: pip install "
            f"'novarl[{PACKAGES[name][1]}]'" for name in enabled(logger)
            if importlib.util.find_spec(PACKAGES[name][0]) is None]


def open_trackers(logger: LoggerConfig, run_dir: Path, config: dict[str, Any]) -> list[Tracker]:
    """The enabled trackers, started, with the config logged; a tracker that cannot start
    (no package, W&B not logged in) is a UserError naming it, and the others are closed."""
    missing = missing_packages(logger)
    if missing:
        raise UserError("; ".join(missing) + ".")
    opened: list[Tracker] = []
    try:
        for name in enabled(logger):
            opened.append(OPENERS[name](logger, run_dir))
            opened[-1].log_config(config)
    except BaseException:
        for tracker in opened:
            tracker.close()
        raise
    return opened


def record_metrics(record: dict[str, Any]) -> tuple[dict[str, float], int] | None:
    """(prefixed finite numbers, step) of a metrics.jsonl record the trackers take, else None."""
    prefix = PREFIXES.get(str(record.get("kind")))
    if prefix is None or not isinstance(record.get("step"), int):
        return None
    numbers = {f"{prefix}/{k}": float(v) for k, v in record.items()
               if k not in ("kind", "step") and isinstance(v, (int, float)) and not isinstance(v, bool)
               and math.isfinite(v)}
    return numbers, record["step"]


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        out.update(_flat(value, path + ".") if isinstance(value, dict) else {path: value})
    return out


class TensorBoardTracker:
    def __init__(self, logger: LoggerConfig, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        self.where = f"TensorBoard: {run_dir / 'tensorboard'}"

    def log_config(self, config: dict[str, Any]) -> None:
        import yaml

        self.writer.add_text("config", "```\n" + yaml.safe_dump(config, sort_keys=False) + "\n```")

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def log_image(self, path: Path, name: str) -> None:
        pass  # the scalars are the curve, in TensorBoard's own plots

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, logger: LoggerConfig, run_dir: Path) -> None:
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        folder = run_dir / "wandb"
        folder.mkdir(parents=True, exist_ok=True)
        cfg = logger.wandb
        try:
            self.run = wandb.init(project=cfg.project, name=cfg.name, entity=cfg.entity, dir=str(run_dir),
                                  reinit="create_new")
        except Exception as err:  # not logged in, no network, a bad entity
            raise UserError(f"logger.wandb_enabled: W&B did not start ({type(err).__name__}: "
                            f"{str(err).splitlines()[0] if str(err) else ''}). Log in (wandb login, or "
                            "WANDB_API_KEY), or set WANDB_MODE=offline to write the run under the run folder "
                            "and `wandb sync` it later.") from None
        offline = self.run.settings.mode in ("offline", "dryrun")
        self.where = f"W&B: {Path(self.run.dir).parent if offline else self.run.url} (" + \
            ("offline: `wandb sync` uploads it)" if offline else "online)")

    def log_config(self, config: dict[str, Any]) -> None:
        self.run.config.update(config, allow_val_change=True)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def log_image(self, path: Path, name: str) -> None:
        import wandb

        self.run.log({name: wandb.Image(str(path))})

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    def __init__(self, logger: LoggerConfig, run_dir: Path) -> None:
        import mlflow

        cfg = logger.mlflow
        uri = cfg.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        try:
            self.client = mlflow.MlflowClient(tracking_uri=uri) if uri else mlflow.MlflowClient()
            experiment = self.client.get_experiment_by_name(cfg.experiment_name)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(
                cfg.experiment_name, artifact_location=cfg.artifact_location)
            self.run_id = self.client.create_run(experiment_id, run_name=cfg.run_name or run_dir.name).info.run_id
            self.where = (f"MLflow: run {self.run_id} of experiment '{cfg.experiment_name}' at "
                          f"{self.client.tracking_uri}")
        except Exception as err:  # a tracking server that does not answer, a store MLflow refuses
            raise UserError(f"logger.mlflow_enabled: MLflow did not start ({type(err).__name__}: "
                            f"{str(err).splitlines()[0] if str(err) else ''}); check logger.mlflow.tracking_uri "
                            f"({uri or 'MLflow default'}).") from None

    def log_config(self, config: dict[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(k, str(v)[:500]) for k, v in _flat(config).items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
            self.client.log_batch(self.run_id, params=params[start:start + 100])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        # MLflow's metric names allow letters, digits and _-./ and spaces only
        rows = [Metric(_mlflow_name(k), v, now, step) for k, v in metrics.items()]
        for start in range(0, len(rows), 1000):
            self.client.log_batch(self.run_id, metrics=rows[start:start + 1000])

    def log_image(self, path: Path, name: str) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _mlflow_name(key: str) -> str:
    return "".join(c if c.isalnum() or c in "_-./ " else "_" for c in key)


OPENERS = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MlflowTracker}
