"""Checkpoints: atomic saves, resume after kill -9 equals the uninterrupted run,
corrupt checkpoints skipped, export to a Hugging Face folder."""

import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from novarl.cli import BUNDLED_RECIPE, main
from novarl.config import load_config
from novarl.errors import UserError
from novarl.trainer.api import GRPOTrainer
from novarl.trainer.checkpoint import check_checkpoint
from tests.helpers import HF, train_steps

pytestmark = pytest.mark.slow

COMMON = ["logger.progress_bar=false", "grpo.max_train_seconds=null", "grpo.val_at_start=false",
          "grpo.val_at_end=false", "checkpointing.enabled=true", "checkpointing.save_period=2",
          "checkpointing.keep_top_k=10", HF]


def overrides(tmp_path, steps, *extra):
    return [f"logger.log_dir={tmp_path / 'logs'}", f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}",
            f"grpo.max_num_steps={steps}", *COMMON, *extra]


@pytest.fixture(scope="module")
def two_step_run(tmp_path_factory):
    """The folder (logs/, ckpt/step_2) of one finished 2-step run, made once: `copy_to` gives a
    test its own copy."""
    folder = tmp_path_factory.mktemp("two_steps")
    GRPOTrainer(load_config(BUNDLED_RECIPE, overrides=overrides(folder, 2))).train()
    return folder


def copy_to(run, tmp_path):
    shutil.copytree(run, tmp_path, dirs_exist_ok=True)


def test_resume_after_kill_matches_the_uninterrupted_run(tmp_path):
    reference = GRPOTrainer(load_config(BUNDLED_RECIPE, overrides=overrides(tmp_path / "ref", 8))).train()
    expected = train_steps(reference.output_dir)

    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "novarl.cli", "train", *overrides(run, 8)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (run / "ckpt" / "step_4").exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (run / "ckpt" / "step_4").exists() and not (run / "ckpt" / "step_8").exists()

    resumed = GRPOTrainer(load_config(BUNDLED_RECIPE, overrides=overrides(run, 8))).train()
    got = train_steps(resumed.output_dir)
    first = min(got)
    assert 5 <= first <= 7 and max(got) == 8  # it went on from the newest complete checkpoint
    for step in range(first, 9):
        assert got[step]["reward_mean"] == expected[step]["reward_mean"]
        assert got[step]["loss"] == pytest.approx(expected[step]["loss"], abs=1e-7)
        assert got[step]["grad_norm"] == pytest.approx(expected[step]["grad_norm"], rel=1e-6)
    # The resumed run's metrics.jsonl (and its curve) carry the killed run's steps before it.
    whole = train_steps(resumed.output_dir, this_run_only=False)
    assert sorted(whole) == list(range(1, 9))
    assert all(whole[step]["reward_mean"] == expected[step]["reward_mean"] for step in range(1, first))


def test_partial_checkpoint_is_skipped_for_the_previous_good_one(tmp_path, capsys):
    GRPOTrainer(load_config(BUNDLED_RECIPE, overrides=overrides(tmp_path, 4))).train()
    ckpt = tmp_path / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_2", "step_4"]
    for shard in (ckpt / "step_4" / "policy").glob("*.distcp"):
        shard.unlink()  # as if the disk lost it
    assert check_checkpoint(ckpt / "step_4") == "policy shards missing"
    trainer = GRPOTrainer(load_config(BUNDLED_RECIPE, overrides=overrides(tmp_path, 5)))
    result = trainer.train()
    assert sorted(train_steps(result.output_dir)) == [3, 4, 5]
    assert sorted(train_steps(result.output_dir, this_run_only=False)) == [1, 2, 3, 4, 5]  # history from step_2
    assert "step_4 is not usable (policy shards missing)" in capsys.readouterr().err


def test_fresh_run_refuses_to_overwrite_checkpoints(tmp_path, capsys, two_step_run):
    copy_to(two_step_run, tmp_path)
    before = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    code = main(["train", "--no-resume", *overrides(tmp_path, 2)])
    assert code == 2
    assert "already holds checkpoints (newest: step_2)" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == before
    with pytest.raises(UserError, match="Nothing to resume"):
        GRPOTrainer(load_config(BUNDLED_RECIPE, overrides=overrides(tmp_path / "other", 2))).train(resume=True)


def test_keep_top_k_and_convert_to_hugging_face(tmp_path):
    trainer = GRPOTrainer(load_config(BUNDLED_RECIPE, overrides=overrides(
        tmp_path, 6, "checkpointing.keep_top_k=1")))
    result = trainer.train()
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["step_6"]  # the newest always stays
    out = tmp_path / "hf"
    assert main(["convert", str(tmp_path / "ckpt" / "step_6"), str(out)]) == 0
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(out).state_dict()
    final = AutoModelForCausalLM.from_pretrained(result.model_dir).state_dict()
    assert exported.keys() == final.keys()
    assert all(torch.equal(exported[k], final[k]) for k in final)


def test_keep_top_k_ranks_by_the_metric_and_keeps_the_newest(tmp_path):
    import json

    from novarl.config.schema import CheckpointingConfig
    from novarl.trainer.checkpoint import Checkpointer

    class FakePolicy:  # writes the files a real DCP save leaves, nothing else
        def save(self, path):
            path.mkdir()
            for name in (".metadata", "__0_0.distcp", "scheduler.pt"):
                (path / name).write_bytes(b"x")

    cfg = CheckpointingConfig(checkpoint_dir=str(tmp_path), keep_top_k=2, metric_name="val_reward")
    checkpointer = Checkpointer(cfg, "config: {}\n")
    # step 3 carries a stale metric (measured at step 2): it ranks with the unmeasured ones.
    for step, reward, measured_at in ((1, 0.5, 1), (2, 0.9, 2), (3, 0.95, 2), (4, 0.7, 4), (5, 0.2, 5)):
        checkpointer.save(step, FakePolicy(), {"summary": {"val_reward": reward, "val_step": measured_at}})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2", "step_4", "step_5"]
    assert checkpointer.latest().step == 5
    state = json.loads((tmp_path / "step_2" / "trainer_state.json").read_text())
    assert state["step"] == 2 and state["summary"]["val_reward"] == 0.9


def test_resume_refuses_another_run_or_a_finished_one(tmp_path, two_step_run):
    copy_to(two_step_run, tmp_path)
    other_model = overrides(tmp_path, 4, f"policy.model_name={tmp_path / 'logs' / 'exp_001' / 'policy'}")
    with pytest.raises(UserError, match=r"holds a checkpoint of another run \(policy.model_name: 'tiny-arith' there"):
        GRPOTrainer(load_config(BUNDLED_RECIPE, overrides=other_model)).train()
    other_config = overrides(tmp_path, 4, "policy.hf_config_overrides={max_position_embeddings: 128}")
    with pytest.raises(UserError, match=r"another run \(policy.hf_config_overrides: \{\} there, "
                                        r"\{'max_position_embeddings': 128\} here\)"):
        GRPOTrainer(load_config(BUNDLED_RECIPE, overrides=other_config)).train()
    with pytest.raises(UserError, match="already at step 2, and grpo.max_num_steps=2: nothing left to train"):
        GRPOTrainer(load_config(BUNDLED_RECIPE, overrides=overrides(tmp_path, 2))).train()


def test_convert_reads_the_weights_only_and_writes_the_runs_precision_and_format(tmp_path, two_step_run):
    """A checkpoint converts in the run's precision (bf16: half the bytes) and file format, sharded
    past the shard size; the optimizer's state is not read."""
    import json

    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from novarl.backends.training.dtensor import DTensorPolicy
    from novarl.distributed.local import ensure_single_process_group
    from novarl.models.loading import ExportFormat, load_tokenizer, resolve_model_path, save_hf_folder
    from novarl.trainer.checkpoint import POLICY_DIR

    copy_to(two_step_run, tmp_path)
    step = tmp_path / "ckpt" / "step_2"
    cfg = load_config(step / "config.yaml")
    ensure_single_process_group()
    policy = DTensorPolicy(cfg.policy, resolve_model_path("tiny-arith"), torch.device("cpu"), total_steps=1)
    policy.load_weights(step / POLICY_DIR)
    assert policy.optimizer.state_dict()["state"] == {}  # nothing of the optimizer was read
    fp32 = tmp_path / "fp32"
    assert main(["convert", str(step), str(fp32)]) == 0
    weights = AutoModelForCausalLM.from_pretrained(fp32).state_dict()
    assert all(torch.equal(weights[k], v) for k, v in policy.full_state_dict().items())

    tokenizer = load_tokenizer(resolve_model_path("tiny-arith"))
    bf16 = tmp_path / "bf16"
    save_hf_folder(bf16, policy.model.config, policy.full_state_dict(), tokenizer,
                   ExportFormat(dtype="bfloat16", max_shard_size="200KB"))
    index = json.loads((bf16 / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2 and json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(bf16 / shards[0]), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    loaded = AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.bfloat16).state_dict()
    assert all(torch.equal(loaded[k], weights[k].to(torch.bfloat16)) for k in weights)
    pickled = tmp_path / "torch_save"
    save_hf_folder(pickled, policy.model.config, policy.full_state_dict(), tokenizer, ExportFormat(safetensors=False))
    assert (pickled / "pytorch_model.bin").is_file() and not list(pickled.glob("*.safetensors"))
    reloaded = AutoModelForCausalLM.from_pretrained(pickled).state_dict()
    assert all(torch.equal(reloaded[k], weights[k]) for k in weights)


def test_the_export_format_follows_precision_and_model_save_format():
    from novarl.models.loading import ExportFormat, export_format

    assert export_format(None, "safetensors", on_gpu=True) == ExportFormat(dtype="bfloat16")
    assert export_format(None, None, on_gpu=False) == ExportFormat(dtype="float32")
    assert export_format("float16", "torch_save", on_gpu=True) == ExportFormat(dtype="float16", safetensors=False)
