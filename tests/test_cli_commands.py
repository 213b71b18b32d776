"""What the commands do with good input: where evaluation prompts come from (held out or
not, and the log says which), `novarl eval` of a run's policy with that run's config,
`novarl convert` of a checkpoint root. Refusals of bad input are in test_cli_errors.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from novarl.cli import BUNDLED_RECIPE, main
from novarl.config import dump_config, load_config
from novarl.data.arithmetic import Example
from novarl.errors import UserError
from novarl.models.bundled import resolve_bundled
from novarl.trainer.setup import prepare_inputs, preflight
from tests.helpers import HF


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def data_file(path: Path, count: int) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) + "\n"
                            for a in range(10, 10 + count)))
    return path


def file_config(tmp_path: Path, *extra: str):
    return load_config(BUNDLED_RECIPE, overrides=[
        f"data.train_data_path={data_file(tmp_path / 'train.jsonl', 12)}", "grpo.num_prompts_per_step=4",
        "policy.train_micro_batch_size=32", HF, *extra])


# ============================================================ held-out or training prompts
def test_bundled_task_evaluates_on_its_held_out_split(capsys):
    inputs = prepare_inputs(load_config(BUNDLED_RECIPE, overrides=[HF, "grpo.max_val_samples=64"]))
    assert inputs.val_source == "held-out" and len(inputs.val_prompts) == 64
    train_texts = {p.text for p in inputs.sampler.prompts}
    assert not train_texts & {p.text for p in inputs.val_prompts}
    err = capsys.readouterr().err
    assert "[novarl] model: tiny-arith" in err and "7100 train / 64 held-out prompts" in err
    assert "warning" not in err


def test_file_without_val_data_path_evaluates_on_training_prompts_with_a_warning(tmp_path, capsys):
    inputs = prepare_inputs(file_config(tmp_path, "grpo.max_val_samples=5"))
    assert inputs.val_source == "training-set"
    assert inputs.val_prompts == inputs.sampler.prompts[:5]
    err = capsys.readouterr().err
    assert ("12 train prompts, 5 evaluation prompts taken from the training set (data.val_data_path is not set)"
            in err)
    assert "held-out prompts" not in err
    warnings = [line for line in err.splitlines() if line.startswith("[novarl] warning:")]
    assert warnings == ["[novarl] warning: the evaluation accuracy is measured on training prompts, not held-out "
                        "ones (data.val_data_path is not set); set data.val_data_path to a held-out file"]


def test_file_with_val_data_path_is_held_out(tmp_path):
    val = data_file(tmp_path / "val.jsonl", 3)
    inputs = preflight(file_config(tmp_path, f"data.val_data_path={val}"))
    assert inputs.val_source == "held-out" and [p.answer for p in inputs.val_prompts] == ["20", "22", "24"]
    assert "12 train / 3 held-out prompts" in inputs.summary and inputs.warnings == ()


def test_split_validation_size_holds_out_part_of_the_file(tmp_path):
    inputs = preflight(file_config(tmp_path, "data.split_validation_size=0.25", "grpo.seed=3"))
    assert inputs.val_source == "held-out" and len(inputs.val_prompts) == 3
    train, val = {p.answer for p in inputs.sampler.prompts}, {p.answer for p in inputs.val_prompts}
    assert len(train) == 9 and not train & val  # the 12 rows, split: nothing held out is trained on
    again = preflight(file_config(tmp_path, "data.split_validation_size=0.25", "grpo.seed=3"))
    assert [p.answer for p in again.val_prompts] == [p.answer for p in inputs.val_prompts]  # the same on every run
    assert inputs.warnings == () and "9 train / 3 held-out prompts" in inputs.summary


def test_split_validation_size_beside_a_held_out_file_evaluates_on_both(tmp_path):
    """NeMo RL merges a training source's held-out fraction with the validation sources (its DAPO
    recipe holds 5 % of DAPOMath17K out beside AIME 2024): the fraction first, then the file."""
    val = data_file(tmp_path / "val.jsonl", 3)
    inputs = preflight(file_config(tmp_path, "data.split_validation_size=0.25", "grpo.seed=3",
                                   f"data.val_data_path={val}"))
    alone = preflight(file_config(tmp_path, "data.split_validation_size=0.25", "grpo.seed=3"))
    assert [p.answer for p in inputs.val_prompts] == [p.answer for p in alone.val_prompts] + ["20", "22", "24"]
    assert len(inputs.sampler.prompts) == 9 and "9 train / 6 held-out prompts" in inputs.summary
    with pytest.raises(UserError, match="the bundled task 'arithmetic' has a held-out split of its own"):
        preflight(load_config(BUNDLED_RECIPE, overrides=[HF, "data.split_validation_size=0.1"]))


def test_max_num_epochs_ends_the_run(tmp_path, capsys):
    data = data_file(tmp_path / "train.jsonl", 12)
    code, out, err = run_cli(capsys, "train", f"logger.log_dir={tmp_path / 'logs'}", "logger.progress_bar=false",
                             f"data.train_data_path={data}", "grpo.num_prompts_per_step=4", "grpo.max_num_steps=50",
                             "grpo.max_num_epochs=1", "grpo.val_at_start=false", "grpo.max_val_samples=4",
                             "policy.generation.max_new_tokens=4", "policy.train_micro_batch_size=32", HF)
    assert code == 0, err
    assert "the run takes 3 steps, not grpo.max_num_steps=50: grpo.max_num_epochs=1 pass(es) over 12" in err
    assert "(3 steps)" in out


def test_in_memory_examples_evaluate_on_training_prompts():
    examples = [Example(prompt=f"{a}+1=", answer=str(a + 1)) for a in range(10, 18)]
    cfg = load_config(BUNDLED_RECIPE, overrides=[HF, "grpo.num_prompts_per_step=8", "policy.train_micro_batch_size=32"])
    inputs = preflight(cfg, train_examples=examples)
    assert inputs.val_source == "training-set" and len(inputs.val_prompts) == 8
    assert "(train_examples were given in memory, with no held-out split)" in inputs.summary
    assert any("measured on training prompts" in w for w in inputs.warnings)


def test_validate_says_when_evaluation_is_not_held_out(tmp_path, capsys):
    data = data_file(tmp_path / "train.jsonl", 12)
    code, out, err = run_cli(capsys, "validate", f"data.train_data_path={data}", "grpo.num_prompts_per_step=4",
                             "policy.train_micro_batch_size=32", HF)
    assert code == 0, err
    assert "# warning: the evaluation accuracy is measured on training prompts" in out
    assert "# model: tiny-arith" in out and "evaluation prompts taken from the training set" in out


# ============================================================ eval of a run folder
@pytest.fixture
def run_folder(tmp_path) -> Path:
    """A run folder as `novarl train` leaves it: config.yaml and the final policy/."""
    run = tmp_path / "exp_001"
    shutil.copytree(resolve_bundled("tiny-arith"), run / "policy")
    cfg = load_config(BUNDLED_RECIPE, overrides=["grpo.max_val_samples=20", HF])
    (run / "config.yaml").write_text(dump_config(cfg))
    return run


def test_eval_of_a_run_policy_uses_the_runs_config(run_folder, capsys):
    code, out, err = run_cli(capsys, "eval", str(run_folder / "policy"))
    assert code == 0, err
    assert f"using the run's own config {run_folder / 'config.yaml'}" in err
    assert out.startswith(f"held-out greedy accuracy of {run_folder / 'policy'}: ") and out.endswith(" on 20 prompts\n")
    code, out, err = run_cli(capsys, "eval", str(run_folder / "policy"), "grpo.max_val_samples=5")
    assert code == 0, err
    assert out.endswith(" on 5 prompts\n")  # overrides apply on top of the run's config


def test_eval_of_a_checkpoint_says_to_convert_it(tmp_path, capsys):
    step = tmp_path / "ckpt" / "step_3"
    (step / "policy").mkdir(parents=True)
    (step / "trainer_state.json").write_text('{"step": 3}')
    for given in (step, step / "policy"):
        code, out, err = run_cli(capsys, "eval", str(given))
        assert code == 2 and out == "" and "Traceback" not in err
        assert err.strip() == (f"novarl: error: '{given}' is a training checkpoint, not a Hugging Face model "
                               f"folder. Convert it first: `novarl convert {step} OUT`, then `novarl eval OUT`.")


# ============================================================ convert a checkpoint root
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    """(checkpoint root holding step_1 and step_2, the final policy folder) of a 2-step run."""
    from novarl.trainer.api import GRPOTrainer

    tmp = tmp_path_factory.mktemp("run")
    cfg = load_config(BUNDLED_RECIPE, overrides=[
        f"logger.log_dir={tmp / 'logs'}", f"checkpointing.checkpoint_dir={tmp / 'ckpt'}", "checkpointing.enabled=true",
        "checkpointing.save_period=1", "checkpointing.keep_top_k=null", "grpo.max_num_steps=2",
        "grpo.max_train_seconds=null", "grpo.num_prompts_per_step=8", "grpo.num_generations_per_prompt=4",
        "policy.train_micro_batch_size=32", "grpo.val_at_start=false", "grpo.val_at_end=false",
        "grpo.val_period=0", "logger.progress_bar=false", HF])
    result = GRPOTrainer(cfg).train()
    assert sorted(p.name for p in (tmp / "ckpt").iterdir()) == ["step_1", "step_2"]
    return tmp / "ckpt", result.model_dir


def weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_convert_a_checkpoint_root_takes_the_newest_step(checkpoints, tmp_path, capsys):
    import torch

    root, final_policy = checkpoints
    code, out, err = run_cli(capsys, "convert", str(root), str(tmp_path / "hf"))
    assert code == 0, err
    assert out.splitlines() == [f"converting {root / 'step_2'}: the newest complete checkpoint in {root}",
                                f"wrote {tmp_path / 'hf'}"]
    exported, final = weights(tmp_path / "hf"), weights(final_policy)
    assert exported.keys() == final.keys() and all(torch.equal(exported[k], final[k]) for k in final)


def test_convert_a_root_skips_an_incomplete_step(checkpoints, tmp_path, capsys):
    root = tmp_path / "ckpt"
    shutil.copytree(checkpoints[0], root)
    (root / "step_2" / "trainer_state.json").unlink()  # as if killed mid-save
    code, out, err = run_cli(capsys, "convert", str(root), str(tmp_path / "hf"))
    assert code == 0, err
    assert out.startswith(f"converting {root / 'step_1'}: the newest complete checkpoint in {root}\n")
    assert f"checkpoint {root / 'step_2'} is not usable (no trainer_state.json)" in err


def test_convert_a_root_without_a_complete_checkpoint_is_refused(tmp_path, capsys):
    root = tmp_path / "ckpt"
    (root / "step_5").mkdir(parents=True)
    code, out, err = run_cli(capsys, "convert", str(root), str(tmp_path / "hf"))
    assert code == 2 and out == "" and "Traceback" not in err
    assert f"novarl: error: '{root}' holds no complete checkpoint (step_5: no trainer_state.json)." in err
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = run_cli(capsys, "convert", str(empty), str(tmp_path / "hf"))
    assert code == 2 and f"novarl: error: '{empty}' holds no checkpoint (no step_N folder)" in err
    assert not (tmp_path / "hf").exists()


# ============================================================ a run cut short by its time budget
def test_a_time_budget_stop_is_said_in_the_log_and_the_result(capsys, tmp_path):
    code, out, err = run_cli(capsys, "train", f"logger.log_dir={tmp_path}", "logger.progress_bar=false",
                             "grpo.max_num_steps=5", "grpo.max_train_seconds=1e-9", "grpo.val_at_start=false",
                             "grpo.max_val_samples=20", HF)
    assert code == 0, err
    assert "stopped at step 0 of 5: grpo.max_train_seconds=1e-09 reached" in err
    assert "did not reach its end" in err
    assert "(0 of 5 steps: stopped on grpo.max_train_seconds)" in out
