"""Asynchronous GRPO (grpo.async_grpo.enabled) on dedicated engines (2 Ray ranks on the CPU: the
policy on one, an engine on the other) two steps ahead (max_trajectory_age_steps=2): trajectories
at most that old, the same as with the engine in the driver's process, and a run killed with
kill -9 with two rounds in flight, resumed, trains on exactly the trajectories of the
uninterrupted run, every prompt of the epoch once; resumed under a bound of 1, the rounds too old
for it are generated again."""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from pathlib import Path

import pytest

from novarl.cli import BUNDLED_RECIPE, main
from novarl.config import load_config
from novarl.errors import RunFailed
from novarl.trainer.api import GRPOTrainer
from tests.helpers import HF, train_steps, train_until_killed

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]  # tests/conftest.py
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
REWARD = str(Path(__file__).parent / "helpers" / "rewards.py") + ":recording"
ASYNC = ["grpo.async_grpo.enabled=true", "loss_fn.use_importance_sampling_correction=true"]
DEDICATED = ["cluster.gpus_per_node=2", "policy.generation.colocated.enabled=false",
             "policy.generation.colocated.resources.gpus_per_node=1"]
PROMPTS, PER_STEP = 32, 8  # one epoch: 4 steps


def overrides(folder: Path, data: Path, layout: list[str] = DEDICATED) -> list[str]:
    return [f"logger.log_dir={folder / 'logs'}", f"checkpointing.checkpoint_dir={folder / 'ckpt'}",
            "checkpointing.enabled=true", "checkpointing.save_period=1", "checkpointing.keep_top_k=10",
            f"data.train_data_path={data}", f"grpo.num_prompts_per_step={PER_STEP}",
            "grpo.num_generations_per_prompt=4", "grpo.max_num_steps=4", f"reward.function={REWARD}",
            "grpo.val_at_start=false", "grpo.val_at_end=false", "grpo.val_period=0", "logger.progress_bar=false",
            "policy.train_micro_batch_size=32", HF, *ASYNC, "grpo.async_grpo.max_trajectory_age_steps=2", *layout]


def trained_prompts(record: Path, killed_until: int | None = None) -> list[Counter]:
    """Per step, the prompts the reward scored, from the record of one or two processes (the first
    line of each is the trial call before the run starts); with killed_until, the first process's
    steps up to it and the second's after it."""
    by_process: dict[str, list[str]] = {}
    for line in record.read_text().splitlines():
        pid, prompt = line.split("\t")
        by_process.setdefault(pid, []).append(prompt)
    steps = []
    for i, prompts in enumerate(by_process.values()):
        prompts = prompts[1:]
        chunks = [Counter(prompts[j:j + PER_STEP * 4]) for j in range(0, len(prompts), PER_STEP * 4)]
        steps += chunks[:killed_until] if killed_until is not None and i == 0 else chunks
    return steps


def run(folder: Path, data: Path, *more: str, layout: list[str] = DEDICATED) -> dict:
    return train_steps(GRPOTrainer(load_config(BUNDLED_RECIPE, overrides=[*overrides(folder, data, layout), *more]))
                       .train().output_dir)


def test_a_killed_async_run_resumes_on_the_same_trajectories_and_trains_each_prompt_once(tmp_path, monkeypatch):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) + "\n"
                            for a in range(10, 10 + PROMPTS)))
    # the uninterrupted run, with the engine in this process: the schedule does not depend on the layout
    monkeypatch.setenv("NOVARL_TEST_RECORD", str(tmp_path / "whole.txt"))
    whole = run(tmp_path / "whole", data, layout=[])
    assert [whole[s]["trajectory_age_max"] for s in range(1, 5)] == [0, 1, 2, 2]  # rounds 1-3 on the first weights
    assert [whole[s]["trajectory_age/2"] for s in range(1, 5)] == [0, 0, 1, 1]
    assert all(whole[s]["is_weight_mean"] > 0 and whole[s]["time_generation"] > 0 for s in range(1, 5))
    epoch = trained_prompts(tmp_path / "whole.txt")
    assert len(epoch) == 4 and sum(epoch, Counter()) == Counter({p: 4 for c in epoch for p in c})
    monkeypatch.setenv("NOVARL_TEST_RECORD", str(tmp_path / "evaluated.txt"))
    evaluated = run(tmp_path / "evaluated", data, "grpo.val_period=2", "grpo.max_val_samples=8", layout=[])
    assert all(evaluated[s]["reward_mean"] == whole[s]["reward_mean"] for s in range(1, 5))  # an evaluation queues
    # the newest weights behind the rounds in flight: the trajectories stay those of a run without it

    folder = tmp_path / "run"  # dedicated: the policy on one Ray rank, the engine on another
    train_until_killed(overrides(folder, data), folder / "ckpt" / "step_2",
                       env={**os.environ, "NOVARL_TEST_RECORD": str(tmp_path / "run.txt")})
    kept = max(int(p.name.split("_")[1]) for p in (folder / "ckpt").glob("step_*"))
    assert 2 <= kept < 4 and (folder / "ckpt" / f"step_{kept}" / "rollouts.pt").is_file()
    shutil.copytree(folder / "ckpt", tmp_path / "bound1" / "ckpt", ignore=shutil.ignore_patterns(".tmp_*"))
    monkeypatch.setenv("NOVARL_TEST_RECORD", str(tmp_path / "run.txt"))
    output = GRPOTrainer(load_config(BUNDLED_RECIPE, overrides=overrides(folder, data))).train().output_dir
    both = train_steps(output, this_run_only=False)  # the killed run's steps, then the resumed one's
    assert min(train_steps(output)) == kept + 1 and sorted(both) == [1, 2, 3, 4]
    for step in range(1, 5):  # the rounds in flight at the kill came back from the checkpoint
        assert both[step]["reward_mean"] == whole[step]["reward_mean"]
        assert both[step]["loss"] == pytest.approx(whole[step]["loss"], abs=1e-6)
        assert both[step]["trajectory_age_max"] == whole[step]["trajectory_age_max"]
    for step in range(1, kept + 1):  # generated in the killed run (the resumed one restored the others)
        assert 0 <= both[step]["time_generator_idle"] < both[step]["time_step"] + 5
        assert both[step]["time_generation"] > 0 and (step == 1 or both[step]["weight_sync_mb"] > 0)
    assert trained_prompts(tmp_path / "run.txt", killed_until=kept) == epoch  # each prompt once, in the same steps

    # a bound of 1: the checkpoint's rounds (generated on weights 0 and 1 for steps 3 and 4) are too old, so
    # they are generated again, on the checkpoint's weights, in this process; the prompts stay the same
    monkeypatch.setenv("NOVARL_TEST_RECORD", str(tmp_path / "bound1.txt"))
    again = run(tmp_path / "bound1", data, "grpo.async_grpo.max_trajectory_age_steps=1", layout=[])
    assert min(again) == kept + 1 and all(again[s]["trajectory_age_max"] <= 1 for s in again)
    assert trained_prompts(tmp_path / "bound1.txt") == epoch[kept:]


def test_a_trajectory_older_than_the_bound_stops_the_run():
    from novarl.rollout.async_rollouts import AsyncRollouts, Round
    from novarl.trainer.grpo import StepTimer
    from novarl.types import Completion, Prompt, SamplingConfig

    cfg = load_config(BUNDLED_RECIPE, overrides=[HF, *ASYNC])
    pipeline = AsyncRollouts(cfg, inputs=None, roles=None, max_steps=10)
    prompt = Prompt("1+1=", [1, 2], "2")
    old = Completion(prompt, [3], [-0.1], "2", "stop", policy_version=2)  # trained at step 6: 3 steps old
    pipeline.rounds.append(Round(6, [prompt], SamplingConfig(max_new_tokens=4), {}, completions=[old]))
    with pytest.raises(RunFailed, match="3 steps old at step 6"):
        pipeline.take(6, StepTimer())


def test_async_needs_dedicated_engines_or_one_process_and_the_importance_correction(capsys):
    assert main(["validate", HF, "grpo.async_grpo.enabled=true", "cluster.gpus_per_node=2"]) == 2
    err = capsys.readouterr().err
    assert "set policy.generation.colocated.enabled=false" in err and "take turns with training" in err
    assert "needs loss_fn.use_importance_sampling_correction=true" in err
    assert main(["validate", HF, *ASYNC]) == 0  # one rank, the engine in this process
