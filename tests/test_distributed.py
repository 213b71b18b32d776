"""Several ranks: FSDP2 over 2 Ray actors (gloo), parity with one rank, faults."""

import os
import signal
from pathlib import Path

import pytest

from novarl.cli import BUNDLED_RECIPE
from novarl.config import load_config
from novarl.errors import UserError
from novarl.logging.metrics import read_jsonl
from novarl.trainer.api import GRPOTrainer

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]  # tests/conftest.py
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# Rank actors import test helpers (custom parallel plans) by name.
REPO = str(Path(__file__).parents[1])
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))


FSDP2X2_RECIPE = Path(__file__).parents[1] / "examples" / "configs" / "grpo_tiny_fsdp2x2.yaml"


def run(tmp_path, *overrides, recipe=BUNDLED_RECIPE):
    cfg = load_config(recipe, overrides=[
        f"logger.log_dir={tmp_path}", "logger.progress_bar=false", "grpo.max_train_seconds=null",
        "grpo.max_num_steps=4", "grpo.val_at_start=false", "grpo.val_at_end=false", "policy.train_micro_batch_size=128",
        *overrides])
    result = GRPOTrainer(cfg).train()
    return result, [r for r in read_jsonl(result.output_dir / "metrics.jsonl") if r["kind"] == "train"]


def test_fsdp2_on_two_ranks_matches_one_rank(tmp_path, monkeypatch):
    """The shipped 2-rank recipe, through Ray, against the same recipe on one in-process rank;
    with a KL penalty, so the frozen reference runs beside the policy on its 2 rank processes.
    The 2 ranks' policy and reference wait in host memory while their engines generate
    (distributed/parking.py, parked on this CPU host as on a GPU's: tests/test_parking.py), the
    checkpoints and the export waking them: the numbers are the same."""
    import torch

    from novarl.distributed.parking import PARK_ON_CPU_VARIABLE

    ckpt = f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}"
    kl = "loss_fn.reference_policy_kl_penalty=0.05"
    _, single = run(tmp_path / "one", "cluster.gpus_per_node=1", ckpt, kl, recipe=FSDP2X2_RECIPE)
    monkeypatch.setenv(PARK_ON_CPU_VARIABLE, "1")
    result, double = run(tmp_path / "two", ckpt + "2", kl, recipe=FSDP2X2_RECIPE)
    assert all(record["offloaded_gb"] > 0 for record in double) and "offloaded_gb" not in single[0]
    assert double[-1]["kl_to_reference"] > 0  # the policy has moved away from the reference
    assert len(single) == len(double) == 4
    for one, two in zip(single, double):
        # Same samples (same seeded generator weights), so the same loss and gradients,
        # up to the order of floating-point sums across ranks.
        assert two["reward_mean"] == one["reward_mean"]
        assert two["loss"] == pytest.approx(one["loss"], abs=1e-6)
        assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4)
        assert two["logprob_mismatch"] < 1e-3
        assert two["kl_to_reference"] == pytest.approx(one["kl_to_reference"], rel=1e-3, abs=1e-9)
    from transformers import AutoModelForCausalLM

    final = AutoModelForCausalLM.from_pretrained(result.model_dir).state_dict()
    assert sum(t.numel() for k, t in final.items() if k != "lm_head.weight") == 297_984
    # The 2-rank checkpoint, resharded onto one rank by `novarl convert`, holds the same weights.
    from novarl.cli import main

    assert main(["convert", str(tmp_path / "ckpt2" / "step_4"), str(tmp_path / "hf")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    assert all(torch.equal(exported[k], final[k]) for k in final)


def test_more_ranks_than_the_cluster_has_is_refused(tmp_path):
    with pytest.raises(UserError, match=r"needs 4 CPU \(4 policy rank\(s\) x 1 CPU\), but the Ray cluster has 2 in all"):
        run(tmp_path, "cluster.gpus_per_node=4", "grpo.num_prompts_per_step=64")
    # dedicated engines count too, and nothing starts: 1 policy rank + 2 engines on 2 CPUs
    with pytest.raises(UserError, match=r"needs 3 CPU \(1 policy rank\(s\) x 1 CPU \+ 2 generation engine\(s\) "
                                        r"x 1 CPU\), but the Ray cluster has 2"):
        run(tmp_path / "dedicated", "cluster.gpus_per_node=3", "policy.generation.colocated.enabled=false",
            "policy.generation.colocated.resources.gpus_per_node=2")
    assert not list(tmp_path.glob("**/metrics.jsonl"))  # the run folders were removed


def test_a_killed_rank_stops_the_call_and_names_it(tmp_path):
    import ray
    import torch

    from novarl.backends.training.dtensor import DTensorPolicy
    from novarl.distributed.ray_group import RayWorkerGroup, WorkerDied
    from novarl.models.loading import resolve_model_path
    from novarl.models.scores import Logprobs
    from novarl.types import TrainBatch

    cfg = load_config(BUNDLED_RECIPE)
    group = RayWorkerGroup(DTensorPolicy, dict(policy=cfg.policy, model_path=resolve_model_path("tiny-arith"),
                                               total_steps=10), world_size=2)
    pid = ray.get(group.actors[1].pid.remote())
    os.kill(pid, signal.SIGKILL)
    ones = torch.ones((4, 6), dtype=torch.bool)
    batch = TrainBatch.from_rows(torch.ones((4, 6), dtype=torch.long), ones, ones, torch.zeros(4))
    with pytest.raises(WorkerDied, match="policy rank 1 died"):
        group.call("forward", batch, Logprobs())
    assert group.actors == []
    import time

    deadline = time.monotonic() + 30  # Ray frees the placement group asynchronously
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == 2


def test_roles_on_ray_ranks_park_and_wake_on_their_ranks():
    """RemotePolicy and RemoteReference park on every rank (tests/test_parking.py parks host storages on a CPU
    host, as here); a forward wakes them with the same weights."""
    import torch

    from novarl.backends.remote import RemotePolicy, RemoteReference
    from novarl.backends.training.dtensor import DTensorPolicy, DTensorReference
    from novarl.distributed.ray_group import RayWorkerGroup
    from novarl.models.loading import resolve_model_path
    from novarl.models.scores import Logprobs
    from tests.helpers.packing import mixed_batch

    cfg = load_config(BUNDLED_RECIPE, overrides=["cluster.gpus_per_node=2"])
    path = resolve_model_path("tiny-arith")
    group = RayWorkerGroup(DTensorPolicy, dict(policy=cfg.policy, model_path=path, total_steps=10), world_size=2)
    try:
        group.add_role(RemoteReference.ROLE, DTensorReference, dict(policy=cfg.policy, model_path=path))
        policy, reference = RemotePolicy(group), RemoteReference(group)
        batch = mixed_batch(rows=4)
        before = policy.forward(batch, Logprobs()), reference.forward(batch, Logprobs())
        assert all(freed > 0 for freed in group.call_all_actors("park_role", None, "weights", True))  # every rank's
        assert reference.park("weights", True) > 0 and policy.park("weights", True) == 0  # (parked once)
        assert policy.park("optimizer", True) == 0  # no optimizer step yet: no state
        assert all(torch.equal(a, b) for a, b in zip(before, (policy.forward(batch, Logprobs()),
                                                              reference.forward(batch, Logprobs()))))
    finally:
        group.shutdown()


def test_kept_ranks_serve_the_next_group_of_their_shape_only(monkeypatch):
    """NOVARL_REUSE_RANKS (on in this suite): a group's rank processes serve the next group of the
    same shape, rank for rank, unless a role they hosted is not process_reusable; a group of
    another shape stops the kept ones, whose CPUs it may need."""
    import psutil

    from novarl.distributed import kept_ranks
    from novarl.distributed.ray_group import RayWorkerGroup
    from tests.helpers.roles import Kept, NotKept

    monkeypatch.setenv("NOVARL_REUSE_RANKS", "1")
    kept_ranks.drop_kept_ranks()
    group = RayWorkerGroup(Kept, {"tag": 1}, world_size=2)
    first = group.call_all("pid")
    group.shutdown()
    group = RayWorkerGroup(Kept, {"tag": 2}, world_size=2)
    assert group.call_all("pid") == first and group.call_all("tagged") == [2, 2]  # a new role, same processes
    group.add_role("other", NotKept, {"tag": 3})
    group.shutdown()
    assert not kept_ranks._KEPT  # a role that is not reusable: its processes ended
    group = RayWorkerGroup(Kept, {"tag": 4}, world_size=1)
    (alone,) = group.call_all("pid")
    assert alone not in first
    group.shutdown()
    group = RayWorkerGroup(Kept, {"tag": 5}, world_size=2)  # another shape: the kept rank stops, a new pair starts
    assert alone not in group.call_all("pid") and not set(group.call_all("pid")) & set(first)
    group.shutdown()
    kept_ranks.drop_kept_ranks()
    assert psutil.wait_procs([psutil.Process(alone)] if psutil.pid_exists(alone) else [], timeout=30)[1] == []


@pytest.fixture(scope="module")
def one_rank_run(tmp_path_factory, two_kv_head_model):
    """The one-rank run the tensor-parallel layouts (and custom plans) are held against, made once."""
    return run(tmp_path_factory.mktemp("one"), f"policy.model_name={two_kv_head_model}", "grpo.max_num_steps=3")[1]


@pytest.fixture(scope="module")
def two_kv_head_model(tmp_path_factory):
    """tiny-arith with its one KV head duplicated: the same function, but 2 KV heads to split over TP=2."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from novarl.models.loading import resolve_model_path
    from tests.helpers.models import two_kv_head_copy

    source = resolve_model_path("tiny-arith")
    out = two_kv_head_copy(tmp_path_factory.mktemp("mha"))
    ids = AutoTokenizer.from_pretrained(source)(["37+58="], return_tensors="pt").input_ids
    original, widened = AutoModelForCausalLM.from_pretrained(source), AutoModelForCausalLM.from_pretrained(out)
    assert torch.allclose(original(ids).logits, widened(ids).logits, atol=1e-5)
    return out


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_tensor_parallel_on_two_ranks_matches_one_rank(tmp_path, two_kv_head_model, one_rank_run, sequence_parallel):
    """(Context parallelism: tests/test_context_parallel.py.)"""
    model = f"policy.model_name={two_kv_head_model}"
    single = one_rank_run
    _, tp = run(tmp_path / "tp", model, "grpo.max_num_steps=3", "cluster.gpus_per_node=2",
                "policy.dtensor_cfg.tensor_parallel_size=2",
                f"policy.dtensor_cfg.sequence_parallel={str(sequence_parallel).lower()}")
    for one, two in zip(single, tp, strict=True):
        assert two["reward_mean"] == one["reward_mean"]
        assert two["loss"] == pytest.approx(one["loss"], abs=1e-6)
        assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4)


def test_world_size_must_be_dp_tp_cp():
    from novarl.errors import ConfigError
    from novarl.backends.contract.resolve import plan_batches

    cfg = load_config(BUNDLED_RECIPE, overrides=["cluster.gpus_per_node=3", "policy.dtensor_cfg.tensor_parallel_size=2"])
    with pytest.raises(ConfigError, match=r"3 x 1 = 3 ranks is not a multiple of .* 2 x 1 = 2"):
        plan_batches(cfg)


@pytest.mark.parametrize("plan", ["tests.helpers.plans:MLP_ONLY", "tests.helpers.plans:attention_only"])
def test_custom_parallel_plan_matches_one_rank(tmp_path, two_kv_head_model, one_rank_run, plan):
    model = f"policy.model_name={two_kv_head_model}"
    _, tp = run(tmp_path / "tp", model, "grpo.max_num_steps=3", "cluster.gpus_per_node=2",
                "policy.dtensor_cfg.tensor_parallel_size=2", f"policy.dtensor_cfg.custom_parallel_plan={plan}")
    for one, two in zip(one_rank_run, tp, strict=True):
        assert two["loss"] == pytest.approx(one["loss"], abs=1e-6)
        assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4)


def test_custom_parallel_plan_errors_name_the_key():
    from novarl.backends.training.parallelize import load_custom_plan

    with pytest.raises(UserError, match="custom_parallel_plan='tests.helpers.plans:nope' cannot be imported"):
        load_custom_plan("tests.helpers.plans:nope")
    with pytest.raises(UserError, match="is a list"):
        load_custom_plan("tests.helpers.plans:CALLS")


def test_a_sequence_parallel_custom_plan_must_return_the_split_sequence():
    """Under sequence_parallel a dict plan's layers return the residual stream split along the sequence (novarl
    adds the split after the embeddings and the gather before the head); one whose layers return it whole is
    refused, naming the plan (it failed in the first layer's rotary embedding, 80 positions against 40)."""
    from novarl.backends.training.parallelize import (LLAMA_LAYER_PLAN, LLAMA_LAYER_PLAN_SP,
                                                      check_returns_split_sequence)
    from tests.helpers.plans import SP_PLAIN_NORMS

    from torch.distributed.tensor.parallel import RowwiseParallel

    half = {**LLAMA_LAYER_PLAN_SP, "mlp.down_proj": RowwiseParallel()}  # the MLP would return the whole sequence
    for plan in (LLAMA_LAYER_PLAN, half):
        with pytest.raises(UserError, match=r"custom_parallel_plan='my.plans:TP' with sequence_parallel: true"):
            check_returns_split_sequence(plan, "my.plans:TP")
    for plan in (LLAMA_LAYER_PLAN_SP, SP_PLAIN_NORMS):
        check_returns_split_sequence(plan, "my.plans:SP")


def norm_steps(model: str, world: int, *overrides: str) -> dict:
    """Two training steps of a DTensor policy with tensor_parallel_size=world: losses, and the decoder layers'
    norms' weights after them (whole)."""
    import torch

    from novarl.backends.training.dtensor import DTensorPolicy
    from tests.helpers.packing import measure, mixed_batch

    torch.set_num_threads(1)
    cfg = load_config(None, overrides=[
        f"cluster.gpus_per_node={world}", f"policy.dtensor_cfg.tensor_parallel_size={world}",
        "policy.train_micro_batch_size=3", "policy.logprob_batch_size=4", "policy.scheduler=[]",
        "policy.optimizer.kwargs={lr: 0.05}", *overrides])
    policy = DTensorPolicy(cfg.policy, model, torch.device("cpu"), total_steps=4)
    call = lambda method, *args: getattr(policy, method)(*args)  # noqa: E731
    losses = [measure(call, mixed_batch(rows=6, seed=seed))["loss"] for seed in range(2)]
    norms = {name: (param.full_tensor() if hasattr(param, "full_tensor") else param).detach().clone()
             for name, param in policy.model.named_parameters() if ".layers." in name and "norm" in name}
    return {"losses": losses, "norms": norms}


def norms_rank(rank: int, world: int, rendezvous: str, results, models: dict[str, str]) -> None:
    import torch.distributed as dist

    from tests.helpers.spawn import send

    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
    send(results, rank, {(kind, plan): norm_steps(models[kind], world, *overrides)
                         for kind, plan, overrides in NORM_CASES})


SP = "policy.dtensor_cfg.sequence_parallel=true"
TORCH_PLAN = "policy.dtensor_cfg.custom_parallel_plan=novarl.backends.training.parallelize:LLAMA_LAYER_PLAN"
NORM_CASES = [("qwen3", "default", []), ("qwen3", "torch styles", [TORCH_PLAN]),
              ("qwen3", "torch styles, sequence parallel", [f"{TORCH_PLAN}_SP", SP]),
              ("qwen3", "torch styles, sequence parallel, plain norms",
               ["policy.dtensor_cfg.custom_parallel_plan=tests.helpers.plans:SP_PLAIN_NORMS", SP]),
              ("gemma2", "default, sequence parallel", [SP]),
              ("gemma2", "torch styles, sequence parallel, plain norms",
               ["policy.dtensor_cfg.custom_parallel_plan=tests.helpers.plans:SP_PLAIN_NORMS", SP])]
"""(model, plan, overrides): Qwen3's query/key norms see a rank's heads; under sequence parallelism every norm
outside the attention and the MLP sees a rank's tokens (Gemma 2 has four a layer)."""


def test_tensor_parallel_norms_train_as_on_one_rank(tmp_path):
    """Norms whose weights are whole on every tensor-parallel rank but see a rank's share train as on one rank:
    their gradients are summed over the ranks (parallelize.partial_parameters, sum_partial_gradients), under
    the default plans and custom plans of torch's styles. Qwen3's query/key norms see a rank's heads: without
    the sum each rank stepped them with its heads' share, the ranks' weights parted (by ~0.1 after two steps)
    and the second loss was off one rank's (0.6448 vs 0.6432). Under sequence parallelism every norm outside
    the attention and the MLP sees a rank's tokens: Gemma 2's pre- and post-feedforward norms were left out of
    the sum (second loss 0.4600 vs 0.4632, the ranks' weights 0.19 apart)."""
    import torch

    from novarl.distributed.local import ensure_single_process_group
    from tests.helpers.models import tiny_gemma2, tiny_qwen3
    from tests.helpers.spawn import spawned

    models = {"qwen3": str(tiny_qwen3(tmp_path / "qwen3")), "gemma2": str(tiny_gemma2(tmp_path / "gemma2"))}
    ranks = spawned(norms_rank, 2, models)
    ensure_single_process_group()
    alone = {kind: norm_steps(model, 1) for kind, model in models.items()}
    for (kind, plan), got in ((case, got) for rank in ranks for case, got in rank.items()):
        want = alone[kind]
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-5), (kind, plan)
        assert got["norms"].keys() == want["norms"].keys() and len(got["norms"]) == {"qwen3": 8, "gemma2": 8}[kind]
        for name, weight in want["norms"].items():
            # (Adam's step of a gradient near 0 magnifies rounding: one of Gemma 2's values came 1.03e-4 off; a
            # share left unsummed parts them by ~0.1)
            torch.testing.assert_close(got["norms"][name], weight, rtol=1e-5, atol=1e-3,
                                       msg=lambda text: f"{kind}, {plan}, {name}: {text}")


def sp_resume_steps(model: str, folder: str) -> dict:
    """Under tp 2 + sequence parallelism: a policy split by torch's DTensor styles (as novarl split the default
    plans before local_tp.py: tests/helpers/plans.torch_styles_sp), one step, its checkpoint, a second step; then
    a policy on the default plan (local tensors) loads that checkpoint and takes the same second step."""
    import torch
    from torch.distributed.tensor import DTensor

    from novarl.backends.training.dtensor import DTensorPolicy
    from tests.helpers.packing import measure, mixed_batch

    torch.set_num_threads(1)
    overrides = ["cluster.gpus_per_node=2", "policy.dtensor_cfg.tensor_parallel_size=2",
                 "policy.dtensor_cfg.sequence_parallel=true", "policy.train_micro_batch_size=3",
                 "policy.logprob_batch_size=4", "policy.scheduler=[]", "policy.optimizer.kwargs={lr: 0.05}"]
    earlier = "policy.dtensor_cfg.custom_parallel_plan=tests.helpers.plans:torch_styles_sp"
    before, after = (DTensorPolicy(load_config(None, overrides=[*overrides, *plan]).policy, model,
                                   torch.device("cpu"), total_steps=4) for plan in ([earlier], []))
    norm = "model.layers.0.input_layernorm.weight"
    weights = [dict(policy.model.named_parameters())[norm] for policy in (before, after)]
    kinds = [weight.device_mesh.mesh_dim_names if isinstance(weight, DTensor) else () for weight in weights]
    calls = [lambda method, *args, policy=policy: getattr(policy, method)(*args) for policy in (before, after)]
    first = measure(calls[0], mixed_batch(rows=6, seed=0))["loss"]
    before.save(Path(folder))
    went_on = measure(calls[0], mixed_batch(rows=6, seed=1))["loss"]
    after.load(Path(folder))
    resumed = measure(calls[1], mixed_batch(rows=6, seed=1))["loss"]
    return {"kinds": kinds, "first": first, "went_on": went_on, "resumed": resumed}


def sp_resume_rank(rank: int, world: int, rendezvous: str, results, model: str, folder: str) -> None:
    import torch.distributed as dist

    from tests.helpers.spawn import send

    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
    send(results, rank, sp_resume_steps(model, folder))


def test_a_sequence_parallel_checkpoint_of_torch_styles_resumes_on_local_tensors(tmp_path, two_kv_head_model):
    """A checkpoint written while sequence parallelism ran on torch's styles (the norms' weights and their Adam
    moments tp-Replicate DTensors: novarl before local_tp.py) resumes under the default plan on local tensors
    (plain tensors): the resumed step's loss equals the one the writer took after saving."""
    from tests.helpers.spawn import spawned

    for got in spawned(sp_resume_rank, 2, str(two_kv_head_model), str(tmp_path / "ckpt")):
        assert got["kinds"] == [("dp", "tp"), ("dp",)]  # a norm's weight: a tp-Replicate DTensor, then not
        assert got["went_on"] != got["first"]
        assert got["resumed"] == pytest.approx(got["went_on"], rel=1e-5)


def test_a_query_norm_over_every_head_is_refused_under_the_default_tensor_parallel_plan():
    """OLMo 2's query/key norms span all the heads' outputs, which the default plan splits by heads: refused,
    naming it (it failed with a shape error inside the first forward); Qwen3's are one head's and split."""
    from transformers import AutoModelForCausalLM, Olmo2Config, Qwen3Config

    from novarl.backends.training.parallelize import check_splittable

    shape = dict(vocab_size=19, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)
    olmo2 = AutoModelForCausalLM.from_config(Olmo2Config(**shape))
    with pytest.raises(UserError, match=r"this olmo2 model: its self_attn.q_norm normalises all the heads' outputs "
                                        r"together \(64 values, heads of 16\)"):
        check_splittable(olmo2, 2, default_plan=True)
    check_splittable(olmo2, 2, default_plan=False)  # a custom plan places the layers as it says
    check_splittable(AutoModelForCausalLM.from_config(Qwen3Config(head_dim=16, **shape)), 2, default_plan=True)
    with pytest.raises(UserError, match="must divide the model's num_key_value_heads=2"):
        check_splittable(olmo2, 4, default_plan=True)
