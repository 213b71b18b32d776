"""LoRA on the DTensor backend: the merged weights are the adapted model's, the PEFT adapter
folder loads with PEFT, checkpoints hold the adapters only, a resume is exact, and `convert`
writes the same merged folder the run exported."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from novarl.cli import BUNDLED_RECIPE, main
from novarl.config import load_config
from novarl.config.schema import LoraConfig
from novarl.models.bundled import resolve_bundled
from novarl.trainer.api import GRPOTrainer
from tests.helpers import HF, train_steps

pytest.importorskip("peft")
pytestmark = pytest.mark.slow

LORA = ["policy.dtensor_cfg.lora_cfg.enabled=true", "policy.dtensor_cfg.lora_cfg.use_triton=false",
        "policy.dtensor_cfg.lora_cfg.dim=4", "policy.dtensor_cfg.lora_cfg.alpha=8"]
COMMON = ["logger.progress_bar=false", "grpo.max_train_seconds=null", "grpo.val_at_start=false",
          "grpo.val_at_end=false", "checkpointing.enabled=true", "checkpointing.save_period=2",
          "checkpointing.keep_top_k=10", "loss_fn.reference_policy_kl_penalty=0.05", HF, *LORA]


def overrides(tmp_path, steps, *extra):
    return [f"logger.log_dir={tmp_path / 'logs'}", f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}",
            f"grpo.max_num_steps={steps}", *COMMON, *extra]


def test_merged_weights_and_the_peft_adapter_compute_what_the_adapted_model_does(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from novarl.models.lora import inject, merged, save_adapter, scaling

    folder = resolve_bundled("tiny-arith")
    cfg = LoraConfig(enabled=True, dim=4, alpha=8, lora_A_init="uniform")
    adapted = AutoModelForCausalLM.from_pretrained(folder)
    names = inject(adapted, cfg)
    assert names and all(n.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                   "down_proj") for n in names)  # every linear layer but the head
    assert all(("lora_" in n) == p.requires_grad for n, p in adapted.named_parameters())
    torch.manual_seed(1)
    for n, p in adapted.named_parameters():
        if "lora_B" in n:
            p.data.normal_(0, 0.05)  # B starts at zero: move it so the adapters change the outputs
    ids = torch.tensor([[1, 5, 6, 7, 8, 9]])
    expected = adapted(ids).logits
    state = dict(adapted.state_dict())
    plain = AutoModelForCausalLM.from_pretrained(folder)
    assert not torch.allclose(plain(ids).logits, expected, atol=1e-4)
    plain.load_state_dict(dict(merged(state.items(), scaling(cfg))))
    assert torch.allclose(plain(ids).logits, expected, atol=1e-5)
    save_adapter(tmp_path / "adapter", state, cfg, str(folder))
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder), tmp_path / "adapter")
    assert torch.allclose(peft(ids).logits, expected, atol=1e-5)


def test_the_reference_is_the_base_model_with_the_adapters_off():
    """A LoRA run's KL reference is its own frozen base: no second copy, the same logprobs a
    separate frozen model gives, whatever the adapters have learned."""
    from novarl.backends.training.dtensor import DTensorPolicy, DTensorReference
    from novarl.distributed.local import ensure_single_process_group
    from novarl.models.lora import BaseReference
    from novarl.models.loading import resolve_model_path
    from tests.helpers.packing import HEAD, mixed_batch

    ensure_single_process_group()
    cfg = load_config(None, overrides=LORA)
    path = resolve_model_path("tiny-arith")
    policy = DTensorPolicy(cfg.policy, path, torch.device("cpu"), total_steps=1)
    with torch.no_grad():
        for name, param in policy.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)  # trained adapters
    batch = mixed_batch(rows=6, longest=9)
    separate = DTensorReference(cfg.policy, path, torch.device("cpu")).forward(batch, HEAD)
    base = BaseReference(policy).forward(batch, HEAD)
    assert torch.allclose(base, separate, atol=1e-6)
    assert not torch.allclose(policy.forward(batch, HEAD), separate, atol=1e-3)  # the adapters are back on after
    assert all(p.requires_grad == ("lora_" in n) for n, p in policy.model.named_parameters())


def test_checkpoints_hold_the_adapters_only_resume_exactly_and_convert_merged(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    reference = GRPOTrainer(load_config(BUNDLED_RECIPE, overrides=overrides(tmp_path / "ref", 4))).train()
    run = tmp_path / "run"  # resumes from a copy of the reference's step-2 checkpoint
    shutil.copytree(tmp_path / "ref" / "ckpt" / "step_2", run / "ckpt" / "step_2")
    metadata = FileSystemReader(str(run / "ckpt" / "step_2" / "policy")).read_metadata()
    model_keys = [k for k in metadata.state_dict_metadata if k.startswith("model.")]
    assert model_keys and all("lora_" in k for k in model_keys)  # no frozen base weight is saved
    resumed = GRPOTrainer(load_config(BUNDLED_RECIPE, overrides=overrides(run, 4))).train()
    got, expected = train_steps(resumed.output_dir), train_steps(reference.output_dir)
    assert sorted(got) == [3, 4]
    for step in (3, 4):
        assert got[step]["reward_mean"] == expected[step]["reward_mean"]
        assert got[step]["loss"] == pytest.approx(expected[step]["loss"], abs=1e-7)
        assert got[step]["grad_norm"] == pytest.approx(expected[step]["grad_norm"], rel=1e-6)
        assert got[step]["kl_to_reference"] == pytest.approx(expected[step]["kl_to_reference"], rel=1e-5)
    assert got[4]["kl_to_reference"] > 0  # the adapted policy has moved from its base
    out = tmp_path / "converted"
    assert main(["convert", str(run / "ckpt" / "step_4"), str(out)]) == 0
    from safetensors.torch import load_file

    exported = load_file(str(resumed.model_dir / "model.safetensors"))
    converted = load_file(str(out / "model.safetensors"))
    assert exported.keys() == converted.keys() and not any("lora" in k for k in exported)
    assert all(torch.equal(exported[k], converted[k]) for k in exported)
    adapter = json.loads((resumed.model_dir / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and adapter["lora_alpha"] == 8


def test_lora_is_refused_where_it_is_not_built():  # Megatron; DTensor (FSDP2, TP) and DeepSpeed have it
    from novarl.backends.contract.checks import check_config

    def problems(policy: dict, **tree) -> str:
        policy = {**policy, "dtensor_cfg": {"lora_cfg": {"enabled": True}, **policy.get("dtensor_cfg", {})}}
        return " ".join(str(p) for p in check_config(load_config({"policy": policy, **tree})).problems)

    assert problems({}) == ""  # FSDP2 on one rank has it
    assert "LoRA" not in problems({"dtensor_cfg": {"tensor_parallel_size": 2}}, cluster={"gpus_per_node": 2})
    assert problems({"deepspeed_cfg": {"enabled": True}}) == ""
    assert "LoRA on the megatron training backend" in problems({"megatron_cfg": {"enabled": True}})
    # the adapters alone go to vLLM's LoRA support, not to Hugging Face engines
    assert "adapters sent to hf generation" in problems({"generation": {"backend": "hf", "lora_sync": "adapter"}})
    assert "vLLM LoRA of rank 600" in problems({"generation": {"backend": "vllm", "lora_sync": "adapter"},
                                                "dtensor_cfg": {"lora_cfg": {"enabled": True, "dim": 600}}})
    report = check_config(load_config({"policy": {"generation": {"backend": "hf", "lora_sync": "adapter"}}}))
    assert not report.problems and any("lora_sync: adapter applies with LoRA" in w for w in report.warnings)
    with pytest.raises(Exception, match="dropout_position 'post'"):
        load_config({"policy": {"dtensor_cfg": {"lora_cfg": {"enabled": True, "dropout": 0.1}}}})
