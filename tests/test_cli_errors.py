"""The command line on bad input: exit code 2, a short message naming what is
wrong and where, no traceback, and no run folder; `validate` refuses what `train`
refuses (the same preflight). Plus the reward scorer's checks on what a user's
reward function returns, and a step out of GPU memory (exit 1, what to change). Nothing
else is trained."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from novarl.cli import BUNDLED_RECIPE, main
from novarl.errors import UserError
from novarl.rewards.scorer import RewardScorer
from novarl.types import Completion, Prompt
from tests.helpers import HF, default_generation

DEFAULT_GENERATION = default_generation()
CUDA = torch.cuda.is_available()


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def error_line(err: str) -> str:
    """The `novarl: error: ...` message (the [novarl] progress lines before it are info)."""
    start = err.find("novarl: error: ")
    assert start >= 0, err
    return err[start:]


def assert_refused_cleanly(code: int, err: str, log_dir: Path) -> str:
    assert code == 2
    assert "Traceback" not in err
    assert not log_dir.exists() or not any(log_dir.iterdir()), f"run folder written: {list(log_dir.iterdir())}"
    return error_line(err)


@pytest.fixture
def log_dir(tmp_path) -> Path:
    return tmp_path / "logs"


# ============================================================ subprocess: real exit codes
def novarl(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    """`python -m novarl ...` (novarl/__main__.py), as a user runs it."""
    return subprocess.run([sys.executable, "-m", "novarl", *argv], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def test_version_exits_0(tmp_path):
    import novarl as package

    proc = novarl("--version", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"novarl {package.__version__}\n"
    script = Path(sys.executable).parent / "novarl"  # the console script, where installed
    if script.is_file():
        console = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=60)
        assert (console.returncode, console.stdout) == (0, proc.stdout)


def test_validate_bundled_recipe_exits_0(tmp_path):
    proc = novarl("validate", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"# valid. training backend: dtensor; generation backend: {DEFAULT_GENERATION}" in proc.stdout
    assert "model_name: tiny-arith" in proc.stdout
    assert "not available yet" not in proc.stdout
    assert "# model: tiny-arith" in proc.stdout and "7100 train / 1000 held-out prompts" in proc.stdout
    assert list(tmp_path.iterdir()) == []


def test_validate_refusal_exits_2_without_traceback(tmp_path):
    proc = novarl("validate", f"policy.model_name={tmp_path / 'nope'}", cwd=tmp_path)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert proc.stderr.startswith(f"novarl: error: policy.model_name='{tmp_path / 'nope'}'")


def test_train_unknown_key_exits_2_without_traceback(tmp_path):
    log_dir = tmp_path / "logs"
    proc = novarl("train", f"logger.log_dir={log_dir}", "policy.dtensor_cgf.enabled=true", cwd=tmp_path)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("novarl: error: Invalid config")
    assert "unknown key 'policy.dtensor_cgf' (did you mean 'dtensor_cfg'?)" in proc.stderr
    assert not log_dir.exists()


def test_train_missing_config_file_exits_2_without_traceback(tmp_path):
    proc = novarl("train", "-c", "nope.yaml", f"logger.log_dir={tmp_path / 'logs'}", cwd=tmp_path)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip() == "novarl: error: Config file 'nope.yaml' does not exist."
    assert list(tmp_path.iterdir()) == []


# ============================================================ in-process
def test_validate_prints_the_resolved_config_and_the_plan(capsys):
    code, out, err = run_cli(capsys, "validate", "grpo.num_prompts_per_step=32",
                           "policy.max_total_sequence_length=20")
    assert code == 0, err
    assert "num_prompts_per_step: 32\n" in out
    assert "max_seq_length: 20\n" in out
    assert "batch: 256 samples per GRPO step" in out


def test_validate_refuses_what_train_cannot_run_yet(capsys, log_dir):
    code, out, err = run_cli(capsys, "validate", "grpo.max_rollout_turns=2")
    msg = assert_refused_cleanly(code, err, log_dir)
    assert out == ""
    assert "does not have yet" in msg and "multi-turn rollouts (grpo.max_rollout_turns=2)" in msg


def test_validate_prints_the_warnings_plan_prints(capsys):
    code, out, err = run_cli(capsys, "validate", "logger.swanlab_enabled=true", "policy.deepspeed_cfg.enabled=true")
    assert code == 0, err
    assert f"# note: policy.generation.backend not set: using '{DEFAULT_GENERATION}' (" in out
    assert "# warning: logger.swanlab_enabled: SwanLab is not available yet; metrics go to metrics.jsonl and the " \
           "other trackers\n" in out
    assert "# valid. training backend: deepspeed (also enabled, ignored by precedence" in out


def test_train_unknown_nested_key(capsys, log_dir):
    code, _, err = run_cli(capsys, "train", f"logger.log_dir={log_dir}", "grpo.num_prompts_per_stp=4")
    msg = assert_refused_cleanly(code, err, log_dir)
    assert "unknown key 'grpo.num_prompts_per_stp' (did you mean 'num_prompts_per_step'?)" in msg
    assert str(BUNDLED_RECIPE) in msg


def test_train_bad_value_names_key_and_value(capsys, log_dir):
    code, _, err = run_cli(capsys, "train", f"logger.log_dir={log_dir}", "policy.generation.temperature=0")
    msg = assert_refused_cleanly(code, err, log_dir)
    assert "'policy.generation.temperature' = 0" in msg and "greater than 0" in msg


def test_train_missing_config_file(capsys, tmp_path, log_dir):
    code, _, err = run_cli(capsys, "train", "-c", str(tmp_path / "nope.yaml"), f"logger.log_dir={log_dir}")
    msg = assert_refused_cleanly(code, err, log_dir)
    assert f"'{tmp_path / 'nope.yaml'}' does not exist" in msg


def test_train_invalid_yaml_names_the_line(capsys, tmp_path, log_dir):
    path = tmp_path / "bad.yaml"
    path.write_text("grpo:\n  seed: 1\n policy: {}\n")
    code, _, err = run_cli(capsys, "train", "-c", str(path), f"logger.log_dir={log_dir}")
    msg = assert_refused_cleanly(code, err, log_dir)
    assert str(path) in msg and "not valid YAML at line 3" in msg


# Each bad input below is refused by `train` before anything starts, and by `validate` alike.
BOTH = pytest.mark.parametrize("command", ["train", "validate"])


@BOTH
def test_bad_model_path(capsys, log_dir, command):
    code, _, err = run_cli(capsys, command, f"logger.log_dir={log_dir}", "policy.model_name=./does/not/exist")
    msg = assert_refused_cleanly(code, err, log_dir)
    assert "policy.model_name='./does/not/exist'" in msg and "no model folder there" in msg


@BOTH
def test_sequence_longer_than_the_model_positions_with_vllm(capsys, log_dir, command):
    code, _, err = run_cli(capsys, command, f"logger.log_dir={log_dir}", "policy.max_seq_length=512",
                           "policy.generation.backend=vllm")
    msg = assert_refused_cleanly(code, err, log_dir)
    assert "policy.max_seq_length=512 is longer than the model's max_position_embeddings=64" in msg
    assert "at most 64" in msg


def test_vllm_max_model_len_longer_than_the_model_positions_is_refused_by_validate(capsys, log_dir):
    """Seed 000's vLLM block sets max_model_len: 512; over a 64-position model vLLM would refuse the
    engine at start, so validate says so (it used to call the config valid)."""
    code, _, err = run_cli(capsys, "validate", f"logger.log_dir={log_dir}", "policy.generation.backend=vllm",
                           "policy.generation.vllm_cfg.max_model_len=512")
    msg = assert_refused_cleanly(code, err, log_dir)
    assert "policy.generation.vllm_cfg.max_model_len=512 is longer than the model's max_position_embeddings=64" in msg


def test_a_start_that_fails_after_the_checks_leaves_no_run_folder(capsys, log_dir):
    """More ranks than this machine's Ray cluster has: refused when the workers are placed,
    after the run folder was made; the folder goes again."""
    code, _, err = run_cli(capsys, "train", f"logger.log_dir={log_dir}", "cluster.gpus_per_node=64",
                           "policy.train_micro_batch_size=8", "policy.logprob_batch_size=8", HF)
    msg = assert_refused_cleanly(code, err, log_dir)
    assert "64 CPU" in msg and "in all" in msg


@BOTH
def test_model_folder_without_config_json(capsys, tmp_path, log_dir, command):
    folder = tmp_path / "empty_model"
    folder.mkdir()
    code, _, err = run_cli(capsys, command, f"logger.log_dir={log_dir}", f"policy.model_name={folder}")
    msg = assert_refused_cleanly(code, err, log_dir)
    assert f"policy.model_name='{folder}'" in msg and "no config.json" in msg


@BOTH
def test_dataset_with_a_bad_json_line_names_file_and_line(capsys, tmp_path, log_dir, command):
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n"
                    + json.dumps({"prompt": "2+2=", "answer": "4"}) + "\n"
                    + '{"prompt": "3+3=", "answer": \n')
    code, _, err = run_cli(capsys, command, f"logger.log_dir={log_dir}", "data.dataset_name=ResponseDataset",
                           f"data.train_data_path={data}")
    msg = assert_refused_cleanly(code, err, log_dir)
    assert f"{data}:3: not valid JSON" in msg


@BOTH
def test_dataset_row_without_the_prompt_field(capsys, tmp_path, log_dir, command):
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"question": "1+1=", "answer": "2"}) + "\n")
    code, _, err = run_cli(capsys, command, f"logger.log_dir={log_dir}", "data.dataset_name=ResponseDataset",
                           f"data.train_data_path={data}")
    msg = assert_refused_cleanly(code, err, log_dir)
    assert f"{data}:1: no field 'prompt'" in msg and "data.input_key" in msg


@BOTH
def test_missing_dataset_file(capsys, tmp_path, log_dir, command):
    code, _, err = run_cli(capsys, command, f"logger.log_dir={log_dir}", "data.dataset_name=ResponseDataset",
                           f"data.train_data_path={tmp_path / 'none.jsonl'}")
    msg = assert_refused_cleanly(code, err, log_dir)
    assert f"data.train_data_path='{tmp_path / 'none.jsonl'}': no such file" in msg


@BOTH
def test_missing_validation_file(capsys, tmp_path, log_dir, command):
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    code, _, err = run_cli(capsys, command, f"logger.log_dir={log_dir}", f"data.train_data_path={data}",
                           f"data.val_data_path={tmp_path / 'none.jsonl'}", "grpo.num_prompts_per_step=1",
                           "policy.train_micro_batch_size=8")
    msg = assert_refused_cleanly(code, err, log_dir)
    assert f"data.val_data_path='{tmp_path / 'none.jsonl'}': no such file" in msg


@BOTH
def test_unknown_dataset_name(capsys, log_dir, command):
    code, _, err = run_cli(capsys, command, f"logger.log_dir={log_dir}", "data.dataset_name=gsm8k_typo")
    msg = assert_refused_cleanly(code, err, log_dir)
    assert "data.dataset_name='gsm8k_typo' is not a dataset novarl has" in msg and "'arithmetic'" in msg


@pytest.mark.parametrize("spec, expected", [
    ("novarl.rewards.verifiers:no_such_function",
     "module 'novarl.rewards.verifiers' has no function 'no_such_function'"),
    ("no_such_module_for_novarl_tests:score", "importing module 'no_such_module_for_novarl_tests' failed: ModuleNotFoundError"),
    ("exact_mtch", "neither a registered reward (exact_match, math_verify, boxed_match, last_number, boxed_format, "
                   "crossthinkqa, crossthinkqa_loose, crossthinkqa_strict, ifeval, dapo_math_verify, code_tests, code_pass_rate, "
                   "reward_model, llm_judge) nor an import path 'module:function' or 'path/to/file.py:function': did you mean "
                   "'exact_match'?"),
])
@BOTH
def test_reward_function_that_does_not_exist(capsys, log_dir, spec, expected, command):
    code, _, err = run_cli(capsys, command, f"logger.log_dir={log_dir}", f"reward.function={spec}")
    msg = assert_refused_cleanly(code, err, log_dir)
    assert f"reward.function='{spec}'" in msg and expected in msg


@pytest.mark.parametrize("spec, expected", [
    ("raising_reward", "raised ZeroDivisionError: no denominator"),
    ("string_reward", "returned '1.0' (str), not a finite number"),
])
@BOTH
def test_reward_function_that_fails_its_smoke_call(capsys, log_dir, spec, expected, command):
    # Called once on a training example before anything starts (the functions are defined below).
    spec = f"{__name__}:{spec}"
    code, _, err = run_cli(capsys, command, f"logger.log_dir={log_dir}", f"reward.function={spec}")
    msg = assert_refused_cleanly(code, err, log_dir)
    assert msg.startswith(f"novarl: error: reward.function='{spec}': a trial call on a training example")
    assert expected in msg and "completion '" in msg


@pytest.mark.skipif(CUDA, reason="this host has CUDA: Megatron runs")
def test_megatron_without_a_gpu_is_refused_by_train_and_valid_for_a_gpu_host(capsys, log_dir, monkeypatch):
    monkeypatch.delenv("NOVARL_MEGATRON_ON_CPU", raising=False)
    code, _, err = run_cli(capsys, "train", f"logger.log_dir={log_dir}", "policy.megatron_cfg.enabled=true")
    msg = assert_refused_cleanly(code, err, log_dir)
    assert "this host lacks a CUDA GPU: Megatron-core trains and generates on CUDA GPUs only" in msg
    assert "NOVARL_MEGATRON_ON_CPU=1 runs it on the CPU for tests" in msg
    # validate: the config is valid for a GPU host, which it says in one line (exit 0).
    code, out, err = run_cli(capsys, "validate", f"logger.log_dir={log_dir}", "policy.megatron_cfg.enabled=true")
    assert code == 0, err
    gpu_lines = [line for line in out.splitlines() if "valid for a GPU host" in line]
    assert len(gpu_lines) == 1 and "a CUDA GPU: Megatron-core trains" in gpu_lines[0], out
    assert not log_dir.exists()
    # what the model's config.json alone decides is checked on this host too: a GPU host would refuse it
    code, _, err = run_cli(capsys, "validate", f"logger.log_dir={log_dir}", "policy.megatron_cfg.enabled=true",
                           "policy.megatron_cfg.converter_type=Qwen2ForCausalLM")
    assert code == 2 and "converter_type='Qwen2ForCausalLM' does not match the model, a LlamaForCausalLM" in err


@pytest.mark.skipif(CUDA, reason="this host has CUDA: Megatron runs")
def test_plan_megatron_says_what_needs_a_gpu_host(capsys, monkeypatch):
    monkeypatch.delenv("NOVARL_MEGATRON_ON_CPU", raising=False)
    code, out, err = run_cli(capsys, "plan", "policy.megatron_cfg.enabled=true", "policy.generation.backend=vllm",
                             "cluster.gpus_per_node=2")
    assert code == 0  # what a GPU host has is not a problem of the config
    assert "Traceback" not in err
    assert "training backend: megatron (also enabled, ignored by precedence" in out
    assert "needs a GPU host: a CUDA GPU: Megatron-core trains" in out
    assert "generation backend: vllm" in out
    assert "not available yet: Ray" not in out and "(dp=2)" in out  # two DTensor ranks over Ray are built
    # What novarl does not build is: exit 2.
    code, out, _ = run_cli(capsys, "plan", "policy.megatron_cfg.enabled=true", "grpo.max_rollout_turns=2")
    assert code == 2 and "not available yet: an environment for multi-turn rollouts" in out


def test_plan_bundled_recipe_exits_0(capsys):
    code, out, _ = run_cli(capsys, "plan")
    assert code == 0
    assert out.splitlines()[0] == f"training backend: dtensor; generation backend: {DEFAULT_GENERATION}"
    assert "batch: 512 samples per GRPO step -> 1 optimizer step(s) of 512" in out
    assert "not available yet" not in out


def test_plan_inconsistent_batches_exits_2(capsys):
    code, _, err = run_cli(capsys, "plan", "policy.train_global_batch_size=100")
    assert code == 2
    assert "Traceback" not in err
    assert "64 x 8 = 512 samples, not a multiple of policy.train_global_batch_size=100" in error_line(err)


# ============================================================ reward scorer
PROMPT = Prompt(text="1+1=", token_ids=[1, 2, 3], answer="2", index=0)


def completion(text: str) -> Completion:
    return Completion(prompt=PROMPT, token_ids=[4, 5], logprobs=[-0.1, -0.2], text=text,
                      finish_reason="stop", policy_version=0)


def raising_reward(completion: str, answer: str | None) -> float:
    raise ZeroDivisionError("no denominator")


def string_reward(completion: str, answer: str | None) -> float:
    return "1.0"  # type: ignore[return-value]


def nan_reward(completion: str, answer: str | None) -> float:
    return math.nan


def inf_reward(completion: str, answer: str | None) -> float:
    return math.inf


def none_reward(completion: str, answer: str | None) -> float:
    return None  # type: ignore[return-value]


def prompt_aware_reward(completion: str, answer: str | None, prompt: str) -> float:
    return float(prompt == "1+1=" and completion.strip() == answer)


def test_reward_function_that_raises_names_function_and_sample():
    scorer = RewardScorer.from_spec(raising_reward)
    with pytest.raises(UserError) as info:
        scorer.score([completion(" 2"), completion(" 3")])
    msg = str(info.value)
    assert "Reward function 'raising_reward' raised ZeroDivisionError: no denominator" in msg
    assert "prompt '1+1='" in msg and "completion ' 2'" in msg


@pytest.mark.parametrize("fn, shown", [
    (string_reward, "'1.0' (str)"),
    (nan_reward, "nan (float)"),
    (inf_reward, "inf (float)"),
    (none_reward, "None (NoneType)"),
])
def test_reward_function_returning_a_non_number_names_function_value_and_sample(fn, shown):
    with pytest.raises(UserError) as info:
        RewardScorer.from_spec(fn).score([completion("3")])
    msg = str(info.value)
    assert f"Reward function '{fn.__name__}' returned {shown}, not a finite number" in msg
    assert "prompt '1+1='" in msg and "completion '3'" in msg


def test_reward_scorer_passes_the_prompt_when_asked_and_returns_floats():
    scores = RewardScorer.from_spec(prompt_aware_reward).score([completion(" 2"), completion("3")])
    assert scores == [1.0, 0.0]
    assert all(type(s) is float for s in scores)


def test_reward_scorer_by_registered_name_and_import_path():
    by_name = RewardScorer.from_spec("exact_match")
    by_path = RewardScorer.from_spec("novarl.rewards.verifiers:exact_match")
    assert by_name.name == "exact_match" and by_path.name == "novarl.rewards.verifiers:exact_match"
    assert by_name.score([completion("2"), completion("3")]) == [1.0, 0.0]
    assert by_path.score([completion("2")]) == [1.0]


# ============================================================ positional config
FSDP2X2 = Path(__file__).parents[1] / "examples" / "configs" / "grpo_tiny_fsdp2x2.yaml"


@pytest.mark.parametrize("command", ["validate", "plan"])
def test_positional_config_is_the_same_as_dash_c(capsys, tmp_path, command):
    with_flag = run_cli(capsys, command, "-c", str(FSDP2X2), "grpo.seed=7")
    positional = run_cli(capsys, command, str(FSDP2X2), "grpo.seed=7")
    assert positional == with_flag and positional[0] == 0, positional[2]
    assert "(dp=2)" in positional[1]  # the example's 2 ranks, not the bundled recipe's 1
    yml = tmp_path / "recipe.yml"
    yml.write_text(FSDP2X2.read_text())
    assert run_cli(capsys, command, str(yml), "grpo.seed=7") == with_flag


def test_train_takes_a_positional_config(capsys, log_dir):
    # Refused at validation (nothing starts): the message names the positional file as the config.
    code, _, err = run_cli(capsys, "train", str(FSDP2X2), f"logger.log_dir={log_dir}", "grpo.num_prompts_per_stp=4")
    msg = assert_refused_cleanly(code, err, log_dir)
    assert msg.startswith(f"novarl: error: Invalid config ({FSDP2X2} with overrides")
    assert "unknown key 'grpo.num_prompts_per_stp'" in msg


@pytest.mark.parametrize("command", ["train", "validate", "plan"])
def test_dash_c_and_a_positional_config_together_is_refused(capsys, log_dir, command):
    code, out, err = run_cli(capsys, command, "-c", str(BUNDLED_RECIPE), str(FSDP2X2), f"logger.log_dir={log_dir}")
    msg = assert_refused_cleanly(code, err, log_dir)
    assert out == ""
    assert msg.strip() == (f"novarl: error: Two configs given: -c {BUNDLED_RECIPE} and '{FSDP2X2}'. Give one, "
                           "either as the first argument after the command or with -c, not both.")


def test_a_rank_that_fails_in_torch_compile_is_reported_by_what_failed_not_by_torchs_hint():
    """A rank's error in the run's message (ray_group.what_failed): its last line, but for torch.compile's
    errors, whose last line only says to set TORCHDYNAMO_VERBOSE, the error the compiler raised or dynamo's
    explanation (real errors of torch.compile on the CPU)."""
    from novarl.distributed.ray_group import what_failed

    def failing_backend(gm, inputs):
        raise RecursionError("maximum recursion depth exceeded")

    with pytest.raises(Exception) as compiler:
        torch.compile(lambda x: x + 1, backend=failing_backend)(torch.ones(1))
    assert str(compiler.value).strip().splitlines()[-1].startswith("Set TORCHDYNAMO_VERBOSE")
    assert what_failed(compiler.value) == "RecursionError: maximum recursion depth exceeded"
    with pytest.raises(Exception) as dynamo:
        torch.compile(lambda x: x.pow(object()), backend="eager", fullgraph=True)(torch.ones(2))
    assert what_failed(dynamo.value).startswith("Explanation: Dynamo does not know how to trace builtin operator")
    assert what_failed(ValueError("the cause\n  the last line  ")) == "the last line"
    long = what_failed(ValueError("x" * 300 + "the end"), limit=60)
    assert long.startswith("x" * 20 + " ... ") and long.endswith("the end") and len(long) < 80


def test_a_step_out_of_gpu_memory_says_what_to_change_and_keeps_the_checkpoints(capsys, tmp_path, monkeypatch):
    """torch's CUDA out-of-memory error (raised here by the optimizer's second step, as a GPU would raise it):
    exit 1, one message with torch's figures and what to change, no traceback; step 1's checkpoint intact."""
    from novarl.trainer.checkpoint import check_checkpoint

    step = torch.optim.AdamW.step
    calls = []

    def out_of_memory(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
                                         "capacity of 79.19 GiB of which 1.06 GiB is free.")
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", out_of_memory)
    ckpt = tmp_path / "ckpt"
    code, _, err = run_cli(capsys, "train", f"logger.log_dir={tmp_path / 'logs'}", "grpo.max_num_steps=2",
                           "grpo.val_at_start=false", "grpo.val_at_end=false", "checkpointing.enabled=true",
                           f"checkpointing.checkpoint_dir={ckpt}", "checkpointing.save_period=1")
    assert code == 1 and "Traceback" not in err
    assert error_line(err).startswith("novarl: error: out of GPU memory (CUDA out of memory. Tried to allocate "
                                      "2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.06 GiB is "
                                      "free). To fit: lower policy.train_micro_batch_size")
    assert check_checkpoint(ckpt / "step_1") is None
    assert not (ckpt / "step_2").exists()


def test_a_gpu_out_of_memory_is_found_behind_its_wrappers():
    """However torch's out-of-memory error reaches the driver: itself, a CUDA runtime error saying so, raised
    from, behind Ray's RayTaskError, inside torch.distributed.checkpoint's CheckpointException, or as a rank's
    WorkerDied marked so; and nothing else."""
    import traceback

    from ray.exceptions import RayTaskError
    from torch.distributed.checkpoint.api import CheckpointException

    from novarl.distributed.ray_group import WorkerDied
    from novarl.errors import is_out_of_memory, out_of_memory_message

    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
                                 "79.19 GiB of which 1.06 GiB is free. " + "Including non-PyTorch memory. " * 20)
    try:
        try:
            raise oom
        except torch.OutOfMemoryError as err:
            raise RuntimeError("the step failed") from err
    except RuntimeError as err:
        chained = err
    died = WorkerDied("policy rank 1 failed: OutOfMemoryError: CUDA out of memory.")
    died.out_of_memory = True
    found = [oom, RuntimeError("CUDA error: out of memory"), chained, RayTaskError("forward", "tb", oom),
             CheckpointException("load", {1: (oom, traceback.StackSummary())}), died]
    assert all(is_out_of_memory(error) for error in found)
    assert not any(is_out_of_memory(error) for error in (RuntimeError("the step failed"), MemoryError(),
                                                          RuntimeError("out of memory in a dict"),
                                                          WorkerDied("policy rank 1 died")))
    message = out_of_memory_message(CheckpointException("load", {0: (oom, traceback.StackSummary())}))
    assert message.startswith("out of GPU memory (CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
                              "capacity of 79.19 GiB of which 1.06 GiB is free. Including non-PyTorch memory")
    assert len(message) < 1000 and message.endswith("Files already written (checkpoints, logs) are kept.")


def test_a_resume_out_of_gpu_memory_is_not_taken_for_a_damaged_checkpoint(capsys, tmp_path, monkeypatch):
    """The checkpoint's load runs out of GPU memory (torch.distributed.checkpoint wraps it, as it wraps every
    rank's error): exit 1 with what to change, and no older checkpoint tried in its place (whose next save would
    write over the newer one) nor any deleted."""
    import traceback

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from novarl.trainer.checkpoint import check_checkpoint

    ckpt = tmp_path / "ckpt"
    common = [f"logger.log_dir={tmp_path / 'logs'}", "grpo.val_at_start=false", "grpo.val_at_end=false",
              "checkpointing.enabled=true", f"checkpointing.checkpoint_dir={ckpt}", "checkpointing.save_period=1"]
    assert run_cli(capsys, "train", "grpo.max_num_steps=2", *common)[0] == 0

    def out_of_memory(*args, **kwargs):
        oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 512.00 MiB.")
        raise CheckpointException("load", {0: (oom, traceback.StackSummary())})

    monkeypatch.setattr(dcp, "load", out_of_memory)
    code, _, err = run_cli(capsys, "train", "grpo.max_num_steps=3", *common)
    assert code == 1 and "Traceback" not in err and "trying an older one" not in err
    assert error_line(err).startswith("novarl: error: out of GPU memory (CUDA out of memory. Tried to allocate "
                                      "512.00 MiB). To fit: lower policy.train_micro_batch_size")
    assert [check_checkpoint(ckpt / f"step_{step}") for step in (1, 2)] == [None, None]
    assert not (ckpt / "step_3").exists()
