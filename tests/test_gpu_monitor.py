"""logger.monitor_gpus: each step's GPU memory and utilisation in its metrics, where CUDA exists."""

from __future__ import annotations

import pytest
import torch

from novarl.cli import BUNDLED_RECIPE
from novarl.config import load_config
from novarl.distributed.gpu_monitor import gpu_stats
from novarl.logging.metrics import read_jsonl
from novarl.trainer.api import GRPOTrainer

pytestmark = pytest.mark.slow


def test_monitoring_gpus_adds_their_readings_to_each_step_where_cuda_exists(tmp_path):
    cfg = load_config(BUNDLED_RECIPE, overrides=[
        "grpo.max_num_steps=2", "grpo.val_at_start=false", "grpo.val_period=0", "logger.monitor_gpus=true",
        "logger.progress_bar=false", f"logger.log_dir={tmp_path}", "policy.generation.backend=hf"])
    assert cfg.load_warnings == ()  # monitor_gpus is a feature now, not a warned key
    result = GRPOTrainer(cfg).train()
    steps = [r for r in read_jsonl(result.output_dir / "metrics.jsonl") if r["kind"] == "train"]
    gpu_keys = {k for r in steps for k in r if k.startswith("gpu_")}
    if torch.cuda.is_available():
        assert {"gpu_memory_allocated_gb", "gpu_memory_peak_gb", "gpu_memory_reserved_gb"} <= gpu_keys
        assert all(0 < r["gpu_memory_peak_gb"] < 1e4 for r in steps)
    else:
        assert gpu_keys == set() and gpu_stats() == {}  # nothing to read on a CPU host


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_peak_is_the_steps_own():
    x = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")  # 256 MiB
    del x  # gone before the first reading, but within its interval
    torch.cuda.empty_cache()
    first = gpu_stats()
    second = gpu_stats()  # an interval without the 256 MiB
    assert first["gpu_memory_peak_gb"] >= 0.26 and second["gpu_memory_peak_gb"] < first["gpu_memory_peak_gb"]
