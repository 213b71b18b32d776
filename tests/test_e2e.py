"""End to end on the bundled tiny model: real FSDP2 (world size 1, gloo), real
transformers generation, real reward; nothing of novarl's own is mocked."""

import statistics

import pytest
import torch

from novarl.cli import BUNDLED_RECIPE
from novarl.config import load_config
from novarl.logging.metrics import read_jsonl
from novarl.trainer.api import GRPOTrainer
from tests.helpers import HF

pytestmark = pytest.mark.slow


def recipe(tmp_path, *overrides):
    return load_config(BUNDLED_RECIPE, overrides=[f"logger.log_dir={tmp_path}", "logger.progress_bar=false",
                                                   "grpo.max_train_seconds=null", HF, *overrides])


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("run")
    cfg = recipe(tmp, "grpo.max_num_steps=80", "grpo.val_period=0", "grpo.max_val_samples=300")
    trainer = GRPOTrainer(cfg)
    return trainer, trainer.train()


def test_reward_rises(short_run):
    _, result = short_run
    rewards = [r["reward_mean"] for r in read_jsonl(result.output_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert len(rewards) == 80
    first, last = statistics.mean(rewards[:20]), statistics.mean(rewards[-20:])
    assert last > first + 0.03, (first, last)  # measured: 0.127 -> 0.178
    assert result.final_accuracy > result.initial_accuracy + 0.05  # measured: 29.3% -> 52.0%


def test_run_folder_has_metrics_plot_config_and_policy(short_run):
    _, result = short_run
    records = read_jsonl(result.output_dir / "metrics.jsonl")
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 80]
    assert result.initial_accuracy == evals[0]["accuracy"] and result.final_accuracy == evals[1]["accuracy"]
    step = next(r for r in records if r["kind"] == "train")
    for key in ("time_generation", "time_logprobs", "time_training", "time_weight_sync", "grad_norm", "lr"):
        assert step[key] >= 0
    # The generator samples with the weights the trainer has: their logprobs agree.
    assert max(r["logprob_mismatch"] for r in records if r["kind"] == "train") < 1e-3
    assert (result.output_dir / "reward_curve.png").stat().st_size > 10_000
    assert load_config(result.output_dir / "config.yaml").grpo.max_num_steps == 80
    assert (result.model_dir / "model.safetensors").is_file()


def test_saved_policy_reloads_with_identical_greedy_output(short_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trainer, result = short_run
    generator = trainer.roles.generator
    tokenizer = AutoTokenizer.from_pretrained(result.model_dir)
    model = AutoModelForCausalLM.from_pretrained(result.model_dir)
    prompts = ["37+58=", "12+10=", "99+99=", "45+67="] * 8
    tokenizer.padding_side = "left"
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    out = model.generate(**enc, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    reloaded = tokenizer.batch_decode(out[:, enc.input_ids.shape[1]:], skip_special_tokens=True)

    from novarl.types import Prompt, SamplingConfig

    ours = generator.submit([Prompt(text=p, token_ids=tokenizer(p).input_ids) for p in prompts],
                            SamplingConfig(max_new_tokens=4, temperature=0.0)).result()
    assert [c.text for c in ours] == reloaded
    # And the weights are the trained ones, not the bundled start.
    trained = trainer.roles.policy.full_state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, trained[name]), name


def steps_of(tmp_path, steps, *overrides) -> list[dict]:
    """The train records of a run of `steps` steps without evaluations."""
    cfg = recipe(tmp_path, f"grpo.max_num_steps={steps}", "grpo.val_at_start=false", "grpo.val_at_end=false",
                 *overrides)
    result = GRPOTrainer(cfg).train()
    return [r for r in read_jsonl(result.output_dir / "metrics.jsonl") if r["kind"] == "train"]


@pytest.fixture(scope="module")
def plain_steps(tmp_path_factory):
    """3 steps of the recipe as it is: 512 samples a step in 2 micro-batches of 256."""
    return steps_of(tmp_path_factory.mktemp("plain"), 3)


def test_gradient_accumulation_matches_one_big_micro_batch(tmp_path, plain_steps):
    """Two micro-batches of 256 (the recipe's) accumulate to the same update as one of 512."""
    one_micro_batch = steps_of(tmp_path, 2, "policy.train_micro_batch_size=512")
    for one, accumulated in zip(one_micro_batch, plain_steps[:2], strict=True):
        assert accumulated["reward_mean"] == one["reward_mean"]
        assert accumulated["loss"] == pytest.approx(one["loss"], abs=1e-6)
        assert accumulated["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4)


def test_kl_penalty_to_the_frozen_reference(tmp_path):
    cfg = recipe(tmp_path, "grpo.max_num_steps=6", "grpo.val_at_start=false", "grpo.val_at_end=false",
                 "loss_fn.reference_policy_kl_penalty=0.05", "policy.optimizer.kwargs.lr=1e-3")
    trainer = GRPOTrainer(cfg)
    result = trainer.train()
    kl = [r["kl_to_reference"] for r in read_jsonl(result.output_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert trainer.roles.reference is not None
    assert kl[0] == pytest.approx(0.0, abs=1e-7)  # before the first update policy == reference
    assert kl[-1] > 1e-5


def test_cpu_offload_and_activation_checkpointing_change_nothing_but_memory(tmp_path, plain_steps):
    runs = {"plain": plain_steps}
    for name, extra in (("offload", ["policy.dtensor_cfg.cpu_offload=true"]),
                        ("recompute", ["policy.dtensor_cfg.activation_checkpointing=true"])):
        runs[name] = steps_of(tmp_path / name, 3, *extra)
    for name in ("offload", "recompute"):
        for base, other in zip(runs["plain"], runs[name], strict=True):
            assert other["loss"] == pytest.approx(base["loss"], abs=1e-6), name
            assert other["grad_norm"] == pytest.approx(base["grad_norm"], rel=1e-4), name


def test_bfloat16_mixed_precision(tmp_path):
    cfg = recipe(tmp_path, "grpo.max_num_steps=2", "grpo.val_at_start=false", "grpo.val_at_end=false",
                 "policy.precision=bfloat16")
    trainer = GRPOTrainer(cfg)
    result = trainer.train()
    steps = [r for r in read_jsonl(result.output_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert all(torch.isfinite(torch.tensor([r["loss"], r["grad_norm"]])).all() for r in steps)
    assert trainer.roles.generator.engine.model.dtype == torch.bfloat16
    # FSDP2 keeps fp32 master weights and computes in bf16.
    assert {p.dtype for p in trainer.roles.policy.model.parameters()} == {torch.float32}
    assert steps[-1]["logprob_mismatch"] < 0.1  # bf16 generator vs bf16-compute trainer


def test_python_api_train_with_a_callable_reward_and_in_memory_data(tmp_path):
    import novarl

    seen = []

    def reward(completion: str, answer: str, prompt: str) -> float:
        seen.append(prompt)
        return float(completion.strip() == answer)

    rows = [{"prompt": f"{a}+{a + 1}=", "answer": str(2 * a + 1)} for a in range(10, 42)]
    result = novarl.train(model="tiny-arith", dataset=rows, reward_fn=reward,
                          config=str(BUNDLED_RECIPE), max_num_steps=2, num_prompts_per_step=8,
                          num_generations_per_prompt=4, log_dir=str(tmp_path),
                          policy__train_micro_batch_size=16, grpo__max_val_samples=32,
                          grpo__val_period=0, logger__progress_bar=False, policy__generation__backend="hf")
    assert isinstance(result, novarl.TrainResult) and result.steps == 2
    assert result.final_accuracy is not None and result.model_dir.is_dir()
    assert set(seen) <= {r["prompt"] for r in rows} and len(seen) >= 2 * 8 * 4


@pytest.mark.parametrize("threshold, warned", [(-1.0, True), (None, False)], ids=["above", "default"])
def test_logprob_mismatch_above_the_threshold_prints_one_warning_with_advice(tmp_path, monkeypatch, capsys,
                                                                              threshold, warned):
    import novarl.trainer.grpo
    import novarl.rollout.batch

    if threshold is not None:  # any mismatch, 0 included, is above -1
        # the loop compares with its imported copy; the advice quotes rollout's
        monkeypatch.setattr(novarl.trainer.grpo, "MISMATCH_WARNING", threshold)
        monkeypatch.setattr(novarl.rollout.batch, "MISMATCH_WARNING", threshold)
    cfg = recipe(tmp_path, "grpo.max_num_steps=2", "grpo.val_at_start=false", "grpo.val_at_end=false",
                 "grpo.num_prompts_per_step=8", "grpo.num_generations_per_prompt=4",
                 "policy.train_micro_batch_size=32")
    result = GRPOTrainer(cfg).train()
    err = capsys.readouterr().err
    first = next(r for r in read_jsonl(result.output_dir / "metrics.jsonl") if r["kind"] == "train")
    warning = (f"[novarl] warning at step 1: the generator's token probabilities differ from the trainer's by "
               f"{first['logprob_mismatch']:.3f} on average (warning above {novarl.trainer.grpo.MISMATCH_WARNING})")
    if warned:
        assert warning in err, err
        assert err.count("token probabilities differ") == 1  # once per run, not every step
        assert "policy.generation.vllm_cfg.precision matches policy.precision" in err
    else:
        assert first["logprob_mismatch"] < novarl.trainer.grpo.MISMATCH_WARNING
        assert "token probabilities differ" not in err
