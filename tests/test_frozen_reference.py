"""The KL reference on the DTensor backend holds its weights in the compute dtype (dtensor.py model_weights):
in bf16 half the bytes of the policy's float32 masters, and the same logprobs as the policy before its first
update, bit for bit, on one device and under FSDP2, tensor and sequence parallelism and CPU offload (2 gloo
ranks). DeepSpeed's reference computes as its policy too."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.spawn import send, spawned

BF16 = ["policy.precision=bfloat16", "policy.logprob_batch_size=4"]
LAYOUTS = {  # name: (overrides, whether the model is tiny-arith with two key/value heads, for tp 2)
    "dp2": ([], False),
    "dp2+offload": (["policy.dtensor_cfg.cpu_offload=true"], False),
    "tp2": (["policy.dtensor_cfg.tensor_parallel_size=2"], True),
    "tp2+sp": (["policy.dtensor_cfg.tensor_parallel_size=2", "policy.dtensor_cfg.sequence_parallel=true"], True),
}


def local_bytes(model: torch.nn.Module) -> tuple[set[torch.dtype], int]:
    """(the dtypes of this rank's parameters, their bytes), a DTensor's local shard counted."""
    tensors = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    return {t.dtype for t in tensors}, sum(t.numel() * t.element_size() for t in tensors)


def policy_and_reference(overrides: list[str], model_path: str, device: torch.device | None) -> dict:
    """A bf16 policy and its reference on the same weights, on `device` (None: the process's GPU if it has
    one): whether their logprobs of one batch are equal, and each one's parameter dtypes and bytes on this
    rank."""
    from novarl.backends.training.dtensor import DTensorPolicy, DTensorReference
    from novarl.config import load_config
    from tests.helpers.packing import HEAD, mixed_batch

    cfg = load_config(None, overrides=[*BF16, *overrides])
    policy = DTensorPolicy(cfg.policy, model_path, device, total_steps=2)
    reference = DTensorReference(cfg.policy, model_path, device)
    batch = mixed_batch(rows=6)
    return {"equal": torch.equal(policy.forward(batch, HEAD), reference.forward(batch, HEAD)),
            "policy": local_bytes(policy.model), "reference": local_bytes(reference.model)}


def layouts_rank(rank: int, world: int, rendezvous: str, results, models: dict[bool, str]) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
    send(results, rank, {name: policy_and_reference(["cluster.gpus_per_node=2", *overrides], models[two_kv],
                                                    torch.device("cpu"))
                         for name, (overrides, two_kv) in LAYOUTS.items()})


def assert_half_in_bf16(found: dict) -> None:
    """The same logprobs, the policy's masters float32, the reference's weights bf16 and half their bytes."""
    assert found["equal"]
    (policy_dtypes, policy_bytes), (reference_dtypes, reference_bytes) = found["policy"], found["reference"]
    assert policy_dtypes == {torch.float32} and reference_dtypes == {torch.bfloat16}
    assert reference_bytes * 2 == policy_bytes


def test_the_reference_holds_bf16_weights_and_the_policys_logprobs_on_one_device():
    """(On the process's GPU where it has one: compiled layers, cuBLAS.)"""
    from novarl.distributed.local import ensure_single_process_group
    from novarl.models.loading import resolve_model_path

    ensure_single_process_group()
    assert_half_in_bf16(policy_and_reference([], str(resolve_model_path("tiny-arith")), None))


def test_the_reference_holds_bf16_weights_and_the_policys_logprobs_on_two_ranks(tmp_path):
    from novarl.models.loading import resolve_model_path
    from tests.helpers.models import two_kv_head_copy

    models = {False: str(resolve_model_path("tiny-arith")), True: str(two_kv_head_copy(tmp_path / "kv2"))}
    for found in spawned(layouts_rank, 2, models):
        assert list(found) == list(LAYOUTS)
        for layout in found.values():
            assert_half_in_bf16(layout)


def deepspeeds_reference_computes_as_its_policy(stage: int) -> None:
    from novarl.backends.training.deepspeed import DeepSpeedPolicy, DeepSpeedReference
    from novarl.config import load_config
    from novarl.models.loading import resolve_model_path
    from tests.helpers.packing import HEAD, mixed_batch

    cfg = load_config(None, overrides=[*BF16, "policy.deepspeed_cfg.enabled=true",
                                       f"policy.deepspeed_cfg.zero_stage={stage}"])
    path = resolve_model_path("tiny-arith")
    policy = DeepSpeedPolicy(cfg.policy, path, None, total_steps=2)  # (a CUDA host's GPU)
    reference = DeepSpeedReference(cfg.policy, path, None)
    batch = mixed_batch(rows=6)
    assert torch.equal(policy.forward(batch, HEAD), reference.forward(batch, HEAD))
    frozen = reference.engine.module if reference.engine is not None else reference.model
    assert (reference.engine is None) is (stage < 3)
    assert {p.dtype for p in frozen.parameters()} == {torch.bfloat16}
    assert {b.dtype for b in frozen.buffers()} == {b.dtype for b in policy.engine.module.buffers()} == {torch.float32}


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeeds_reference_computes_as_its_policy_in_bf16(stage):
    """DeepSpeed's reference (below ZeRO-3 a frozen copy without an engine, at 3 an engine of its own) holds the
    engine's bf16 weights and its float32 rotary tables: the policy's logprobs before its first update, bit for
    bit. (The frozen copy cast its buffers to bf16 too: on tiny-arith its logprobs were up to 0.11 off the
    policy's, a KL penalty that did not start at 0.) In a process of its own, away from what the worker's
    earlier tests left process-wide."""
    pytest.importorskip("deepspeed")
    from tests.helpers.spawn import in_a_fresh_process

    in_a_fresh_process(deepspeeds_reference_computes_as_its_policy, stage,
                       backend="nccl" if torch.cuda.is_available() else "gloo")
