"""Checkpoint integrity: a damaged newest checkpoint (whatever the damage) is reported in one
line and the run goes on from the previous good one; nothing in a checkpoint is unpickled
unchecked; a full disk is one clear error that leaves the older checkpoints as they were; a
run killed after its last checkpoint is finished by the same command; what killed runs left
behind is swept.

Every case starts from a copy of one finished 3-step run (checkpoints step_2 and step_3) with
32-sample steps, so that each costs one short resume."""

import hashlib
import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from novarl.cli import BUNDLED_RECIPE, main
from novarl.config import load_config
from novarl.config.schema import CheckpointingConfig
from novarl.errors import UserError
from novarl.logging.metrics import read_jsonl
from novarl.trainer.api import GRPOTrainer, sweep_run_folders
from novarl.trainer.checkpoint import (FINISHED_FILE, MANIFEST_FILE, STATE_FILE, Checkpointer, check_checkpoint,
                                       megabytes, tree_size)
from tests.helpers import train_steps
from tests.test_checkpoint import overrides

pytestmark = pytest.mark.slow

SMALL = ["grpo.num_prompts_per_step=8", "grpo.num_generations_per_prompt=4", "policy.train_micro_batch_size=32",
         "policy.logprob_batch_size=32"]
"""32 samples a step: the subject here is the checkpoint, not the training."""
SHARD = "policy/__0_0.distcp"


def config(folder, *extra):
    return load_config(BUNDLED_RECIPE, overrides=overrides(folder, 3, *SMALL, *extra))


@pytest.fixture(scope="module")
def good_run(tmp_path_factory):
    """(checkpoint_dir holding step_2 and step_3, {step: train metrics}) of a finished 3-step run."""
    folder = tmp_path_factory.mktemp("good")
    result = GRPOTrainer(config(folder)).train()
    assert sorted(p.name for p in (folder / "ckpt").iterdir()) == ["step_2", "step_3"]
    return folder / "ckpt", train_steps(result.output_dir)


def copy_run(good_run, tmp_path, *steps: str) -> Path:
    """tmp_path/ckpt holding a copy of the good run's checkpoints (those named, else all), as a
    run killed before its ending leaves them (else the same command would refuse: it ended)."""
    ckpt = tmp_path / "ckpt"
    for step in steps or ("step_2", "step_3"):
        shutil.copytree(good_run[0] / step, ckpt / step)
        (ckpt / step / FINISHED_FILE).unlink(missing_ok=True)
    return ckpt


def rewrite_manifest(step: Path, name: str) -> None:
    """Make the manifest agree with the file `name` as it now is (as someone who rewrote both would)."""
    manifest = json.loads((step / MANIFEST_FILE).read_text())
    data = (step / name).read_bytes()
    manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (step / MANIFEST_FILE).write_text(json.dumps(manifest))


def same_size_garbage(path: Path) -> None:
    path.write_bytes(os.urandom(path.stat().st_size))


def flip_bits(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 4096] = bytes(b ^ 0xFF for b in data[middle:middle + 4096])
    path.write_bytes(bytes(data))


def drop_sampler(path: Path) -> None:
    state = json.loads(path.read_text())
    del state["sampler"]
    path.write_text(json.dumps(state))


CORRUPTIONS = {
    "truncated shard": (SHARD, lambda p: os.truncate(p, p.stat().st_size // 2), "__0_0.distcp is "),
    "empty shard": (SHARD, lambda p: p.write_bytes(b""), "__0_0.distcp is 0 bytes"),
    "garbage metadata": ("policy/.metadata", same_size_garbage, ".metadata does not match its checksum"),
    "garbage scheduler": ("policy/scheduler.pt", same_size_garbage, "scheduler.pt does not match its checksum"),
    "state without sampler": (STATE_FILE, drop_sampler, f"{STATE_FILE} is "),
    "config deleted": ("config.yaml", Path.unlink, "config.yaml missing"),
    "flipped bits in a shard": (SHARD, flip_bits, "__0_0.distcp does not match its checksum"),
}


def assert_went_on_from_step_2(good_run, tmp_path, err: str, reason: str) -> None:
    """One line said why step_3 was skipped; the run resumed from step_2 and trained step 3 as the
    good run did; the new step_3 is sound."""
    skipped = [line for line in err.splitlines()
               if "step_3" in line and ("not usable" in line or "could not be loaded" in line)]
    assert len(skipped) == 1 and reason in skipped[0], err
    assert f"resumed from {tmp_path / 'ckpt' / 'step_2'} (step 2)" in err
    got = train_steps(sorted((tmp_path / "logs").glob("exp_*"))[-1])
    assert sorted(got) == [3]
    assert got[3]["reward_mean"] == good_run[1][3]["reward_mean"]
    assert got[3]["loss"] == pytest.approx(good_run[1][3]["loss"], abs=1e-7)
    assert check_checkpoint(tmp_path / "ckpt" / "step_3", verify_checksums=True) is None


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_a_corrupt_newest_checkpoint_is_skipped_for_the_previous_one(good_run, tmp_path, capsys, case):
    name, corrupt, reason = CORRUPTIONS[case]
    ckpt = copy_run(good_run, tmp_path)
    corrupt(ckpt / "step_3" / name)
    GRPOTrainer(config(tmp_path)).train()
    assert_went_on_from_step_2(good_run, tmp_path, capsys.readouterr().err, reason)


def test_a_checkpoint_that_fails_to_load_falls_back_to_the_previous_one(good_run, tmp_path, capsys):
    """The shard and the manifest damaged alike: the checks pass, torch.distributed.checkpoint fails."""
    ckpt = copy_run(good_run, tmp_path)
    os.truncate(ckpt / "step_3" / SHARD, 1000)
    rewrite_manifest(ckpt / "step_3", SHARD)
    assert check_checkpoint(ckpt / "step_3", verify_checksums=True) is None
    GRPOTrainer(config(tmp_path)).train()
    assert_went_on_from_step_2(good_run, tmp_path, capsys.readouterr().err, "could not be loaded (")


def test_checkpoints_without_a_manifest_load_unverified(good_run, tmp_path, capsys):
    """As written by an older novarl; step_3's state lacks the data position, found by what resuming reads."""
    ckpt = copy_run(good_run, tmp_path)
    for step in ("step_2", "step_3"):
        (ckpt / step / MANIFEST_FILE).unlink()
    drop_sampler(ckpt / "step_3" / STATE_FILE)
    GRPOTrainer(config(tmp_path)).train()
    err = capsys.readouterr().err
    assert_went_on_from_step_2(good_run, tmp_path, err, f"{STATE_FILE} has no data position")
    assert err.count("has no manifest.json (written by an older novarl)") == 1


class WritesMarker:
    """Unpickled, it would write `marker`: what a hostile checkpoint could do instead."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return Path.write_text, (self.marker, "code ran")


def test_a_scheduler_pickle_that_would_run_code_is_never_unpickled(good_run, tmp_path, capsys):
    import torch

    ckpt = copy_run(good_run, tmp_path)
    marker = tmp_path / "code_ran"
    torch.save({"last_epoch": WritesMarker(marker)}, ckpt / "step_3" / "policy" / "scheduler.pt")
    assert "scheduler.pt is " in check_checkpoint(ckpt / "step_3")  # swapped in: the manifest refuses it
    rewrite_manifest(ckpt / "step_3", "policy/scheduler.pt")  # ... and with it: torch's weights_only does
    GRPOTrainer(config(tmp_path)).train()
    assert_went_on_from_step_2(good_run, tmp_path, capsys.readouterr().err, "UnpicklingError")
    assert not marker.exists()


def test_a_dcp_metadata_pickle_that_would_run_code_is_never_unpickled(good_run, tmp_path, capsys):
    ckpt = copy_run(good_run, tmp_path)
    marker = tmp_path / "code_ran"
    (ckpt / "step_3" / "policy" / ".metadata").write_bytes(pickle.dumps(WritesMarker(marker)))
    rewrite_manifest(ckpt / "step_3", "policy/.metadata")
    GRPOTrainer(config(tmp_path)).train()
    assert_went_on_from_step_2(good_run, tmp_path, capsys.readouterr().err,
                               ".metadata refers to pathlib.Path.write_text, which DCP metadata never holds")
    assert not marker.exists()


@pytest.fixture
def small_disk(tmp_path):
    """mount(size) -> a tmpfs folder of `size` bytes (root only), unmounted after the test."""
    folder = tmp_path / "disk"
    folder.mkdir()
    mounted = []

    def mount(size: int) -> Path:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(folder)
        return folder

    yield mount
    for path in mounted:
        subprocess.run(["umount", str(path)], check=True)


def test_a_full_disk_during_a_save_is_one_error_and_keeps_the_older_checkpoints(good_run, tmp_path, capsys,
                                                                                  small_disk):
    step_2 = good_run[0] / "step_2"
    disk = small_disk(int(tree_size(step_2) * 1.6) // 4096 * 4096)  # step_2 fits, step_3 does not
    shutil.copytree(step_2, disk / "step_2")
    code = main(["train", *overrides(tmp_path, 3, *SMALL), f"checkpointing.checkpoint_dir={disk}"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert f"novarl: error: Saving checkpoint step_3 to '{disk}' failed: the disk is full (" in err
    assert (f"a checkpoint takes about {megabytes(tree_size(disk / 'step_2'))} (step_2)). The checkpoints before it "
            "are intact (newest: step_2)") in err
    assert [p.name for p in disk.iterdir()] == ["step_2"]  # no temporary folder holds the space
    assert main(["convert", str(disk / "step_2"), str(tmp_path / "hf")]) == 0  # step_2 still loads
    assert (tmp_path / "hf" / "model.safetensors").is_file()


SLOW_EXPORT = """
import sys, time
import safetensors.torch

save_file = safetensors.torch.save_file

def slow_save_file(*args, **kwargs):  # the run's final export waits here for the test to kill it
    time.sleep(600)
    return save_file(*args, **kwargs)

safetensors.torch.save_file = slow_save_file
from novarl.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_run_killed_during_its_final_export_is_finished_by_the_same_command(good_run, tmp_path, capsys):
    copy_run(good_run, tmp_path, "step_2")
    args = overrides(tmp_path, 3, *SMALL, "grpo.val_at_end=true", "grpo.max_val_samples=64")
    with (tmp_path / "killed.log").open("w") as log:
        proc = subprocess.Popen([sys.executable, "-c", SLOW_EXPORT, "train", *args], stdout=log, stderr=log)
        killed_run = tmp_path / "logs" / "exp_001"
        deadline = time.monotonic() + 300
        while not list(killed_run.glob(".policy.tmp-*")) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert list(killed_run.glob(".policy.tmp-*")), (tmp_path / "killed.log").read_text()
    assert (tmp_path / "ckpt" / "step_3" / STATE_FILE).is_file() and not (killed_run / "policy").exists()
    assert not (tmp_path / "ckpt" / "step_3" / FINISHED_FILE).exists()

    result = GRPOTrainer(load_config(BUNDLED_RECIPE, overrides=args)).train()
    err = capsys.readouterr().err
    assert "is the run's last step, but the run did not end" in err
    assert f"removed 1 temporary folder(s) left by killed runs in {killed_run}" in err
    assert not list(killed_run.glob(".policy.tmp-*"))
    assert (result.model_dir / "model.safetensors").is_file() and (result.output_dir / "reward_curve.png").is_file()
    assert result.steps == 3 and train_steps(result.output_dir) == {}  # nothing trained again
    evals = [r for r in read_jsonl(result.output_dir / "metrics.jsonl") if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [3] and result.final_accuracy == evals[0]["accuracy"]
    finished = json.loads((tmp_path / "ckpt" / "step_3" / FINISHED_FILE).read_text())
    assert finished["model_dir"] == str(result.model_dir)
    # Now the run has ended: the same command says so and where its policy is, rather than redo it.
    with pytest.raises(UserError, match=r"nothing left to train \(the run that reached it ended: its policy is in "):
        GRPOTrainer(load_config(BUNDLED_RECIPE, overrides=args)).train()


def test_a_last_checkpoint_without_its_final_evaluation_is_finished_by_the_same_command(good_run, tmp_path,
                                                                                       capsys):
    """As a run killed during its final evaluation leaves it: step_3 is the last step, not evaluated."""
    copy_run(good_run, tmp_path)
    result = GRPOTrainer(config(tmp_path, "grpo.val_at_end=true", "grpo.max_val_samples=64")).train()
    assert "is the run's last step, but the run did not end" in capsys.readouterr().err
    assert train_steps(result.output_dir) == {} and (result.model_dir / "model.safetensors").is_file()
    evals = [r for r in read_jsonl(result.output_dir / "metrics.jsonl") if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [3] and result.final_accuracy == evals[0]["accuracy"]
    assert (tmp_path / "ckpt" / "step_3" / FINISHED_FILE).is_file()


def test_stale_temporary_folders_are_swept_but_not_a_live_runs(tmp_path, capsys):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    host = socket.gethostname()
    ckpt, run = tmp_path / "ckpt", tmp_path / "logs" / "exp_001"
    try:
        stale = [ckpt / f".tmp_step_4-{host}-{dead.pid}", ckpt / ".trash_step_2", ckpt / ".tmp_step_5",
                 run / f".policy.tmp-{host}-{dead.pid}", run / f".policy.tmp-{dead.pid}", run / ".trash_policy"]
        kept = [ckpt / f".tmp_step_6-{host}-{live.pid}", ckpt / f".tmp_step_8-another-host-{dead.pid}",
                ckpt / "step_2", run / f".policy.tmp-{host}-{live.pid}", run / "policy"]
        for folder in stale + kept:
            folder.mkdir(parents=True)
            (folder / "data").write_bytes(b"x")
        Checkpointer(CheckpointingConfig(checkpoint_dir=str(ckpt)), "").sweep()
        sweep_run_folders(tmp_path / "logs")
        assert [p for p in stale if p.exists()] == [] and all(p.exists() for p in kept)
        assert capsys.readouterr().err.count("removed 3 temporary folder(s) left by killed runs in") == 2
    finally:
        live.kill()
        live.wait()
