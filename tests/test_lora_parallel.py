"""LoRA beyond one FSDP2 rank: tensor (and sequence) parallelism on DTensor, and DeepSpeed ZeRO-3,
each against the same LoRA run on one in-process rank (the adapters start from the same seeded
draw on every layout); ZeRO-3 also resumes exactly from an adapters-only checkpoint and converts."""

from __future__ import annotations

import os

import pytest
import torch

from novarl.cli import BUNDLED_RECIPE, main
from novarl.config import load_config
from novarl.trainer.api import GRPOTrainer
from tests.helpers import HF, train_steps

pytest.importorskip("peft")
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]  # tests/conftest.py
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

LORA = ["policy.dtensor_cfg.lora_cfg.enabled=true", "policy.dtensor_cfg.lora_cfg.use_triton=false",
        "policy.dtensor_cfg.lora_cfg.dim=4", "policy.dtensor_cfg.lora_cfg.alpha=8"]
STEPS = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """tiny-arith with 2 KV heads (the same function), so that TP=2 can split it."""
    from tests.helpers.models import two_kv_head_copy

    return two_kv_head_copy(tmp_path_factory.mktemp("mha"))


def run(tmp_path, model, steps, *overrides):
    cfg = load_config(BUNDLED_RECIPE, overrides=[
        f"logger.log_dir={tmp_path / 'logs'}", "logger.progress_bar=false", "grpo.max_train_seconds=null",
        f"grpo.max_num_steps={steps}", "grpo.val_at_start=false", "grpo.val_at_end=false",
        "policy.train_micro_batch_size=128", f"policy.model_name={model}", HF, *LORA, *overrides])
    result = GRPOTrainer(cfg).train()
    return result, train_steps(result.output_dir)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, model):
    return run(tmp_path_factory.mktemp("one"), model, STEPS)[1]


def assert_same_training(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for step in expected:
        assert got[step]["reward_mean"] == expected[step]["reward_mean"]
        assert got[step]["loss"] == pytest.approx(expected[step]["loss"], abs=1e-6)
        assert got[step]["grad_norm"] == pytest.approx(expected[step]["grad_norm"], rel=1e-4)
        assert got[step]["logprob_mismatch"] < 1e-3  # the engines got the merged, trained weights


TORCH_STYLES = "policy.dtensor_cfg.custom_parallel_plan=novarl.backends.training.parallelize:LLAMA_LAYER_PLAN"


@pytest.mark.parametrize("layout", [[], ["policy.dtensor_cfg.sequence_parallel=true"], [TORCH_STYLES]],
                         ids=["tp", "tp+sp", "tp-custom-plan"])
def test_lora_with_tensor_and_sequence_parallelism_matches_one_rank(tmp_path, model, one_rank, layout):
    """The adapters split with their layers: on the default plans (backends/training/local_tp.py) a column-split
    layer's A and, under sequence parallelism, a row-split layer's B whole on every rank, their gradients summed
    over the ranks; under a custom plan of torch's styles, as parallelize.with_lora_adapters places them."""
    from safetensors.torch import load_file

    result, got = run(tmp_path, model, STEPS, "cluster.gpus_per_node=2", "policy.dtensor_cfg.tensor_parallel_size=2",
                      *layout)
    assert_same_training(got, one_rank)
    # Only the adapters trained: the norms (which sequence parallelism's styles re-register) are the base's.
    base, trained = load_file(str(model / "model.safetensors")), load_file(str(result.model_dir / "model.safetensors"))
    norms = [k for k in base if k.endswith("norm.weight")]
    assert norms and all(torch.equal(base[k], trained[k]) for k in norms)
    assert not torch.equal(base["model.layers.0.self_attn.o_proj.weight"],
                           trained["model.layers.0.self_attn.o_proj.weight"])  # merged adapters moved it


def test_lora_on_zero3_matches_one_rank_resumes_from_adapters_and_converts(tmp_path, model, one_rank):
    from safetensors.torch import load_file

    ckpt = ["checkpointing.enabled=true", "checkpointing.save_period=2", "checkpointing.keep_top_k=10",
            f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}", "cluster.gpus_per_node=2",
            "policy.deepspeed_cfg.enabled=true", "policy.deepspeed_cfg.zero_stage=3"]
    _, first = run(tmp_path, model, 2, *ckpt)
    for states in (tmp_path / "ckpt" / "step_2" / "policy" / "deepspeed").glob("*model_states.pt"):
        saved = torch.load(states, weights_only=False)  # DeepSpeed's own file, written by this test
        params = [k for k in saved["module"] if k not in saved["buffer_names"]]
        assert params and all("lora_" in k for k in params)  # no frozen base weight is saved
        assert not saved.get("frozen_param_fragments")
    result, resumed = run(tmp_path, model, STEPS, *ckpt)
    assert sorted(resumed) == [3, 4]
    assert_same_training({**first, **resumed}, one_rank)

    out = tmp_path / "converted"
    assert main(["convert", str(tmp_path / "ckpt" / f"step_{STEPS}"), str(out)]) == 0
    exported, converted = (load_file(str(folder / "model.safetensors")) for folder in (result.model_dir, out))
    assert exported.keys() == converted.keys() and not any("lora" in k for k in exported)
    assert all(torch.equal(exported[k], converted[k]) for k in exported)
    assert (out / "adapter" / "adapter_model.safetensors").exists()
