"""Advantages, losses and KL estimators against hand-computed values."""

import math

import pytest
import torch

from novarl.algorithms.advantages import ADVANTAGE_ESTIMATORS, grpo_advantages
from novarl.algorithms.kl import KL_ESTIMATORS
from novarl.algorithms.losses import ClippedPGSettings, clipped_pg_loss, make_loss
from novarl.config.schema import LossConfig
from novarl.errors import ConfigError
from novarl.trainer.rollout import with_global_counts
from novarl.types import TrainBatch


def test_grpo_advantages_normalised_by_group_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    adv = grpo_advantages(rewards, 4)
    # group 1: mean 0.5, unbiased std sqrt(1/3) -> +-0.5 / 0.57735 = +-0.866; group 2: no signal.
    expected = [0.866025, -0.866025, -0.866025, 0.866025, 0, 0, 0, 0]
    assert adv.tolist() == pytest.approx(expected, abs=1e-5)


def test_grpo_advantages_leave_one_out_without_normalisation():
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 4, normalize_rewards=False,
                          use_leave_one_out_baseline=True)
    # r=1: others average 1/3 -> 2/3; r=0: others average 2/3 -> -2/3.
    assert adv.tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])


def test_grpo_advantages_reject_ragged_groups():
    with pytest.raises(ValueError, match="groups of 3"):
        grpo_advantages(torch.ones(4), 3)


def test_registry_unknown_name_names_the_key():
    with pytest.raises(ConfigError, match="grpo.advantage_estimator='nope'.*known: grpo"):
        ADVANTAGE_ESTIMATORS.get("nope")


def _batch(logprobs_new, old, advantage, ref=None, tokens=None):
    """One sequence: position 0 is the prompt, positions 1.. are trained."""
    length = len(old)
    mask = torch.tensor([False] + [True] * (length - 1))
    batch = TrainBatch(
        input_ids=torch.zeros((1, length), dtype=torch.long),
        attention_mask=torch.ones((1, length), dtype=torch.bool),
        loss_mask=mask[None],
        advantages=torch.tensor([advantage]),
        generator_logprobs=torch.tensor([old]),
        old_logprobs=torch.tensor([old]),
        reference_logprobs=None if ref is None else torch.tensor([ref]),
    )
    with_global_counts(batch)
    if tokens is not None:
        batch.global_valid_tokens = tokens
    return torch.tensor([logprobs_new], requires_grad=True), batch


def test_clipped_loss_positive_advantage():
    logprobs, batch = _batch([0.0, math.log(1.5), math.log(0.5)], [0.0, 0.0, 0.0], 1.0)
    loss, metrics = clipped_pg_loss(logprobs, batch)
    # ratios 1.5 and 0.5: min(1.5, 1.2) = 1.2 and min(0.5, 0.8) = 0.5 -> -(1.2 + 0.5) / 2
    assert float(loss.detach()) == pytest.approx(-0.85)
    assert float(metrics["clip_fraction"]) == pytest.approx(1.0)
    assert float(metrics["ratio_mean"]) == pytest.approx(1.0)
    loss.backward()
    # Token 1 is clipped (no gradient); token 2 is not: d(-r A / 2)/dlogp = -r A / 2 = -0.25.
    assert logprobs.grad[0].tolist() == pytest.approx([0.0, 0.0, -0.25])


def test_clipped_loss_negative_advantage_and_dual_clip():
    logprobs, batch = _batch([0.0, math.log(1.5), math.log(0.5)], [0.0, 0.0, 0.0], -1.0)
    loss, _ = clipped_pg_loss(logprobs, batch)
    assert loss.item() == pytest.approx((1.5 + 0.8) / 2)
    dual, _ = clipped_pg_loss(logprobs, batch, ClippedPGSettings(ratio_clip_c=1.4))
    assert dual.item() == pytest.approx((1.4 + 0.8) / 2)


def test_loss_divides_by_the_global_token_count():
    logprobs, batch = _batch([0.0, math.log(1.5), math.log(0.5)], [0.0, 0.0, 0.0], 1.0, tokens=4)
    loss, _ = clipped_pg_loss(logprobs, batch)
    assert loss.item() == pytest.approx(-0.85 / 2)


def test_micro_batch_losses_sum_to_the_full_batch_loss():
    torch.manual_seed(0)
    size, length = 6, 5
    mask = torch.rand(size, length) > 0.3
    mask[:, 0] = False
    batch = with_global_counts(TrainBatch(
        input_ids=torch.zeros((size, length), dtype=torch.long),
        attention_mask=torch.ones((size, length), dtype=torch.bool),
        loss_mask=mask, advantages=torch.randn(size),
        generator_logprobs=torch.zeros(size, length), old_logprobs=-torch.rand(size, length)))
    logprobs = -torch.rand(size, length)
    for token_level in (True, False):
        settings = ClippedPGSettings(token_level_loss=token_level)
        full, _ = clipped_pg_loss(logprobs, batch, settings)
        parts = sum(float(clipped_pg_loss(logprobs[i:i + 2], batch.slice(i, i + 2), settings)[0])
                    for i in range(0, size, 2))
        assert parts == pytest.approx(float(full), abs=1e-6)


def test_kl_penalty_uses_k3():
    logprobs, batch = _batch([0.0, math.log(0.5)], [0.0, math.log(0.5)], 0.0, ref=[0.0, math.log(0.25)])
    loss, metrics = clipped_pg_loss(logprobs, batch, ClippedPGSettings(reference_policy_kl_penalty=0.1))
    k3 = 0.5 + math.log(2) - 1  # exp(log .5) - log .5 - 1
    assert float(metrics["kl_to_reference"]) == pytest.approx(k3, abs=1e-6)
    assert loss.item() == pytest.approx(0.1 * k3, abs=1e-6)  # advantage 0: only the KL term


def test_kl_estimators_by_hand():
    p, q = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    assert float(KL_ESTIMATORS.get("k1")(p, q)) == pytest.approx(math.log(2))
    assert float(KL_ESTIMATORS.get("k2")(p, q)) == pytest.approx(0.5 * math.log(2) ** 2)
    assert float(KL_ESTIMATORS.get("k3")(p, q)) == pytest.approx(0.5 + math.log(2) - 1)
    assert float(KL_ESTIMATORS.get("k3")(p, p)) == 0.0


def test_make_loss_reads_the_config():
    loss_fn = make_loss(LossConfig(ratio_clip_min=0.1, ratio_clip_max=0.1))
    logprobs, batch = _batch([0.0, math.log(1.5)], [0.0, 0.0], 1.0)
    loss, _ = loss_fn(logprobs, batch)
    assert loss.item() == pytest.approx(-1.1)


def test_logprob_mismatch_mean_and_max_by_hand():
    from novarl.trainer.rollout import MISMATCH_WARNING, logprob_mismatch, mismatch_advice

    _, batch = _batch([0.0, 0.0, 0.0], [0.0, math.log(0.5), math.log(0.5)], 1.0)
    batch.generator_logprobs = torch.tensor([[0.0, math.log(0.5), math.log(0.6)]])
    got = logprob_mismatch(batch)
    # ratios 1.0 and 1.2 on the two loss tokens -> |r - 1| = 0 and 0.2
    assert got["logprob_mismatch"] == pytest.approx(0.1)
    assert got["logprob_mismatch_max"] == pytest.approx(0.2)
    assert got["logprob_mismatch"] > MISMATCH_WARNING
    assert "vllm_cfg.precision" in mismatch_advice(got["logprob_mismatch"])
