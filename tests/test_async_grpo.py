"""Asynchronous GRPO (grpo.async_grpo.enabled) on dedicated engines (2 Ray ranks on the CPU: the
policy on one, an engine on the other): trajectories at most max_trajectory_age_steps old, and a
run killed with kill -9 and resumed trains on exactly the trajectories of the uninterrupted run,
every prompt of the epoch once."""

from __future__ import annotations

import json
import os
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
ASYNC = ["grpo.async_grpo.enabled=true", "loss_fn.use_importance_sampling_correction=true",
         "cluster.gpus_per_node=2", "policy.generation.colocated.enabled=false",
         "policy.generation.colocated.resources.gpus_per_node=1"]
PROMPTS, PER_STEP = 32, 8  # one epoch: 4 steps


def overrides(folder: Path, data: Path) -> list[str]:
    return [f"logger.log_dir={folder / 'logs'}", f"checkpointing.checkpoint_dir={folder / 'ckpt'}",
            "checkpointing.enabled=true", "checkpointing.save_period=1", "checkpointing.keep_top_k=10",
            f"data.train_data_path={data}", f"grpo.num_prompts_per_step={PER_STEP}",
            "grpo.num_generations_per_prompt=4", "grpo.max_num_steps=4", f"reward.function={REWARD}",
            "grpo.val_at_start=false", "grpo.val_at_end=false", "grpo.val_period=0", "logger.progress_bar=false",
            "policy.train_micro_batch_size=32", HF, *ASYNC]


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


def test_a_killed_async_run_resumes_on_the_same_trajectories_and_trains_each_prompt_once(tmp_path, monkeypatch):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) + "\n"
                            for a in range(10, 10 + PROMPTS)))
    monkeypatch.setenv("NOVARL_TEST_RECORD", str(tmp_path / "whole.txt"))
    whole = train_steps(GRPOTrainer(load_config(BUNDLED_RECIPE, overrides=overrides(tmp_path / "whole", data)))
                        .train().output_dir)
    assert [whole[s]["trajectory_age_max"] for s in range(1, 5)] == [0, 1, 1, 1]  # within the bound of 1
    assert all(whole[s]["is_weight_mean"] > 0 for s in range(1, 5))
    epoch = trained_prompts(tmp_path / "whole.txt")
    assert len(epoch) == 4 and sum(epoch, Counter()) == Counter({p: 4 for c in epoch for p in c})

    run = tmp_path / "run"
    train_until_killed(overrides(run, data), run / "ckpt" / "step_2",
                       env={**os.environ, "NOVARL_TEST_RECORD": str(tmp_path / "run.txt")})
    kept = max(int(p.name.split("_")[1]) for p in (run / "ckpt").glob("step_*"))
    assert 2 <= kept < 4
    monkeypatch.setenv("NOVARL_TEST_RECORD", str(tmp_path / "run.txt"))
    resumed = train_steps(GRPOTrainer(load_config(BUNDLED_RECIPE, overrides=overrides(run, data))).train().output_dir)
    assert min(resumed) == kept + 1 and max(resumed) == 4
    for step in range(kept + 1, 5):  # the trajectories in flight at the kill came back from the checkpoint
        assert resumed[step]["reward_mean"] == whole[step]["reward_mean"]
        assert resumed[step]["loss"] == pytest.approx(whole[step]["loss"], abs=1e-7)
        assert resumed[step]["trajectory_age_max"] <= 1
    steps = trained_prompts(tmp_path / "run.txt", killed_until=kept)
    assert steps == epoch  # every prompt of the epoch, once, in the same steps


def test_a_trajectory_older_than_the_bound_stops_the_run():
    from novarl.trainer.async_rollouts import AsyncRollouts, Round
    from novarl.trainer.grpo import StepTimer
    from novarl.types import Completion, Prompt, SamplingConfig

    cfg = load_config(BUNDLED_RECIPE, overrides=[HF, *ASYNC])
    pipeline = AsyncRollouts(cfg, inputs=None, roles=None, max_steps=10)
    prompt = Prompt("1+1=", [1, 2], "2")
    old = Completion(prompt, [3], [-0.1], "2", "stop", policy_version=2)  # trained at step 6: 3 steps old
    pipeline.pending = Round(6, [prompt], SamplingConfig(max_new_tokens=4), {}, completions=[old])
    with pytest.raises(RunFailed, match="3 steps old at step 6"):
        pipeline.take(6, StepTimer())


def test_async_needs_dedicated_engines_and_the_importance_correction(capsys):
    assert main(["validate", HF, "grpo.async_grpo.enabled=true"]) == 2
    err = capsys.readouterr().err
    assert "set policy.generation.colocated.enabled=false" in err
    assert "needs loss_fn.use_importance_sampling_correction=true" in err
