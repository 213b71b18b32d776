"""One run writes TensorBoard events, an offline W&B run and an MLflow run (a local file store)
with the same step metrics as metrics.jsonl; each is read back with its own reader."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest

from novarl.cli import main
from novarl.config import load_config
from novarl.logging.metrics import read_jsonl
from novarl.logging.trackers import missing_packages
from novarl.backends.contract.checks import check_config

pytest.importorskip("tensorboard")
pytest.importorskip("wandb")
pytest.importorskip("mlflow")

pytestmark = pytest.mark.slow


def wandb_history(run_file: Path) -> list[dict[str, float]]:
    """The history rows of a W&B run file (.wandb): a LevelDB-style log of protobuf records, 32 KiB
    blocks, each record chunk with a 7-byte header (crc, length, type), after a 7-byte file header."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos = run_file.read_bytes(), 32768, 7
    assert data.startswith(b":W&B")
    records, pending = [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        if kind == 0 and length == 0:  # zero padding to the block's end
            pos += left - 7
            continue
        chunk, pos = data[pos:pos + length], pos + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            records.append(pending)
    rows = []
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def test_one_run_feeds_tensorboard_wandb_and_mlflow_the_same_metrics(tmp_path, monkeypatch, capsys):
    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = f"file:{tmp_path / 'mlruns'}"
    code = main(["train", "grpo.max_num_steps=4", "grpo.val_period=2", "grpo.max_val_samples=20",
                 "policy.generation.backend=hf", "logger.progress_bar=false", "logger.print_every_n_steps=1",
                 f"logger.log_dir={tmp_path / 'logs'}", "logger.tensorboard_enabled=true",
                 "logger.wandb_enabled=true", "logger.wandb.project=novarl-test", "logger.mlflow_enabled=true",
                 f"logger.mlflow.tracking_uri={uri}", "logger.mlflow.experiment_name=novarl-test"])
    assert code == 0, capsys.readouterr().err
    run_dir = tmp_path / "logs" / "exp_001"
    records = read_jsonl(run_dir / "metrics.jsonl")
    expected = {}
    for record in records:
        prefix = {"train": "train", "eval": "validation"}.get(record["kind"])
        for key, value in record.items():
            if prefix and key not in ("kind", "step") and isinstance(value, (int, float)) and value is not None \
                    and not isinstance(value, bool) and math.isfinite(value):
                expected[(f"{prefix}/{key}", record["step"])] = float(value)
    assert ("train/reward_mean", 4) in expected and ("validation/accuracy", 4) in expected

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0}).Reload()
    tensorboard = {(tag, e.step): e.value for tag in events.Tags()["scalars"] for e in events.Scalars(tag)}
    assert tensorboard.keys() == expected.keys()
    assert all(tensorboard[k] == pytest.approx(v, rel=1e-6, abs=1e-6) for k, v in expected.items())  # float32

    (run_file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    history = wandb_history(run_file)
    logged = {(k, row["_step"]): v for row in history if "_step" in row for k, v in row.items() if not k.startswith("_")
              and isinstance(v, (int, float))}
    assert {k: v for k, v in logged.items() if k in expected} == expected
    assert set(expected) <= set(logged)

    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("novarl-test").experiment_id])
    assert run.info.run_name == "exp_001" and run.info.status == "FINISHED"
    assert run.data.params["policy.model_name"] == "tiny-arith"
    mlflow = {(key, m.step): m.value for key in run.data.metrics for m in client.get_metric_history(run.info.run_id,
                                                                                                       key)}
    assert mlflow == expected
    assert any(a.path == "reward_curve.png" for a in client.list_artifacts(run.info.run_id))


def test_a_tracker_without_its_package_is_refused_by_validate(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    cfg = load_config({"logger": {"wandb_enabled": True, "tensorboard_enabled": True}})
    assert missing_packages(cfg.logger) == ["logger.wandb_enabled: the wandb package is not installed: pip install "
                                            "'novarl[wandb]'"]
    assert [str(p) for p in check_config(cfg).problems] == [missing_packages(cfg.logger)[0] + "."]
