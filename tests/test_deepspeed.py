"""The DeepSpeed ZeRO backend on 2 CPU ranks (Ray actors, gloo): stages 0, 2 and 3 train like the
DTensor backend, stage 1 trains in bf16, offload runs, checkpoints resume after a kill and convert."""

import os
import signal
import subprocess
import sys
import time

import pytest

from novarl.cli import BUNDLED_RECIPE, main
from novarl.config import load_config
from novarl.errors import UserError
from novarl.trainer.api import GRPOTrainer
from tests.helpers import HF, rank_pids, train_steps

pytest.importorskip("deepspeed")
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]  # tests/conftest.py
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

COMMON = ["logger.progress_bar=false", "grpo.max_train_seconds=null", "grpo.val_at_start=false",
          "grpo.val_at_end=false", "policy.train_micro_batch_size=128", "cluster.gpus_per_node=2", HF]
ZERO = "policy.deepspeed_cfg.enabled=true"


def run(tmp_path, steps, *overrides):
    _, result, got = run_trainer(tmp_path, steps, *overrides)
    return result, got


def run_trainer(tmp_path, steps, *overrides):
    """(the trainer after its run, the TrainResult, {step: train metrics})."""
    cfg = load_config(BUNDLED_RECIPE, overrides=[f"logger.log_dir={tmp_path / 'logs'}", f"grpo.max_num_steps={steps}",
                                                 *COMMON, *overrides])
    trainer = GRPOTrainer(cfg)
    result = trainer.train()
    return trainer, result, train_steps(result.output_dir)


@pytest.fixture(scope="module")
def dtensor_run(tmp_path_factory):
    """FSDP2 on the same 2 ranks: what every ZeRO stage must match."""
    return run(tmp_path_factory.mktemp("dtensor"), 4)


@pytest.fixture(scope="module")
def dtensor_steps(dtensor_run):
    return dtensor_run[1]


CHECKPOINTED_ZERO3 = ["checkpointing.enabled=true", "checkpointing.save_period=1", "checkpointing.keep_top_k=10",
                      "policy.deepspeed_cfg.zero_stage=3", ZERO]


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory):
    """(trainer, TrainResult, {step: train metrics}, checkpoint_dir) of 4 ZeRO-3 steps checkpointed at every
    step: stage 3's run against FSDP2, and the uninterrupted run the resume test is held against."""
    folder = tmp_path_factory.mktemp("zero3")
    return (*run_trainer(folder, 4, *CHECKPOINTED_ZERO3, f"checkpointing.checkpoint_dir={folder / 'ckpt'}"),
            folder / "ckpt")


def assert_same_training(got, expected, *, loss_abs=1e-6, grad_rel=1e-4):
    assert sorted(got) == sorted(expected)
    for step in expected:
        # same samples (same generator weights each step), so the same loss and gradients,
        # up to the order of floating-point sums
        assert got[step]["reward_mean"] == expected[step]["reward_mean"]
        assert got[step]["loss"] == pytest.approx(expected[step]["loss"], abs=loss_abs)
        assert got[step]["grad_norm"] == pytest.approx(expected[step]["grad_norm"], rel=grad_rel)
        assert got[step]["logprob_mismatch"] < 1e-3  # the synced weights are the trained ones


def hf_weights(folder) -> dict:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder).state_dict()


@pytest.mark.parametrize("stage", [0, 2, 3])  # 0: plain data parallel (its grad_norm measured by novarl); 1 below
def test_zero_stage_trains_like_dtensor_and_exports_the_trained_weights(tmp_path, request, dtensor_run, stage):
    import torch

    from novarl.models.loading import resolve_model_path

    if stage == 3:  # the module's checkpointed run (checkpoints change nothing of the training)
        _, result, got, _ = request.getfixturevalue("zero3_run")
    else:
        _, result, got = run_trainer(tmp_path, 4, ZERO, f"policy.deepspeed_cfg.zero_stage={stage}")
    assert_same_training(got, dtensor_run[1])
    # The exported folder holds the final weights, gathered from the partitions; each step's
    # sync gathered them the same way into each rank's own engine (logprob_mismatch above) ...
    exported = hf_weights(result.model_dir)
    model_mb = sum(t.numel() * t.element_size() for t in exported.values()) / 1e6
    assert all(record["weight_sync_mb"] == pytest.approx(model_mb) for record in got.values())
    # ... which are trained (not the bundled start) and agree with FSDP2's after the same 4 steps.
    start, fsdp2 = hf_weights(resolve_model_path("tiny-arith")), hf_weights(dtensor_run[0].model_dir)
    assert all(not torch.equal(exported[name], start[name]) for name in start if "norm" not in name)
    assert exported.keys() == fsdp2.keys()
    for name in fsdp2:  # measured: at most 2e-7 apart, the order of floating-point sums
        torch.testing.assert_close(exported[name], fsdp2[name], rtol=0, atol=1e-5, msg=name)


def test_zero3_with_optimizer_and_parameter_offload(tmp_path, dtensor_steps):
    _, got = run(tmp_path, 4, ZERO, "policy.deepspeed_cfg.zero_stage=3", "policy.deepspeed_cfg.offload_optimizer=true",
                 "policy.deepspeed_cfg.offload_param=true", "policy.deepspeed_cfg.activation_checkpointing=true")
    # DeepSpeed's CPU Adam steps the offloaded state: the same update as torch's AdamW up to rounding;
    # recomputed activations are the same activations
    assert_same_training(got, dtensor_steps, loss_abs=1e-5, grad_rel=1e-3)


def test_bf16_and_config_pass_through(tmp_path):
    """Stage 1 (its optimizer state partitioned, as stage 2's is, whose run above matches FSDP2) in bf16."""
    _, got = run(tmp_path, 2, ZERO, "policy.precision=bfloat16", "policy.deepspeed_cfg.zero_stage=1",
                 "policy.deepspeed_cfg.config={zero_optimization: {reduce_bucket_size: 100000}}")
    assert all(abs(r["loss"]) < 1 and r["grad_norm"] > 0 for r in got.values())
    assert max(r["logprob_mismatch"] for r in got.values()) < 0.05  # bf16 trainer vs fp32 generator


def test_offload_param_needs_stage_3(tmp_path):
    with pytest.raises(UserError, match="offload_param needs zero_stage 3"):
        run(tmp_path, 1, ZERO, "policy.deepspeed_cfg.zero_stage=2", "policy.deepspeed_cfg.offload_param=true")


def test_resume_after_a_killed_rank_matches_and_converts(tmp_path, zero3_run):
    _, reference, expected, ref_ckpt = zero3_run  # the uninterrupted run
    ckpt = CHECKPOINTED_ZERO3

    where = [f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}", f"logger.log_dir={tmp_path / 'logs'}"]
    cmd = [sys.executable, "-m", "novarl.cli", "train", "grpo.max_num_steps=4", *COMMON, *ckpt, *where]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while not (tmp_path / "ckpt" / "step_2").exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    ranks = rank_pids(proc.pid)
    assert ranks, "no rank processes found"
    os.kill(ranks[-1], signal.SIGKILL)
    _, err = proc.communicate(timeout=120)  # it stops, naming the rank and the checkpoint to resume from
    assert proc.returncode == 1 and "Traceback" not in err and "policy rank" in err and "died" in err
    assert f"newest good checkpoint is {tmp_path / 'ckpt'}/step_" in err
    assert (tmp_path / "ckpt" / "step_2").exists() and not (tmp_path / "ckpt" / "step_4").exists()

    _, got = run(tmp_path, 4, *ckpt, f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}")
    first = min(got)
    assert 3 <= first <= 4 and max(got) == 4  # it went on from the newest complete checkpoint
    assert_same_training(got, {s: expected[s] for s in range(first, 5)}, loss_abs=1e-7, grad_rel=1e-6)

    # The partitioned checkpoint of the finished reference run, converted offline, is its final policy.
    import torch
    from transformers import AutoModelForCausalLM

    assert main(["convert", str(ref_ckpt / "step_4"), str(tmp_path / "hf")]) == 0
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    final = AutoModelForCausalLM.from_pretrained(reference.model_dir).state_dict()
    assert converted.keys() == final.keys()
    assert all(torch.equal(converted[k], final[k]) for k in final)

    # Resuming it on another number of ranks is refused (before any rank starts).
    with pytest.raises(UserError, match="written by 2 ranks; ZeRO's partitions load only on as many ranks"):
        run(tmp_path / "one_rank", 5, *ckpt, f"checkpointing.checkpoint_dir={ref_ckpt}", "cluster.gpus_per_node=1")


def deepspeed_after_the_world_is_made_again() -> None:
    """Three DeepSpeed policies in one process, the torch.distributed world destroyed (not through DeepSpeed)
    and made again before each of the last two: the second lets go of DeepSpeed's groups through DeepSpeed's own
    function hidden (the path of a DeepSpeed before 0.19.8), the third through it."""
    import tempfile

    import torch
    import torch.distributed as dist
    from deepspeed.utils import groups

    from novarl.backends.training.deepspeed import DeepSpeedPolicy
    from novarl.models.loading import resolve_model_path
    from tests.helpers.packing import HEAD, mixed_batch

    cfg = load_config(None, overrides=[ZERO, "policy.deepspeed_cfg.zero_stage=2"])
    batch, path = mixed_batch(rows=3), resolve_model_path("tiny-arith")
    first = DeepSpeedPolicy(cfg.policy, path, None, total_steps=2).forward(batch, HEAD)
    release = groups._release_process_group_references
    for hidden in (True, False):
        dist.destroy_process_group()  # as vLLM's in-process engine ends it, or a user's code
        dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/store", rank=0, world_size=1)
        if hidden:
            del groups._release_process_group_references
        try:
            again = DeepSpeedPolicy(cfg.policy, path, None, total_steps=2).forward(batch, HEAD)
        finally:
            groups._release_process_group_references = release
        assert torch.equal(again, first)


def test_deepspeed_starts_again_after_its_world_is_made_again():
    """DeepSpeed keeps groups of the world it joined for the process's life: without novarl letting go of them,
    an engine after the world was made again failed with 'Group ... is not registered' (in a pytest worker after
    other tests; vLLM's in-process engine ends the world when it shuts down), which novarl reported as 'DeepSpeed
    refused its config'."""
    from tests.helpers.spawn import in_a_fresh_process

    in_a_fresh_process(deepspeed_after_the_world_is_made_again)
