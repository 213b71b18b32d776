"""The training roles' states parked in host memory while colocated engines generate (distributed/parking.py):
the storages freed and brought back byte for byte, a parked policy training on as one never parked (one device,
FSDP2, tensor + sequence parallelism and CPU offload on 2 gloo ranks), the optimizer's state parked through the
passes until the optimizer step, and the roles' order around a weight sync (optimizer states before it, weights
after). A CPU host has no device memory to free: these tests park host storages too (park(..., host_too=True)), the
same copies and resizes; the one test on a GPU measures the device memory freed."""

from __future__ import annotations

import pytest
import torch

from novarl.distributed.parking import GROUPS, Parking, module_tensors, optimizer_tensors
from tests.helpers.packing import HEAD, measure, mixed_batch
from tests.helpers.spawn import send, spawned

BF16 = ["policy.precision=bfloat16", "policy.logprob_batch_size=4"]
LAYOUTS = {  # name: (overrides, whether the model is tiny-arith with two key/value heads, for tp 2)
    "dp2": ([], False),
    "dp2+offload": (["policy.dtensor_cfg.cpu_offload=true"], False),
    "tp2+sp": (["policy.dtensor_cfg.tensor_parallel_size=2", "policy.dtensor_cfg.sequence_parallel=true"], True),
}


def storage_bytes(tensors) -> int:
    """The bytes of the distinct storages behind `tensors` (a DTensor's local shard's)."""
    storages = {}
    for tensor in tensors:
        storage = getattr(tensor, "_local_tensor", tensor).untyped_storage()
        storages[storage.data_ptr() or id(storage)] = storage.nbytes()
    return sum(storages.values())


def own_storages(model: torch.nn.Module) -> None:
    """A plain module's tensors copied into storages of the allocator, as a device's are."""
    for tensor in module_tensors(model):
        if not hasattr(tensor, "_local_tensor"):
            tensor.data = tensor.data.clone()


def local(tensor: torch.Tensor) -> torch.Tensor:
    return getattr(tensor, "_local_tensor", tensor)


def test_parked_storages_are_freed_and_come_back_byte_for_byte():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(11, 8), torch.nn.Linear(8, 11, bias=False))
    model[1].weight = model[0].weight  # tied: one storage
    model.register_buffer("table", torch.arange(5.0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.tensor([1, 2, 3])).sum().backward()
    optimizer.step()
    model(torch.tensor([4])).sum().backward()  # a gradient left: freed without a copy, back as zeros
    before = {name: t.clone() for name, t in model.state_dict().items()}
    moments = [t.clone() for t in optimizer_tensors(optimizer)]
    parking = Parking()

    freed = {"optimizer": parking.park("optimizer", optimizer_tensors(optimizer), [model[0].weight.grad],
                                       host_too=True),
             "weights": parking.park("weights", module_tensors(model), host_too=True)}

    assert freed["weights"] == (11 * 8 + 5) * 4  # the tied weight once, the buffer
    assert freed["optimizer"] == (2 * 11 * 8 + 1) * 4 + 11 * 8 * 4  # moments, step; the gradient
    assert storage_bytes([*module_tensors(model), *optimizer_tensors(optimizer)]) == 0
    assert parking.park("weights", module_tensors(model), host_too=True) == 0  # parked once
    parking.wake("weights")
    assert parking.is_parked("optimizer") and not parking.is_parked("weights")
    assert all(torch.equal(model.state_dict()[name], t) for name, t in before.items())
    parking.wake()
    assert all(torch.equal(a, b) for a, b in zip(optimizer_tensors(optimizer), moments, strict=True))
    assert not model[0].weight.grad.any()
    assert parking.park("weights", module_tensors(model), host_too=True) > 0  # again, into the same host buffers
    parking.wake()
    assert all(torch.equal(model.state_dict()[name], t) for name, t in before.items())


def parked_against_plain(overrides: list[str], model_path: str, device: torch.device | None) -> dict:
    """Two policies on the same weights, one of them parked (both groups) after its first step: what was
    freed, what a pass woke, and both policies' second steps and weights."""
    from novarl.backends.training.dtensor import DTensorPolicy
    from novarl.config import load_config

    cfg = load_config(None, overrides=[*BF16, *overrides])
    plain = DTensorPolicy(cfg.policy, model_path, device, total_steps=3)
    parked = DTensorPolicy(cfg.policy, model_path, device, total_steps=3)
    host_too = device is None or device.type == "cpu"
    if host_too:  # a CPU model's weights may be the file's mapping, which no allocator resizes
        own_storages(parked.model)

    def call(policy):
        return lambda method, *args: getattr(policy, method)(*args)

    for policy in (plain, parked):
        measure(call(policy), mixed_batch(rows=6))
    states = [t for t in (*module_tensors(parked.model), *optimizer_tensors(parked.optimizer))
              if host_too or local(t).device.type != "cpu"]  # (AdamW's step counts: on the host)
    reserved = torch.cuda.memory_reserved() if torch.cuda.is_available() else 0
    freed = {group: parked.park(group, host_too) for group in GROUPS}
    released = reserved - (torch.cuda.memory_reserved() if torch.cuda.is_available() else 0)  # back to the driver
    emptied = storage_bytes(states) == 0
    parked.forward(mixed_batch(rows=6), HEAD)
    woke = [(parked.parking.is_parked("weights"), parked.parking.is_parked("optimizer"))]
    step = parked.optim_step

    def optim_step():  # what is still parked when the optimizer's step comes, after the step's passes
        woke.append((parked.parking.is_parked("weights"), parked.parking.is_parked("optimizer")))
        return step()

    parked.optim_step = optim_step
    second = [measure(call(policy), mixed_batch(rows=6, seed=1)) for policy in (plain, parked)]
    same = all(torch.equal(local(a), local(b))
               for a, b in zip(plain.model.parameters(), parked.model.parameters(), strict=True))
    return {"freed": freed, "released": released, "emptied": emptied, "woke": woke, "second": second,
            "same_weights": same}


def assert_trains_as_plain(found: dict) -> None:
    assert found["freed"]["weights"] > 0 and found["freed"]["optimizer"] > 0
    assert found["emptied"]
    assert found["woke"] == [(False, True)] * 2  # a pass needs the weights alone, the optimizer's step the rest
    plain, parked = found["second"]
    assert torch.equal(parked["logprobs"], plain["logprobs"])
    assert all(parked[name] == plain[name] for name in ("loss", "grad_norm", "kl_to_reference"))
    assert found["same_weights"]


def test_a_parked_policy_trains_on_as_one_never_parked_on_one_device():
    from novarl.distributed.local import ensure_single_process_group
    from novarl.models.loading import resolve_model_path

    ensure_single_process_group()
    assert_trains_as_plain(parked_against_plain([], str(resolve_model_path("tiny-arith")), torch.device("cpu")))


def layouts_rank(rank: int, world: int, rendezvous: str, results, models: dict[bool, str]) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
    send(results, rank, {name: parked_against_plain(["cluster.gpus_per_node=2", *overrides], models[two_kv],
                                                    torch.device("cpu"))
                         for name, (overrides, two_kv) in LAYOUTS.items()})


def test_a_parked_policy_trains_on_as_one_never_parked_on_two_ranks(tmp_path):
    from novarl.models.loading import resolve_model_path
    from tests.helpers.models import two_kv_head_copy

    models = {False: str(resolve_model_path("tiny-arith")), True: str(two_kv_head_copy(tmp_path / "kv2"))}
    for found in spawned(layouts_rank, 2, models):
        assert list(found) == list(LAYOUTS)
        for layout in found.values():
            assert_trains_as_plain(layout)


def deepspeed_parked_against_plain(stages: list[int]) -> None:
    """For each ZeRO stage, two DeepSpeed policies on the same weights, one parked after its first step (the
    weights, ZeRO-3's partitions among them, then everything else its optimizer holds): emptied, and its second
    step and weights the plain one's. At stage 3 also the frozen reference, whose engine's optimizer holds no
    partitions: its own are parked."""
    from novarl.backends.training.deepspeed import DeepSpeedPolicy, DeepSpeedReference, zero3_partitions
    from novarl.config import load_config
    from novarl.distributed.parking import held_tensors
    from novarl.models.loading import resolve_model_path

    for stage in stages:
        precision = "float32" if stage == 0 else "bfloat16"  # stage 0: the plain torch optimizer; else ZeRO's
        cfg = load_config(None, overrides=[*BF16, f"policy.precision={precision}", "policy.deepspeed_cfg.enabled=true",
                                           f"policy.deepspeed_cfg.zero_stage={stage}"])
        plain, parked = (DeepSpeedPolicy(cfg.policy, resolve_model_path("tiny-arith"), torch.device("cpu"),
                                         total_steps=3) for _ in range(2))
        if stage == 0:  # (above it, the weights are views of ZeRO's flat buffers already)
            own_storages(parked.engine.module)
        for policy in (plain, parked):
            measure(lambda method, *args: getattr(policy, method)(*args), mixed_batch(rows=6))
        assert parked.park("optimizer", True) > 0 and parked.park("weights", True) > 0, stage
        held = [t for t in (*held_tensors(parked.engine, parked.engine.optimizer),
                            *zero3_partitions(parked.engine.module))
                if not local(t).is_meta and local(t).untyped_storage().resizable()]  # (ZeRO keeps meta shapes)
        assert held and storage_bytes(held) == 0, stage
        second = [measure(lambda method, *args: getattr(policy, method)(*args), mixed_batch(rows=6, seed=1))
                  for policy in (plain, parked)]
        assert torch.equal(second[1]["logprobs"], second[0]["logprobs"]), stage
        assert all(second[1][name] == second[0][name] for name in ("loss", "grad_norm")), stage
        assert plain.full_state_dict().keys() == parked.full_state_dict().keys()
        assert all(torch.equal(a, b) for a, b in zip(plain.full_state_dict().values(),
                                                     parked.full_state_dict().values(), strict=True)), stage
        if stage == 3:
            reference = DeepSpeedReference(cfg.policy, resolve_model_path("tiny-arith"), torch.device("cpu"))
            before = reference.forward(mixed_batch(rows=6), HEAD)
            partitions = zero3_partitions(reference.engine.module)
            shards = storage_bytes(partitions)
            assert reference.park("weights", True) >= shards > 0 and storage_bytes(partitions) == 0
            assert torch.equal(reference.forward(mixed_batch(rows=6), HEAD), before)


def test_a_parked_deepspeed_policy_trains_on_as_one_never_parked():
    """ZeRO stages 0 (float32: the torch optimizer), 2 and 3 (bf16: ZeRO's flat buffers and partitions), in a
    process of their own (DeepSpeed keeps process-wide state)."""
    pytest.importorskip("deepspeed")
    from tests.helpers.spawn import in_a_fresh_process

    in_a_fresh_process(deepspeed_parked_against_plain, [0, 2, 3])


def test_roles_park_the_optimizer_before_a_weight_sync_and_the_weights_after(tmp_path, monkeypatch):
    """In-process roles beside an engine of their own: the sync reads the weights (not parked yet), the
    optimizer's state waits on the host meanwhile; after it both wait, a checkpoint wakes them and the
    trainer parks them again."""
    from novarl.backends.generation.engines import LocalGeneration
    from novarl.backends.generation.hf import HFGeneration
    from novarl.backends.training.dtensor import DTensorPolicy
    from novarl.config import load_config
    from novarl.distributed.local import ensure_single_process_group
    from novarl.models.loading import load_tokenizer, resolve_model_path
    from novarl.distributed.parking import PARK_ON_CPU_VARIABLE
    from novarl.trainer.setup import Roles

    ensure_single_process_group()
    monkeypatch.setenv(PARK_ON_CPU_VARIABLE, "1")
    path = resolve_model_path("tiny-arith")
    cfg = load_config(None, overrides=BF16)
    policy = DTensorPolicy(cfg.policy, str(path), torch.device("cpu"), total_steps=3)
    own_storages(policy.model)
    engine = HFGeneration(path, load_tokenizer(path), torch.device("cpu"), precision="float32")
    seen = []
    update = engine.update_weights

    def update_weights(weights, version):  # what was parked while the engine took the weights
        seen.append((policy.parking.is_parked("optimizer"), policy.parking.is_parked("weights")))
        update(weights, version)

    engine.update_weights = update_weights
    roles = Roles(policy, None, LocalGeneration(engine, policy), parks=True)
    measure(lambda method, *args: getattr(policy, method)(*args), mixed_batch(rows=6))
    states = storage_bytes([*module_tensors(policy.model), *optimizer_tensors(policy.optimizer)])

    metrics = roles.sync_weights(1)

    assert seen == [(True, False)]
    assert metrics["offloaded_gb"] * 1e9 == pytest.approx(states)
    assert policy.parking.is_parked("optimizer") and policy.parking.is_parked("weights")
    engine_weights = dict(engine.model.named_parameters())
    policy.save(tmp_path / "checkpoint")  # wakes both
    assert not policy.parking.parked
    assert all(torch.equal(engine_weights[name], param) for name, param in policy.model.named_parameters())
    roles.park_training()
    assert policy.parking.is_parked("optimizer") and policy.parking.is_parked("weights")
    assert Roles(policy, None, LocalGeneration(engine, policy)).sync_weights(2).keys() == {"weight_sync_mb"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_parking_frees_the_gpu_memory_of_a_policy_and_it_trains_on():
    """On the GPU: the bytes parked go back to the driver (torch's cache emptied: where a colocated engine
    allocates), and the parked policy's next step equals a plain one's."""
    from novarl.distributed.local import ensure_single_process_group
    from novarl.models.loading import resolve_model_path

    ensure_single_process_group()
    found = parked_against_plain([], str(resolve_model_path("tiny-arith")), torch.device("cuda"))
    assert_trains_as_plain(found)
    assert found["released"] >= 0.9 * sum(found["freed"].values())


# ---------------------------------------------------------------- the trainer's flow, parked
FLOW = ["logger.progress_bar=false", "grpo.max_train_seconds=null", "grpo.val_at_start=true", "grpo.val_at_end=false",
        "grpo.val_period=2", "grpo.max_val_samples=8", "checkpointing.enabled=true", "checkpointing.save_period=2",
        "checkpointing.keep_top_k=10", "loss_fn.reference_policy_kl_penalty=0.05"]
VARIANTS = {  # name: (overrides, steps)
    "sync with KL": ([], 3),
    "asynchronous": (["grpo.async_grpo.enabled=true", "loss_fn.use_importance_sampling_correction=true"], 3),
    "PPO with a warm-up": (["grpo.adv_estimator.name=gae", "value={}", "grpo.policy_training_start_step=1"], 3),
}
NOT_COMPARED = ("offloaded_gb",)


def flow_run(folder, extra: list[str], steps: int, parked: bool, monkeypatch, *, resume: bool = False) -> dict:
    """A run of the bundled recipe (its engine in this process), its roles parked between weight syncs and
    generations (PARK_ON_CPU_VARIABLE) or never; its train records by step (a resumed run's own). (On this CPU
    host the one-device policy's and critic's weights that are the model file's mapping stay: no allocator
    resizes those. Their optimizer states, the reference and the critic's new head park; parked weights are the
    tests above's.)"""
    from novarl.config import load_config
    from novarl.distributed.parking import PARK_ON_CPU_VARIABLE
    from novarl.cli import BUNDLED_RECIPE
    from novarl.trainer.api import GRPOTrainer
    from tests.helpers import HF, train_steps

    if parked:
        monkeypatch.setenv(PARK_ON_CPU_VARIABLE, "1")
    else:
        monkeypatch.delenv(PARK_ON_CPU_VARIABLE, raising=False)
    cfg = load_config(BUNDLED_RECIPE, overrides=[
        f"logger.log_dir={folder / 'logs'}", f"checkpointing.checkpoint_dir={folder / 'ckpt'}",
        f"grpo.max_num_steps={steps}", *FLOW, HF, *extra])
    return train_steps(GRPOTrainer(cfg).train().output_dir)


def assert_same_run(parked: dict, plain: dict) -> None:
    assert parked.keys() == plain.keys()
    for step, record in plain.items():
        for name, value in record.items():
            if not name.startswith("time_") and name not in NOT_COMPARED:
                assert parked[step][name] == value, (step, name)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_parked_run_trains_as_the_never_parked_one(tmp_path, monkeypatch, variant):
    """The trainer's flow with the roles parked while its engine generates: evaluations, checkpoints (which wake
    the states and park them again), the KL reference, asynchronous GRPO's queued weights, PPO's critic and its
    warm-up (no weight sync: the roles park all the same); the metrics the never-parked run's, bit for bit, and
    each sync parked something. A resume from step 2, parked, trains step 3 as the uninterrupted run did."""
    extra, steps = VARIANTS[variant]
    plain = flow_run(tmp_path / "plain", extra, steps, False, monkeypatch)
    parked = flow_run(tmp_path / "parked", extra, steps, True, monkeypatch)
    assert_same_run(parked, plain)
    synced = [record for record in parked.values() if "weight_sync_mb" in record]
    assert synced and all(record["offloaded_gb"] > 0 for record in synced)
    assert not any("offloaded_gb" in record for record in plain.values())
    if variant == "sync with KL":
        import shutil

        shutil.rmtree(tmp_path / "parked" / "ckpt" / "step_3", ignore_errors=True)
        resumed = flow_run(tmp_path / "parked", extra, steps, True, monkeypatch)
        assert list(resumed) == [3]
        assert_same_run(resumed, {3: plain[3]})
