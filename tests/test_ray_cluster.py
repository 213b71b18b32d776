"""The same config runs on a Ray cluster started beforehand (`ray start --head`),
joined through RAY_ADDRESS.

The cluster keeps its files in a temporary folder of its own and is ended by killing its own
processes: `ray stop` would kill every Ray instance on the machine (another test session's
too), and a run killed before its end would leave /tmp/ray/ray_current_cluster naming a dead
cluster, which every later `ray.init()` on the machine tries to join for minutes."""

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
RECIPE = Path(__file__).parents[1] / "examples" / "configs" / "grpo_tiny_fsdp2x2.yaml"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_ranks_on_an_existing_ray_cluster(tmp_path):
    pytest.importorskip("ray")
    ray_cli = str(Path(sys.executable).parent / "ray")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    port = free_port()
    temp_dir = tempfile.mkdtemp(prefix="ray_", dir="/tmp")  # short: Ray's socket paths live under it
    try:
        subprocess.run([ray_cli, "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1",
                        "--num-cpus=2", "--include-dashboard=false", "--disable-usage-stats",
                        f"--temp-dir={temp_dir}"], check=True, env=env, capture_output=True, timeout=120)
        run = subprocess.run(
            [sys.executable, "-m", "novarl.cli", "train", "-c", str(RECIPE), "grpo.max_num_steps=2",
             "grpo.val_at_start=false", "grpo.val_at_end=false", "logger.progress_bar=false",
             f"logger.log_dir={tmp_path / 'logs'}", f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}",
             "policy.sequence_packing.enabled=true"],  # packed rows: each rank's attention reads the setting below
            # a setting of the driver's alone (the cluster started without it): the ranks read it
            env={**env, "RAY_ADDRESS": f"127.0.0.1:{port}", "NOVARL_PACKED_ATTENTION": "unheard_of"},
            capture_output=True, text=True, timeout=300)
    finally:
        stop_cluster(temp_dir)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "starting 2 policy ranks on Ray" in run.stderr
    assert "Started a local Ray instance" not in run.stderr  # it joined the running cluster
    assert (tmp_path / "ckpt" / "step_2").is_dir()
    # each rank's packed attention read it (and said it is no kernel): the driver's environment reached them
    assert run.stderr.count("NOVARL_PACKED_ATTENTION='unheard_of' is not a packed attention kernel") == 2


def stop_cluster(temp_dir: str) -> None:
    """Kill the processes of the cluster whose files are in temp_dir (each names it on its command
    line; its workers end with its raylet), then remove the folder."""
    import psutil

    own = []
    for proc in psutil.process_iter(["cmdline"]):
        if any(temp_dir in arg for arg in proc.info["cmdline"] or []):
            own.append(proc)
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
    psutil.wait_procs(own, timeout=30)
    shutil.rmtree(temp_dir, ignore_errors=True)


def test_each_rank_sees_only_the_gpus_ray_assigned_it():
    """Ray sets a rank's CUDA_VISIBLE_DEVICES to its GPU (device 0 is then its own); where
    RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES left every GPU visible (every rank on GPU 0 before, DeepSpeed's and
    vLLM's too), the rank narrows it to its assignment, as the node's list names them (ids with Ray's spaces)."""
    from novarl.distributed.rank_actor import own_visible_devices

    assert own_visible_devices(["3"], None) is None and own_visible_devices(["3"], "0") is None
    assert own_visible_devices([" 5"], "1") == "5" and own_visible_devices([2], "true") == "2"
    assert own_visible_devices(["GPU-1a2b", "GPU-3c4d"], "True") == "GPU-1a2b,GPU-3c4d"
    assert own_visible_devices([], "1") is None
