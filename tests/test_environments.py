"""An environment of the user's plays a run's episodes (issue 33): named in env.<name>.actor_class_fqn,
several turns a sample (grpo.max_rollout_turns), its rewards the training rewards; what is wrong
with it is said before the run starts."""

from __future__ import annotations

import math

import pytest
import torch

from novarl.cli import BUNDLED_RECIPE
from novarl.config import load_config
from novarl.errors import ConfigError, UserError
from novarl.logging.metrics import read_jsonl
from novarl.trainer.api import GRPOTrainer

ENV = ["env.again.actor_class_fqn=tests.helpers.environments:AskAgain", "env.again.cfg={turns: 2}",
       "policy.max_seq_length=32"]  # room for a second turn after the first and " again:"
QUICK = ["logger.progress_bar=false", "grpo.max_train_seconds=null", "grpo.val_at_start=false",
         "grpo.val_period=0", "grpo.max_num_steps=2", "grpo.max_val_samples=8"]


def test_a_run_trains_on_two_turn_episodes(tmp_path):
    import json

    cfg = load_config(BUNDLED_RECIPE, overrides=[*ENV, *QUICK, "grpo.max_rollout_turns=2",
                                                 "logger.num_val_samples_to_print=2", f"logger.log_dir={tmp_path}"])
    result = GRPOTrainer(cfg).train()
    records = list(read_jsonl(result.output_dir / "metrics.jsonl"))
    steps = [r for r in records if r["kind"] == "train"]
    assert len(steps) == 2
    for step in steps:
        assert step["episode_turns_mean"] == 2.0 and step["observation_tokens_mean"] > 0
        assert step["environment_seconds"] > 0 and 0 < step["sampled_tokens_per_turn_mean"] <= 16
        assert math.isfinite(step["loss"]) and step["logprob_mismatch"] < 0.05  # trained on what was sampled
        assert 0.1 <= step["reward_mean"] <= 1.1  # 0.1 for the first turn, 0 or 1 for the second
    evaluation = [r for r in records if r["kind"] == "eval"][-1]  # greedy episodes, rewarded by the environment
    assert evaluation["episode_turns_mean"] == 2.0 and evaluation["num_samples"] == 8
    written = [json.loads(line) for line in (result.output_dir / "samples" / "eval_step_2.jsonl").open()]
    assert len(written) == 2  # the evaluation's first samples, whole: the prompt, turn, observation, turn
    assert [p["role"] for p in written[0]["parts"]] == ["model", "observation", "model"]
    assert written[0]["prompt"] + "".join(p["text"] for p in written[0]["parts"]) == written[0]["text"]


def test_more_turns_without_an_environment_are_refused():
    with pytest.raises(UserError, match=r"an environment for multi-turn rollouts \(grpo.max_rollout_turns=3\)"):
        GRPOTrainer(load_config(BUNDLED_RECIPE, overrides=[*QUICK, "grpo.max_rollout_turns=3"])).train()


@pytest.mark.parametrize("where, says", [
    ("tests.helpers.environments:Missing", "env.again.actor_class_fqn='tests.helpers.environments:Missing': module "
                                           "'tests.helpers.environments' has no class 'Missing'"),
    ("tests.helpers.environments:NoStep", "env.again: tests.helpers.environments:NoStep has no step(conversation, "
                                          "metadata) method"),
    ("tests.helpers.environments:Refuses", "env.again: building tests.helpers.environments:Refuses(cfg) failed: "
                                           "ValueError: no board size given"),
])
def test_a_wrong_environment_class_is_named_before_the_run(where, says, tmp_path):
    cfg = load_config(BUNDLED_RECIPE, overrides=[f"env.again.actor_class_fqn={where}", *QUICK,
                                                 f"logger.log_dir={tmp_path}"])
    with pytest.raises(UserError) as caught:
        GRPOTrainer(cfg).train()
    assert says in str(caught.value)
    assert not any(tmp_path.iterdir())  # nothing written


def test_environment_blocks_are_checked_as_the_config_loads():
    assert set(load_config(BUNDLED_RECIPE, overrides=[*ENV, "env.other.actor_class_fqn=x:Y"]).env) == {"again", "other"}
    with pytest.raises(ConfigError, match="env.ask names an agent, which plays every episode of its run: it shares a "
                                          r"run with no other environment or reward domain yet \(env.again\)"):
        load_config(BUNDLED_RECIPE, overrides=[*ENV, "env.ask.agent=tests.helpers.agents:two_turns"])
    with pytest.raises(ConfigError, match="data.train.0..env_name='elsewhere' is not a reward domain or an "
                                          r"environment .* default, again\)"):
        load_config(BUNDLED_RECIPE, overrides=[*ENV, "data.train=[{data_path: x.jsonl, env_name: elsewhere}]"])
    with pytest.raises(ConfigError, match="env.again plays episodes and is also a reward domain"):
        load_config(BUNDLED_RECIPE, overrides=[*ENV, "reward.domains.again.function=exact_match"])
    with pytest.raises(ConfigError, match="cfg and max_failed_fraction are an environment class's"):
        load_config(BUNDLED_RECIPE, overrides=["env.math.cfg={turns: 2}"])
    with pytest.raises(ConfigError, match="and yours, each naming its class in env.<name>.actor_class_fqn"):
        load_config(BUNDLED_RECIPE, overrides=["env.again.cfg={turns: 2}"])
    with pytest.raises(ConfigError, match="the math environment's setting"):
        load_config(BUNDLED_RECIPE, overrides=[*ENV, "env.again.math_verify_impl=dapo_math_verify"])
    assert load_config(BUNDLED_RECIPE, overrides=[*ENV, "env.again.num_workers=2"]).env["again"].num_workers == 2
    with pytest.raises(ConfigError, match="a block names an agent or an environment class"):
        load_config(BUNDLED_RECIPE, overrides=[*ENV, "env.again.agent=tests.helpers.agents:two_turns"])
    single = load_config(BUNDLED_RECIPE, overrides=["policy.generation.vllm_cfg.async_engine=true"])
    assert any("async_engine' = True: it plays each episode's turns on its own" in w for w in single.load_warnings)
    assert not any("async_engine" in w for w in load_config(
        BUNDLED_RECIPE, overrides=[*ENV, "policy.generation.vllm_cfg.async_engine=true"]).load_warnings)


def test_an_environment_that_raises_stops_the_run_naming_it(tmp_path, capsys):
    from novarl.cli import main

    code = main(["train", "env.bad.actor_class_fqn=tests.helpers.environments:Breaks", "grpo.max_rollout_turns=2",
                 "policy.max_seq_length=32", *QUICK, f"logger.log_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert "episodes failed at step 1, more than env.<name>.max_failed_fraction=0.1 allows" in err
    assert "Breaks.step at turn 2 of example" in err and "raised KeyError: 'board'" in err


def test_failed_episodes_below_the_bound_get_no_loss_and_are_counted(tmp_path):
    from novarl.rollout.episodes import neutral_rewards
    from novarl.rollout.batch import build_train_batch
    from novarl.types import Completion, Prompt

    cfg = load_config(BUNDLED_RECIPE, overrides=["env.odd.actor_class_fqn=tests.helpers.environments:BreaksOnOdd",
                                                 "env.odd.max_failed_fraction=1.0", *QUICK,
                                                 f"logger.log_dir={tmp_path}"])
    result = GRPOTrainer(cfg).train()
    steps = [r for r in read_jsonl(result.output_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert all(0 < s["episodes_failed_fraction"] < 1 and math.isfinite(s["loss"]) for s in steps)
    prompt = Prompt("1+2=", [1, 2, 3])
    done = [Completion(prompt, [4], [-0.1], "3", "stop", 0), Completion(prompt, [5], [-0.2], "4", "stop", 0),
            Completion(prompt, [6], [-0.3], "?", "stop", 0, failed="it raised")]
    assert neutral_rewards(done, [1.0, 0.0, 0.0], 3) == [1.0, 0.0, 0.5]  # the others' mean: no pull on the baseline
    assert build_train_batch(done, torch.zeros(3)).loss_mask.tolist() == [False, False, False, True] * 2 + [False] * 4


def test_novarl_eval_plays_greedy_episodes(capsys):
    from novarl.cli import main

    code = main(["eval", "tiny-arith", *ENV, "grpo.max_rollout_turns=2", "grpo.max_val_samples=8"])
    out = capsys.readouterr().out
    assert code == 0 and "on 8 prompts, 2.0 turns an episode" in out


def test_async_grpo_plays_episodes_and_a_run_killed_mid_episode_resumes_on_the_same_trajectories(tmp_path):
    """Asynchronous GRPO over two-turn episodes (the engine in this process, one step ahead): ages
    within the bound; killed with kill -9 as soon as its second checkpoint lands (usually as the next
    round's episodes play; the timing is not forced), resumed, it trains steps 3-5 on the trajectories of the uninterrupted run: the round in
    flight came back from the checkpoint with its observations, turns and the environment's rewards."""
    from tests.helpers import HF, train_steps, train_until_killed

    def overrides(folder):
        return [*ENV, *QUICK, HF, "grpo.max_rollout_turns=2", "grpo.max_num_steps=5", "grpo.val_at_end=false",
                "grpo.async_grpo.enabled=true", "grpo.async_grpo.max_trajectory_age_steps=1",
                "loss_fn.use_importance_sampling_correction=true", "grpo.num_prompts_per_step=4",
                "policy.train_micro_batch_size=16",
                f"logger.log_dir={folder / 'logs'}", f"checkpointing.checkpoint_dir={folder / 'ckpt'}",
                "checkpointing.enabled=true", "checkpointing.save_period=1", "checkpointing.keep_top_k=10"]

    whole = train_steps(GRPOTrainer(load_config(BUNDLED_RECIPE, overrides=overrides(tmp_path / "whole"))).train()
                        .output_dir)
    assert [whole[s]["trajectory_age_max"] for s in range(1, 6)] == [0, 1, 1, 1, 1]
    assert all(whole[s]["episode_turns_mean"] == 2.0 for s in whole)
    folder = tmp_path / "killed"
    train_until_killed(overrides(folder), folder / "ckpt" / "step_2")
    kept = max(int(p.name.split("_")[1]) for p in (folder / "ckpt").glob("step_*"))
    assert 2 <= kept < 5 and (folder / "ckpt" / f"step_{kept}" / "rollouts.pt").is_file()
    resumed = GRPOTrainer(load_config(BUNDLED_RECIPE, overrides=overrides(folder))).train().output_dir
    both = train_steps(resumed, this_run_only=False)
    assert min(train_steps(resumed)) == kept + 1 and sorted(both) == [1, 2, 3, 4, 5]
    for step in range(1, 6):
        assert both[step]["reward_mean"] == whole[step]["reward_mean"]
        assert both[step]["observation_tokens_mean"] == whole[step]["observation_tokens_mean"]
        assert both[step]["loss"] == pytest.approx(whole[step]["loss"], abs=1e-6)


@pytest.mark.parametrize("layout, said", [(["policy.generation.backend=vllm"], False),
                                          (["policy.generation.backend=hf"], True),
                                          (["cluster.gpus_per_node=2"], True),
                                          (["policy.generation.backend=vllm", "cluster.gpus_per_node=2"], False)],
                         ids=["vllm-here", "hf", "hf-ray-ranks", "vllm-ray-ranks"])
def test_per_sample_turns_where_the_engines_cannot_play_them_are_said(layout, said):
    """vllm_cfg.async_engine plays each episode on its own with vLLM engines (in this process or on Ray
    ranks); with others it is said once that the turns run in lockstep."""
    pytest.importorskip("vllm")
    from novarl.backends.contract.checks import check_config
    from novarl.rollout.episodes import ContentTokens, Episodes
    from novarl.rollout.playing import lockstep_warning
    from tests.helpers.environments import AskAgain

    cfg = load_config(BUNDLED_RECIPE, overrides=[*ENV, "policy.generation.vllm_cfg.async_engine=true", *layout])
    episodes = Episodes(AskAgain({}), ContentTokens(None), 2, per_sample=True)
    warned = lockstep_warning(cfg, episodes, check_config(cfg).choice)
    assert bool(warned) == said and all("plays each step's turns in lockstep" in w for w in warned)


def test_examples_play_in_the_environment_their_data_names(tmp_path, monkeypatch, capsys):
    """NeMo RL's data.*.env_name with several environments in one run: each example's episode plays in its
    dataset's environment (2 or 3 turns), an example of the reward domain answers once and is scored by
    reward.function as in a one-turn run (equal to a direct call of it); each domain counted; a run
    trains on them."""
    import json
    from pathlib import Path

    from novarl.backends.generation.engines import LocalGeneration
    from novarl.backends.generation.hf import HFGeneration
    from novarl.cli import main
    from novarl.rewards.scorer import RewardScorer
    from novarl.rollout.collect import draw_round
    from novarl.rollout.routing import RoutedEnvironments
    from novarl.trainer.setup import prepare_inputs

    monkeypatch.chdir(tmp_path)
    files = {"two.jsonl": range(10, 18), "three.jsonl": range(20, 28), "one.jsonl": range(30, 38)}
    for name, numbers in files.items():
        Path(name).write_text("".join(json.dumps({"prompt": f"{a}+{a % 7}=", "answer": str(a + a % 7)}) + "\n"
                                      for a in numbers))
    routed = ["env.twice.actor_class_fqn=tests.helpers.environments:AskAgain", "env.twice.cfg={turns: 2}",
              "env.thrice.actor_class_fqn=tests.helpers.environments:AskAgain", "env.thrice.cfg={turns: 3}",
              "data.train=[{data_path: two.jsonl, env_name: twice}, {data_path: three.jsonl, env_name: thrice}, "
              "{data_path: one.jsonl}]", "reward.function=exact_match", "grpo.max_rollout_turns=3",
              "policy.max_seq_length=48", "policy.generation.max_new_tokens=6", "grpo.num_prompts_per_step=6",
              "grpo.num_generations_per_prompt=2", "policy.train_global_batch_size=12",
              "policy.train_micro_batch_size=12", "grpo.max_val_samples=6"]
    cfg = load_config(BUNDLED_RECIPE, overrides=[*routed, *QUICK])
    inputs = prepare_inputs(cfg)
    assert isinstance(inputs.episodes.environment, RoutedEnvironments)
    assert "episodes of up to 3 turn(s) in env.twice" in inputs.summary and "scored by exact_match" in inputs.summary
    engine = HFGeneration(inputs.model_path, inputs.tokenizer, torch.device("cpu"), precision="float32",
                          max_seq_length=48)
    prompts, sampling = draw_round(cfg, inputs, 1, 0, 6)
    completions, rewards = inputs.episodes.play(LocalGeneration(engine), prompts, sampling)
    turns = {"two.jsonl": 2, "three.jsonl": 3, "one.jsonl": 1}
    for completion, reward in zip(completions, rewards):
        first = int(completion.prompt.text.split("+")[0])
        source = next(name for name, numbers in files.items() if first in numbers)
        assert completion.turns == turns[source] and completion.failed is None
        if source == "one.jsonl":  # as a one-turn run scores it
            assert reward == RewardScorer.from_spec("exact_match").score([completion])[0]
    counted = inputs.episodes.take_metrics()
    assert counted["domain/twice/episode_turns_mean"] == 2 and counted["domain/thrice/episode_turns_mean"] == 3
    assert counted["domain/default/episode_turns_mean"] == 1
    assert sum(counted[f"domain/{d}/samples"] for d in ("twice", "thrice", "default")) == 12
    code = main(["train", *routed, *QUICK, f"logger.log_dir={tmp_path / 'run'}"])
    assert code == 0, capsys.readouterr().err[-2000:]
    steps = [r for r in read_jsonl(next((tmp_path / "run").glob("*/metrics.jsonl"))) if r["kind"] == "train"]
    assert len(steps) == 2 and all(math.isfinite(s["loss"]) and 1 < s["episode_turns_mean"] < 3 for s in steps)
    assert all("domain/thrice/reward_mean" in s or "domain/twice/reward_mean" in s for s in steps)
