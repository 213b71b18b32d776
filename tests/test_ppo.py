"""PPO with a critic (grpo.adv_estimator.name: gae, a `value` section): GAE by hand, the loop
with the critic's warm-up and several epochs, kill -9 resume of the policy and the critic,
the critic's export, the same training over 2 Ray ranks (FSDP2, ZeRO-3), and the refusals
at validate."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from novarl.algorithms.advantages import GAESettings, ppo_advantages, terminal_rewards
from novarl.cli import BUNDLED_RECIPE, main
from novarl.config import load_config
from novarl.trainer.api import GRPOTrainer
from tests.helpers import HF, train_steps, train_until_killed

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
PPO = ["grpo.adv_estimator.name=gae", "value={}"]
COMMON = ["logger.progress_bar=false", "grpo.max_train_seconds=null", "grpo.val_at_start=false",
          "grpo.val_at_end=false", "grpo.num_prompts_per_step=16", "policy.train_micro_batch_size=64", HF, *PPO,
          "grpo.ppo_epochs=2", "grpo.policy_training_start_step=1"]


# ------------------------------------------------------------------ GAE by hand
def test_gae_puts_the_reward_on_the_last_token_and_decouples_the_lambdas():
    mask = torch.tensor([[False, True, True, True], [False, False, True, False]])  # a prompt, then the completion
    assert terminal_rewards(torch.tensor([1.0, 2.0]), mask).tolist() == [[0, 0, 0, 1], [0, 0, 2, 0]]
    values = torch.tensor([[9.0, 0.5, 0.25, 0.5], [9.0, 9.0, 0.5, 9.0]])
    # lambda 0.5, gamma 1: deltas (0.25 - 0.5, 0.5 - 0.25, 1 - 0.5) = (-0.25, 0.25, 0.5);
    # A3 = 0.5, A2 = 0.25 + 0.5 x 0.5 = 0.5, A1 = -0.25 + 0.5 x 0.5 = 0; row 2: A = 2 - 0.5
    adv, returns = ppo_advantages(torch.tensor([1.0, 2.0]), values, mask, GAESettings(lam=0.5, normalize=False))
    assert adv.tolist() == [[0, 0, 0.5, 0.5], [0, 0, 1.5, 0]]
    assert returns.tolist() == [[0, 0.5, 0.75, 1.0], [0, 0, 2.0, 0]]
    # VAPO: returns with lambda 1 (Monte Carlo: the reward itself), advantages with the policy's 0.5
    adv, returns = ppo_advantages(torch.tensor([1.0, 2.0]), values, mask,
                                  GAESettings(lam=0.5, lam_value=1.0, normalize=False))
    assert returns.tolist() == [[0, 1, 1, 1], [0, 0, 2, 0]] and adv.tolist() == [[0, 0, 0.5, 0.5], [0, 0, 1.5, 0]]
    # length-adaptive: lambda = 1 - 1/(alpha l) per completion: l=3, alpha=2/3 -> 0.5; l=2 -> 0.25
    two = torch.tensor([[False, True, True, True], [False, False, True, True]])
    adv, _ = ppo_advantages(torch.tensor([1.0, 2.0]), values, two,
                            GAESettings(lam=0.9, length_adaptive_alpha=2 / 3, normalize=False))
    # row 2: deltas (9 - 0.5, 2 - 9) = (8.5, -7); A2 = -7, A1 = 8.5 + 0.25 x -7 = 6.75
    assert torch.allclose(adv, torch.tensor([[0, 0, 0.5, 0.5], [0, 0, 6.75, -7.0]]))
    # the KL in the reward: each token's -coef x KL before GAE; whitened over the mask
    kl = torch.tensor([[5.0, 0.1, 0.2, 0.3], [5.0, 5.0, 0.5, 5.0]])
    adv, _ = ppo_advantages(torch.tensor([1.0, 2.0]), values, mask, GAESettings(lam=0.0, normalize=True), kl, 1.0)
    raw = torch.tensor([0.25 - 0.1 - 0.5, 0.5 - 0.2 - 0.25, 1 - 0.3 - 0.5, 2 - 0.5 - 0.5])  # lambda 0: the deltas
    whitened = (raw - raw.mean()) / raw.var(unbiased=False).sqrt()
    assert torch.allclose(adv[mask], whitened, atol=1e-6) and bool((adv[~mask] == 0).all())


def test_the_loop_reads_values_and_rewards_at_the_right_tokens_of_a_batch():
    """PPO's estimator (GAE) on a real batch (prompts, then completions, laid end to end): the values the
    critic gives each token (read at its predecessor) and each completion's reward on its last
    token, back to the batch's token order."""
    from novarl.algorithms.estimators import StepRewards
    from novarl.trainer.stages import advantage_estimator
    from novarl.types import TrainBatch

    cfg = load_config(None, overrides=[*PPO, "grpo.adv_estimator.gae_lambda=0.5",
                                       "grpo.adv_estimator.normalize_advantages=false"])
    ids = torch.tensor([[3, 4, 5, 6, 7], [3, 8, 9, 0, 0]])
    attention = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    loss_mask = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 1, 0, 0]], dtype=torch.bool)
    batch = TrainBatch.from_rows(ids, attention, loss_mask, torch.zeros(2))
    values = torch.tensor([0, 9, 0.5, 0.25, 0.5, 0, 9, 0.5])
    out = advantage_estimator(cfg)(StepRewards(batch, torch.tensor([1.0, 2.0]), values))
    advantages, returns = out.advantages, out.returns
    assert advantages.tolist() == [0, 0, 0, 0.5, 0.5, 0, 0, 1.5]
    assert returns.tolist() == [0, 0, 0.5, 0.75, 1.0, 0, 0, 2.0]


# ------------------------------------------------------------------ the loop, one rank
def overrides(tmp_path, steps, *extra):
    return [f"logger.log_dir={tmp_path / 'logs'}", f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}",
            f"grpo.max_num_steps={steps}", "checkpointing.enabled=true", "checkpointing.save_period=2",
            "checkpointing.keep_top_k=10", *COMMON, *extra]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """Six PPO steps on one in-process DTensor rank: the first trains the critic alone."""
    folder = tmp_path_factory.mktemp("ppo")
    result = GRPOTrainer(load_config(BUNDLED_RECIPE, overrides=overrides(folder, 6))).train()
    return folder, train_steps(result.output_dir)


@pytest.mark.slow
def test_the_critic_warms_up_then_both_train_for_each_epoch(one_rank):
    folder, steps = one_rank
    assert "loss" not in steps[1] and steps[1]["critic/value_loss"] > 0  # the warm-up: the critic alone
    assert "weight_sync_mb" not in steps[1] and steps[2]["weight_sync_mb"] > 0  # nothing to sync before
    assert steps[1]["critic/values_mean"] == 0  # a zero head: the first values are 0
    for step in range(2, 7):
        assert {"loss", "clip_fraction", "critic/value_loss", "critic/explained_var"} <= set(steps[step])
    # two epochs: the second pass of the policy sees a changed policy (ratios off 1)
    assert any(steps[s]["clip_fraction"] > 0 for s in range(2, 7))
    assert steps[6]["critic/values_mean"] != 0
    assert {"critic", "policy"} <= {p.name for p in (folder / "ckpt" / "step_6").iterdir()}


@pytest.mark.slow
def test_a_checkpoint_resumes_only_with_the_critic_it_was_written_with(one_rank, capsys):
    folder, _ = one_rank
    grpo = [o for o in overrides(folder, 8) if o not in PPO and "policy_training_start_step" not in o]
    assert main(["train", *grpo]) == 2  # GRPO's config on PPO's checkpoints: refused before anything starts
    assert "holds a checkpoint with PPO's critic (critic/), and this config has none" in capsys.readouterr().err
    assert main(["train", *overrides(folder, 8, "value.model_name=tiny-math",
                                     "value.tokenizer.name=tiny-arith")]) == 2
    assert "value.model_name: 'tiny-arith' there, 'tiny-math' here" in capsys.readouterr().err


@pytest.mark.slow
def test_ppo_resumes_after_kill_like_the_uninterrupted_run(one_rank, tmp_path):
    _, expected = one_rank
    run = tmp_path / "run"
    train_until_killed(overrides(run, 6), run / "ckpt" / "step_2")
    assert (run / "ckpt" / "step_2").exists() and not (run / "ckpt" / "step_6").exists()
    resumed = GRPOTrainer(load_config(BUNDLED_RECIPE, overrides=overrides(run, 6))).train()
    got = train_steps(resumed.output_dir)
    assert 3 <= min(got) <= 5 and max(got) == 6
    for step in range(min(got), 7):  # the policy and the critic, optimizer states included, went on exactly
        assert got[step]["reward_mean"] == expected[step]["reward_mean"]
        assert got[step]["loss"] == pytest.approx(expected[step]["loss"], abs=1e-7)
        assert got[step]["critic/value_loss"] == pytest.approx(expected[step]["critic/value_loss"], rel=1e-5)
        assert got[step]["critic/grad_norm"] == pytest.approx(expected[step]["critic/grad_norm"], rel=1e-5)


@pytest.mark.slow
def test_convert_exports_the_critic_as_a_token_classification_folder(one_rank, tmp_path):
    from transformers import AutoModelForTokenClassification

    from novarl.backends.training.dtensor import DTensorCritic
    from novarl.distributed.local import ensure_single_process_group
    from novarl.models.loading import resolve_model_path
    from novarl.models.scores import Values
    from novarl.types import TrainBatch

    folder, _ = one_rank
    step = folder / "ckpt" / "step_6"
    assert main(["convert", str(step), str(tmp_path / "critic"), "--critic"]) == 0
    exported = AutoModelForTokenClassification.from_pretrained(tmp_path / "critic")
    ensure_single_process_group()
    cfg = load_config(step / "config.yaml")
    critic = DTensorCritic(cfg.value, resolve_model_path("tiny-arith"), torch.device("cpu"), total_steps=1)
    critic.load_weights(step / "critic")
    ids = torch.tensor([[1, 5, 6, 7, 8, 9]])
    ones = torch.ones_like(ids, dtype=torch.bool)
    values = critic.forward(TrainBatch.from_rows(ids, ones, ones, torch.zeros(1)), Values())
    with torch.no_grad():  # the folder's output at position t is novarl's value of token t + 1
        theirs = exported(input_ids=ids).logits[0, :-1, 0]
    assert values[0] == 0 and torch.allclose(values[1:], theirs, atol=1e-5) and bool(theirs.abs().sum() > 0)
    assert main(["convert", str(step), str(tmp_path / "policy")]) == 0  # the policy, as before


# ------------------------------------------------------------------ refusals at validate
@pytest.mark.parametrize("extra, message", [
    (["grpo.adv_estimator.name=gae"], "grpo.adv_estimator.name='gae' needs a critic: add a `value` section"),
    ([*PPO, "grpo.adv_estimator.gae_lambda=1.5"], "'grpo.adv_estimator.gae_lambda' = 1.5: Input should be less than "
                                                  "or equal to 1"),
    ([*PPO, "grpo.adv_estimator.gae_gamma=-0.1"], "'grpo.adv_estimator.gae_gamma' = -0.1"),
    (["value={}"], "value: a critic is trained only for grpo.adv_estimator.name='gae'"),
    ([*PPO, "value.model_name=tiny-math"], "value.model_name='tiny-math': its tokenizer"),
    ([*PPO, "value.model_name=tiny-math", "policy.tokenizer.name=tiny-arith"], "value.model_name='tiny-math': its "
                                                                              "tokenizer"),
    ([*PPO, "value.deepspeed_cfg.enabled=true"], "value.deepspeed_cfg.enabled=True differs from "
                                                  "policy.deepspeed_cfg.enabled=False"),
    (["grpo.policy_training_start_step=3"], "grpo.policy_training_start_step=3 warms up a critic"),
], ids=["gae-without-critic", "lambda", "gamma", "critic-without-gae", "other-tokenizer", "other-tokenizer-named",
        "other-backend", "warm-up"])
def test_bad_ppo_settings_are_refused_at_validate_naming_the_key(capsys, extra, message):
    assert main(["validate", HF, *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


# ------------------------------------------------------------------ 2 ranks
@pytest.mark.slow
@pytest.mark.parametrize("backend", [[], ["policy.deepspeed_cfg.enabled=true", "policy.deepspeed_cfg.zero_stage=3",
                                          "value.deepspeed_cfg.enabled=true", "value.deepspeed_cfg.zero_stage=3"]],
                         ids=["fsdp2", "zero3"])
def test_ppo_over_two_ray_ranks_trains_like_one_rank(one_rank, ray_session, tmp_path, backend):
    if backend:
        pytest.importorskip("deepspeed")
    _, expected = one_rank
    cfg = load_config(BUNDLED_RECIPE, overrides=[f"logger.log_dir={tmp_path}", "grpo.max_num_steps=3",
                                                 "cluster.gpus_per_node=2", *COMMON, *backend])
    got = train_steps(GRPOTrainer(cfg).train().output_dir)
    for step in (1, 2, 3):
        assert got[step]["reward_mean"] == expected[step]["reward_mean"]
        assert got[step]["critic/value_loss"] == pytest.approx(expected[step]["critic/value_loss"], rel=1e-4)
    for step in (2, 3):
        assert got[step]["loss"] == pytest.approx(expected[step]["loss"], abs=1e-5)


@pytest.mark.slow
def test_ppo_on_megatron_resumes_exactly_and_exports_its_critic(ray_session, tmp_path, monkeypatch):
    """Megatron-core (CPU emulation, one Ray rank): the critic's scalar head on the last stage;
    a run resumed from step 2 takes step 3 as the uninterrupted one does (policy and critic);
    the critic exports as a token-classification folder."""
    pytest.importorskip("megatron.core")
    from transformers import AutoModelForTokenClassification

    monkeypatch.setenv("NOVARL_MEGATRON_ON_CPU", "1")
    monkeypatch.setenv("NRL_MEGATRON_CHECKPOINT_DIR", str(tmp_path / "cache"))
    megatron = ["policy.megatron_cfg.enabled=true", "policy.megatron_cfg.optimizer.lr=4.0e-4",
                "policy.megatron_cfg.optimizer.weight_decay=0.0"]

    def run(folder, steps):
        cfg = load_config(BUNDLED_RECIPE, overrides=[*overrides(folder, steps), *megatron])
        return train_steps(GRPOTrainer(cfg).train().output_dir)

    whole = run(tmp_path / "whole", 3)
    assert "loss" not in whole[1] and whole[3]["critic/values_mean"] != 0
    # the uninterrupted run's step-2 checkpoint, as a run stopped after step 2 leaves it
    shutil.copytree(tmp_path / "whole" / "ckpt" / "step_2", tmp_path / "cut" / "ckpt" / "step_2")
    resumed = run(tmp_path / "cut", 3)
    assert sorted(resumed) == [3]
    assert resumed[3]["reward_mean"] == whole[3]["reward_mean"]
    assert resumed[3]["loss"] == pytest.approx(whole[3]["loss"], abs=1e-7)
    assert resumed[3]["critic/value_loss"] == pytest.approx(whole[3]["critic/value_loss"], rel=1e-5)
    step = tmp_path / "cut" / "ckpt" / "step_3"
    assert (step / "critic" / "megatron").is_dir()
    assert main(["convert", str(step), str(tmp_path / "critic"), "--critic"]) == 0
    exported = AutoModelForTokenClassification.from_pretrained(tmp_path / "critic")
    assert float(exported.score.weight.abs().sum()) > 0 and exported.score.weight.shape[0] == 1
