"""The GRPO family through the real loop (one in-process rank, Hugging Face generation): DAPO's
dynamic sampling trains on groups with a signal only and stops after its cap with a clear
message; every estimator and loss setting runs a step (CISPO and VAPO's NLL among them);
sequences are masked by their logprob error; reward shaping reaches the advantages."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from novarl.cli import BUNDLED_RECIPE, main
from novarl.config import load_config
from novarl.trainer.api import GRPOTrainer
from tests.helpers import HF, train_steps

REPO = Path(__file__).parents[1]
SMALL = ["logger.progress_bar=false", "grpo.val_at_start=false", "grpo.val_at_end=false",
         "grpo.num_prompts_per_step=16", "policy.train_micro_batch_size=128", "grpo.max_train_seconds=null", HF]


def run(tmp_path, steps: int, *overrides: str) -> dict:
    cfg = load_config(BUNDLED_RECIPE, overrides=[f"logger.log_dir={tmp_path}", f"grpo.max_num_steps={steps}",
                                                 *SMALL, *overrides])
    return train_steps(GRPOTrainer(cfg).train().output_dir)


def test_dynamic_sampling_trains_only_on_groups_with_a_signal(tmp_path):
    plain = run(tmp_path / "plain", 2)
    dynamic = run(tmp_path / "dynamic", 2, "grpo.use_dynamic_sampling=true", "grpo.batch_multiplier=2")
    # the model gets about 1 sum in 4 right: many groups of 8 are all wrong, and without dynamic
    # sampling their samples are left out of the update
    assert any(s["samples_trained_fraction"] < 1 for s in plain.values())
    for step in dynamic.values():
        # binary rewards in a mixed group: no sample sits at the group's mean, every one trains
        assert step["samples_trained_fraction"] == 1.0
        assert step["groups_kept"] >= 16 and step["dynamic_sampling_rounds"] >= 1


def test_dynamic_sampling_stops_after_its_cap_naming_the_setting(tmp_path, capsys):
    code = main(["train", f"logger.log_dir={tmp_path}", "grpo.max_num_steps=3", *SMALL,
                 f"reward.function={REPO / 'tests' / 'helpers' / 'rewards.py'}:constant",
                 "grpo.use_dynamic_sampling=true", "grpo.dynamic_sampling_max_gen_batches=3"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert "dynamic sampling found 0 of the 16 prompt groups it needs" in err
    assert "in 3 generation rounds of 16 prompts at step 1 (grpo.dynamic_sampling_max_gen_batches)" in err


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory):
    return run(tmp_path_factory.mktemp("grpo"), 1)


@pytest.mark.parametrize("overrides", [
    ["grpo.adv_estimator.name=reinforce_plus_plus"],
    ["grpo.adv_estimator.name=reinforce_plus_plus", "grpo.adv_estimator.minus_baseline=false"],
    ["grpo.adv_estimator.name=rloo", "loss_fn.disable_ppo_ratio=true"],
    ["grpo.normalize_rewards=false", "loss_fn.loss_agg_mode=seq-mean-token-sum-norm"],
    ["loss_fn.loss_agg_mode=seq-mean-token-sum", "loss_fn.sequence_level_importance_ratios=true"],
    ["grpo.reward_scaling.enabled=true", "grpo.reward_scaling.target_min=-1",
     "grpo.reward_shaping.enabled=true", "grpo.reward_shaping.stop_properly_penalty_coef=0.5"],
    ["grpo.adv_estimator.name=reinforce_plus_plus", "loss_fn.use_kl_in_reward=true",
     "loss_fn.reference_policy_kl_penalty=0.1"],
    ["loss_fn.use_cispo=true", "loss_fn.ratio_clip_max=0.28"],
    ["loss_fn.positive_example_nll_weight=0.1"],
], ids=["reinforce++", "reinforce++-no-baseline", "reinforce-rloo", "dr-grpo", "gspo-token-sum", "scaled-shaped",
        "reinforce++-kl-in-reward", "cispo", "vapo-nll"])
def test_every_estimator_and_aggregation_trains_a_step(tmp_path, overrides, grpo_run):
    first, step = run(tmp_path, 2, *overrides).values()
    assert step["grad_norm"] > 0 and step["loss"] == step["loss"]  # a gradient, and a finite loss
    # the same samples as GRPO's first step (same seed, same start), a different update
    assert first["reward_mean"] == grpo_run[1]["reward_mean"]
    assert (first["loss"], first["grad_norm"]) != pytest.approx((grpo_run[1]["loss"], grpo_run[1]["grad_norm"]),
                                                                rel=1e-4)
    if "grpo.reward_scaling.enabled=true" in overrides:
        # exact match's 0/1 onto -1/1, truncated ones halved: logged beside the task's own mean
        assert -1 <= step["reward_shaped_mean"] < 1 and step["reward_shaped_mean"] != step["reward_mean"]
    if "loss_fn.use_kl_in_reward=true" in overrides:  # the first step's policy is the reference, then it moves
        assert first["kl_to_reference"] == pytest.approx(0, abs=1e-6) and step["kl_to_reference"] > 1e-6
        assert step["logprob_mismatch"] < 1e-3
    if "loss_fn.positive_example_nll_weight=0.1" in overrides:  # some sums right: their tokens' NLL
        assert first["nll_loss"] > 0 and step["nll_loss"] > 0


def test_sequences_over_the_logprob_error_threshold_are_masked_in_the_loop(tmp_path, grpo_run):
    """At the lowest threshold, 1, every sequence whose engine logprobs differ at all from the
    trainer's forward (here by ~1e-7) is masked: what is left has no error, the rest is counted."""
    (step,) = run(tmp_path, 1, "grpo.seq_logprob_error_threshold=1").values()
    assert step["min_seq_mult_prob_error"] >= 1 and step["max_seq_mult_prob_error_after_mask"] <= 1
    assert (step["num_masked_seqs_by_logprob_error"] > 0) == (step["max_seq_mult_prob_error"] > 1)
    # the weight sync's check is taken before the mask, over every sequence: the masked ones' errors show
    assert (step["logprob_mismatch_max"] > 0) == (step["num_masked_seqs_by_logprob_error"] > 0)
    assert step["reward_mean"] == grpo_run[1]["reward_mean"]
    if step["num_masked_seqs_by_logprob_error"]:  # fewer tokens in the loss: another update
        assert step["loss"] != pytest.approx(grpo_run[1]["loss"], rel=1e-4)


def test_settings_that_would_train_nothing_are_refused_and_unread_ones_said():
    from novarl.backends.contract.checks import check_config

    def report(*overrides):
        return check_config(load_config(BUNDLED_RECIPE, overrides=list(overrides)))

    def problems(*overrides):
        return " ".join(str(p) for p in report(*overrides).problems)

    assert "loss_fn.use_kl_in_reward puts the KL in the per-token rewards of REINFORCE++ or PPO" in \
        problems("loss_fn.use_kl_in_reward=true", "loss_fn.reference_policy_kl_penalty=0.1")
    assert "there is no KL to put in the reward" in \
        problems("loss_fn.use_kl_in_reward=true", "grpo.adv_estimator.name=reinforce_plus_plus")
    assert "a group of one minus its own mean is 0" in \
        problems("grpo.adv_estimator.name=reinforce_plus_plus", "grpo.num_generations_per_prompt=1",
                 "grpo.num_prompts_per_step=512")
    assert problems("grpo.adv_estimator.name=reinforce_plus_plus", "grpo.adv_estimator.minus_baseline=false",
                    "grpo.num_generations_per_prompt=1", "grpo.num_prompts_per_step=512") == ""
    warned = report("loss_fn.loss_agg_mode=seq-mean-token-sum", "grpo.adv_estimator.name=rloo",
                    "grpo.normalize_rewards=false").warnings
    assert "loss_fn.token_level_loss=true is not used: loss_fn.loss_agg_mode=seq-mean-token-sum decides how the " \
           "loss is aggregated" in warned
    assert "grpo.normalize_rewards=false: not read by grpo.adv_estimator.name=rloo" in warned


def test_novarls_earlier_estimator_key_still_loads():
    """Checkpoints keep the config they were written with: grpo.advantage_estimator still means the name."""
    assert load_config({"grpo": {"advantage_estimator": "rloo"}}).grpo.adv_estimator.name == "rloo"


def test_dynamic_sampling_resumes_exactly(tmp_path):
    """A resumed run draws the prompts, rounds and samples the uninterrupted run drew: the data
    position saved with each checkpoint counts every round's prompts."""
    ckpt = ["checkpointing.enabled=true", "checkpointing.save_period=2", "grpo.use_dynamic_sampling=true",
            "grpo.batch_multiplier=1.5"]
    whole = run(tmp_path / "whole", 4, *ckpt, f"checkpointing.checkpoint_dir={tmp_path / 'c1'}")
    shutil.copytree(tmp_path / "c1" / "step_2", tmp_path / "c2" / "step_2")  # as a run stopped after step 2 leaves it
    resumed = run(tmp_path / "second", 4, *ckpt, f"checkpointing.checkpoint_dir={tmp_path / 'c2'}")
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        for key in ("reward_mean", "dynamic_sampling_rounds", "groups_kept", "completion_length_mean"):
            assert resumed[step][key] == whole[step][key], key
        assert resumed[step]["loss"] == pytest.approx(whole[step]["loss"], abs=1e-7)
