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


@pytest.mark.parametrize("layout", [["policy.dtensor_cfg.sequence_parallel=true"], [TORCH_STYLES]],
                         ids=["tp+sp", "tp-custom-plan"])
def test_lora_with_tensor_and_sequence_parallelism_matches_one_rank(tmp_path, model, one_rank, layout):
    """GRPO runs with the adapters split with their layers (on the default plan, backends/training/local_tp.py;
    on a custom plan of torch's styles, as parallelize.with_lora_adapters places them) train, sync and export
    as one rank does. (Each adapter's gradient against one rank's: the test below; tp without sequence
    parallelism there.)"""
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


def lora_sgd_steps(model: str, world: int, *overrides: str) -> list[dict[str, torch.Tensor]]:
    """Two plain SGD steps (no clipping) of a LoRA policy with tensor_parallel_size=world: each step's change of
    every adapter weight (whole). B starts at 0, so the first step moves B alone and the second A: each change
    is -lr x that parameter's gradient, in which a rank's share of the sum would show."""
    from torch.distributed.tensor import DTensor

    from novarl.backends.training.dtensor import DTensorPolicy
    from tests.helpers.packing import measure, mixed_batch

    torch.set_num_threads(1)
    cfg = load_config(None, overrides=[
        f"cluster.gpus_per_node={world}", f"policy.dtensor_cfg.tensor_parallel_size={world}",
        "policy.train_micro_batch_size=3", "policy.logprob_batch_size=4", "policy.scheduler=[]",
        "policy.optimizer.name=torch.optim.SGD", "policy.optimizer.kwargs={lr: 1e-4}", "policy.max_grad_norm=null",
        *LORA, *overrides])
    policy = DTensorPolicy(cfg.policy, model, torch.device("cpu"), total_steps=4)

    def adapters() -> dict[str, torch.Tensor]:
        return {name: (param.full_tensor() if isinstance(param, DTensor) else param).detach().clone()
                for name, param in policy.model.named_parameters() if param.requires_grad}

    weights = [adapters()]
    for seed in range(2):
        measure(lambda method, *args: getattr(policy, method)(*args), mixed_batch(rows=6, seed=seed))
        weights.append(adapters())
    return [{name: after[name] - before[name] for name in before} for before, after in zip(weights, weights[1:])]


LAYOUTS = {"tp": [], "tp+sp": ["policy.dtensor_cfg.sequence_parallel=true"], "tp-custom-plan": [TORCH_STYLES]}


def lora_layouts_rank(rank: int, world: int, rendezvous: str, results, model: str) -> None:
    import torch.distributed as dist

    from novarl.errors import UserError
    from tests.helpers.spawn import send

    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
    found: dict = {name: lora_sgd_steps(model, world, *overrides) for name, overrides in LAYOUTS.items()}
    try:  # local_tp's styles named in a custom plan
        lora_sgd_steps(model, world, "policy.dtensor_cfg.custom_parallel_plan="
                                     "novarl.backends.training.local_tp:LOCAL_LAYER_PLAN")
    except UserError as err:
        found["local styles in a custom plan"] = str(err)
    send(results, rank, found)


def test_lora_gradients_under_tensor_parallelism_are_one_ranks_parameter_by_parameter(model):
    """Every adapter weight's gradient on tp 2 (default plans with and without sequence parallelism; a custom
    plan of torch's styles) equals one rank's, read from two SGD steps' changes: A of column-split layers and,
    under sequence parallelism, B of row-split ones are whole on every rank, each rank's gradient a share
    that the trainer sums (parallelize.partial_parameters). Without the sum, A's changes in the second step
    were half (or all: a rank held no share) off. local_tp's styles in a custom plan, which that sum does not
    know, are refused, naming them."""
    from novarl.distributed.local import ensure_single_process_group
    from tests.helpers.spawn import spawned

    ranks = spawned(lora_layouts_rank, 2, str(model))
    ensure_single_process_group()
    alone = lora_sgd_steps(str(model), 1)
    moved = [name for name, change in alone[1].items() if "lora_A" in name and change.abs().max() > 1e-5]
    assert len(moved) == 7 * 2  # every A of the 2 layers' 7 adapted layers moves in the second step
    for rank in ranks:
        for layout in LAYOUTS:
            for step, want in enumerate(alone):
                assert rank[layout][step].keys() == want.keys()
                for name, change in want.items():
                    # (a change is a difference of weights near 1: float32 rounds it to ~3e-8)
                    torch.testing.assert_close(rank[layout][step][name], change, rtol=1e-4,
                                               atol=1e-6 + 1e-5 * float(change.abs().max()),
                                               msg=lambda text: f"{layout}, step {step + 1}, {name}: {text}")
        refusal = rank["local styles in a custom plan"]
        assert "custom_parallel_plan='novarl.backends.training.local_tp:LOCAL_LAYER_PLAN'" in refusal
        assert "'self_attn.q_proj'" in refusal and "torch's styles" in refusal


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
