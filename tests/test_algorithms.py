"""Advantages, losses and KL estimators against hand-computed values."""

import math

import pytest
import torch

from novarl.algorithms.advantages import (ADVANTAGE_ESTIMATORS, AdvantageSettings, grpo_advantages,
                                          reinforce_plus_plus_advantages, rloo_advantages)
from novarl.algorithms.kl import KL_ESTIMATORS
from novarl.algorithms.losses import ClippedPGSettings, clipped_pg_loss, make_loss
from novarl.config.schema import LossConfig
from novarl.errors import ConfigError
from novarl.models.scores import Logprobs
from novarl.types import TrainBatch


def test_grpo_advantages_normalised_by_group_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    adv = grpo_advantages(rewards, 4)
    # group 1: mean 0.5, unbiased std sqrt(1/3) -> +-0.5 / 0.57735 = +-0.866; group 2: no signal.
    expected = [0.866025, -0.866025, -0.866025, 0.866025, 0, 0, 0, 0]
    assert adv.tolist() == pytest.approx(expected, abs=1e-5)


def test_grpo_advantages_leave_one_out_without_normalisation():
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 4,
                          AdvantageSettings(normalize_rewards=False, use_leave_one_out_baseline=True))
    # r=1: others average 1/3 -> 2/3; r=0: others average 2/3 -> -2/3.
    assert adv.tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])


def test_grpo_advantages_reject_ragged_groups():
    with pytest.raises(ValueError, match="groups of 3"):
        grpo_advantages(torch.ones(4), 3)


def test_registry_unknown_name_names_the_key():
    with pytest.raises(ConfigError, match="grpo.adv_estimator.name='nope'.*known: grpo, reinforce_plus_plus, rloo"):
        ADVANTAGE_ESTIMATORS.get("nope")


def test_rloo_is_leave_one_out_without_normalisation():
    adv = rloo_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0]), 3)
    # group 1: 1 - 0 = 1, 0 - 1/2, 0 - 1/2; group 2: 0 - 2, 2 - 1, 2 - 1
    assert adv.tolist() == pytest.approx([1.0, -0.5, -0.5, -2.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="at least 2 generations"):
        rloo_advantages(torch.ones(3), 1)


def test_reinforce_plus_plus_normalises_over_the_step_by_tokens():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    # minus_baseline: group means 0.5 and 1 -> [0.5, -0.5, 0, 0]; token counts 1, 1, 2, 0:
    # token-weighted mean (0.5 - 0.5 + 0) / 4 = 0, variance (0.25 + 0.25 + 0) / 4 = 0.125
    adv = reinforce_plus_plus_advantages(rewards, 2, AdvantageSettings(), torch.tensor([1, 1, 2, 0]))
    assert adv.tolist() == pytest.approx([0.5 / 0.125**0.5, -0.5 / 0.125**0.5, 0.0, 0.0], abs=1e-6)
    # without the baseline, each sequence weighing 1: mean 0.75, variance 0.1875
    plain = reinforce_plus_plus_advantages(rewards, 2, AdvantageSettings(minus_baseline=False))
    assert plain.tolist() == pytest.approx([(r - 0.75) / 0.1875**0.5 for r in rewards.tolist()], abs=1e-6)
    # a step whose rewards are all equal: 0, not a division by 0
    assert reinforce_plus_plus_advantages(torch.ones(4), 2).tolist() == [0.0] * 4


def test_reinforce_plus_plus_with_the_kl_in_the_reward_by_hand():
    from novarl.algorithms.advantages import reinforce_plus_plus_with_kl

    # two sequences of one group: rewards 1 and 0 -> returns 0.5 and -0.5 (minus the group mean);
    # tokens: [prompt, a, b] and [prompt, c]; KL 0.2 on b, 0.4 on c, coefficient 0.5
    sequence = torch.tensor([0, 0, 0, 1, 1])
    mask = torch.tensor([False, True, True, False, True])
    kl = torch.tensor([0.0, 0.0, 0.2, 0.0, 0.4])
    adv = reinforce_plus_plus_with_kl(torch.tensor([1.0, 0.0]), 2, AdvantageSettings(), kl, sequence, mask, 0.5)
    returns = torch.tensor([0.5, 0.4, -0.7])  # a, b, c: 0.5, 0.5 - 0.1, -0.5 - 0.2
    expected = (returns - returns.mean()) / returns.var(unbiased=False).sqrt()
    assert adv[mask].tolist() == pytest.approx(expected.tolist(), abs=1e-5)
    assert adv[~mask].tolist() == [0.0, 0.0]


def test_gae_by_hand():
    from novarl.algorithms.advantages import gae

    # one row of 3 completion tokens (reward 1 on the last) and a shorter row of 2 (reward 0)
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 9.0]])
    values = torch.tensor([[0.5, 0.6, 0.7], [0.2, 0.4, 9.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    adv, returns = gae(rewards, values, mask, gamma=0.9, lam=0.5)
    # row 1: deltas 0 + 0.9*0.6 - 0.5 = 0.04, 0 + 0.9*0.7 - 0.6 = 0.03, 1 - 0.7 = 0.3
    #        A3 = 0.3, A2 = 0.03 + 0.45*0.3 = 0.165, A1 = 0.04 + 0.45*0.165 = 0.11425
    # row 2 (its third slot masked): deltas 0.9*0.4 - 0.2 = 0.16, 0 - 0.4 = -0.4; A2 = -0.4, A1 = 0.16 - 0.18
    assert adv.flatten().tolist() == pytest.approx([0.11425, 0.165, 0.3, -0.02, -0.4, 0.0], abs=1e-6)
    assert returns.flatten().tolist() == pytest.approx([0.61425, 0.765, 1.0, 0.18, 0.0, 0.0], abs=1e-6)
    # gamma = lambda = 1: every token's advantage is the final reward minus its value
    adv, _ = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    assert adv[0].tolist() == pytest.approx([0.5, 0.4, 0.3])
    with pytest.raises(ValueError, match="lambda"):
        gae(rewards, values, mask, lam=1.5)


def test_clipped_value_loss_by_hand():
    from novarl.algorithms.losses import clipped_value_loss

    values, old, returns = torch.tensor([1.0, 0.0]), torch.tensor([0.5, 0.5]), torch.tensor([2.0, 0.5])
    # token 1: (1 - 2)^2 = 1, clipped 0.5 + 0.2 = 0.7: (0.7 - 2)^2 = 1.69 -> 0.845
    # token 2: (0 - 0.5)^2 = 0.25, clipped 0.3: (0.3 - 0.5)^2 = 0.04 -> max 0.25 -> 0.125
    assert clipped_value_loss(values, old, returns, 0.2).tolist() == pytest.approx([0.845, 0.125])
    assert clipped_value_loss(values, old, returns, None).tolist() == pytest.approx([0.5, 0.125])


def test_reward_scaling_and_dapo_shaping_by_hand():
    from novarl.algorithms.shaping import groups_with_signal, scale_rewards, shape_rewards
    from novarl.config.schema import RewardScalingConfig, RewardShapingConfig

    scaled = scale_rewards(torch.tensor([-1.0, 0.0, 0.5, 2.0]),
                           RewardScalingConfig(enabled=True, source_max=1.0, target_min=-1.0, target_max=1.0))
    assert scaled.tolist() == pytest.approx([-1.0, -1.0, 0.0, 1.0])  # clamped to [0, 1], then onto [-1, 1]
    lengths, cut = torch.tensor([10, 13, 16, 20]), torch.tensor([False, False, False, True])
    dapo = RewardShapingConfig(enabled=True, overlong_buffer_length=4, overlong_buffer_penalty=1.0)
    # expected length 16 - 4 = 12: excess -2, 1, 4, 8 -> penalties 0, -0.25, -1, -2
    shaped = shape_rewards(torch.ones(4), lengths, cut, dapo, max_new_tokens=16)
    assert shaped.tolist() == pytest.approx([1.0, 0.75, 0.0, -1.0])
    stop = RewardShapingConfig(enabled=True, stop_properly_penalty_coef=0.5)
    assert shape_rewards(torch.ones(4), lengths, cut, stop, 16).tolist() == [1.0, 1.0, 1.0, 0.5]
    assert groups_with_signal(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0]), 2).tolist() == [False, True, False]
    with pytest.raises(Exception, match="overlong_buffer_length"):
        RewardShapingConfig(enabled=True)


def test_loss_aggregations_and_the_reinforce_surrogate_by_hand():
    """Two sequences of 1 and 3 loss tokens, ratio 1 everywhere (old = new logprobs)."""
    mask = torch.tensor([[False, True, False, False], [False, True, True, True]])
    batch = TrainBatch.from_rows(torch.zeros((2, 4), dtype=torch.long), torch.ones((2, 4), dtype=torch.bool), mask,
                                 torch.tensor([1.0, -1.0]))
    logprobs = torch.full((8,), -0.5, requires_grad=True)
    batch.old_logprobs = logprobs.detach().clone()
    token_loss = {"token-mean": (-1 + 3) / 4, "seq-mean-token-mean": (-1 + 1) / 2,
                  "seq-mean-token-sum": (-1 + 3) / 2, "seq-mean-token-sum-norm": (-1 / 5 + 3 / 5) / 2}
    for mode, expected in token_loss.items():  # -A per token at ratio 1
        loss, _ = clipped_pg_loss(logprobs, batch, ClippedPGSettings(aggregation=mode, aggregation_norm=5))
        assert float(loss.detach()) == pytest.approx(expected), mode
    # REINFORCE: -A log p, token-mean: (-(1)(-0.5) - 3 (-1)(-0.5)) / 4 = (0.5 - 1.5) / 4
    loss, _ = clipped_pg_loss(logprobs, batch, ClippedPGSettings(disable_ppo_ratio=True))
    assert float(loss.detach()) == pytest.approx(-0.25)
    loss.backward()  # d/dlogp = -A / 4 on each loss token
    assert logprobs.grad.tolist() == pytest.approx([0, -0.25, 0, 0, 0, 0.25, 0.25, 0.25])


def _batch(logprobs_new, old, advantage, ref=None, tokens=None):
    """One sequence: position 0 is the prompt, positions 1.. are trained."""
    length = len(old)
    mask = torch.tensor([False] + [True] * (length - 1))
    batch = TrainBatch.from_rows(torch.zeros((1, length), dtype=torch.long), torch.ones((1, length), dtype=torch.bool),
                                 mask[None], torch.tensor([advantage]), torch.tensor([old]))
    batch.old_logprobs = torch.tensor(old)
    batch.reference_logprobs = None if ref is None else torch.tensor(ref)
    if tokens is not None:
        batch.global_valid_tokens = tokens
    return torch.tensor(logprobs_new, requires_grad=True), batch


def test_clipped_loss_positive_advantage():
    logprobs, batch = _batch([0.0, math.log(1.5), math.log(0.5)], [0.0, 0.0, 0.0], 1.0)
    loss, metrics = clipped_pg_loss(logprobs, batch)
    # ratios 1.5 and 0.5: min(1.5, 1.2) = 1.2 and min(0.5, 0.8) = 0.5 -> -(1.2 + 0.5) / 2
    assert float(loss.detach()) == pytest.approx(-0.85)
    assert float(metrics["clip_fraction"]) == pytest.approx(1.0)
    assert float(metrics["ratio_mean"]) == pytest.approx(1.0)
    loss.backward()
    # Token 1 is clipped (no gradient); token 2 is not: d(-r A / 2)/dlogp = -r A / 2 = -0.25.
    assert logprobs.grad.tolist() == pytest.approx([0.0, 0.0, -0.25])


@pytest.mark.parametrize("generator", ["the policy", "another policy"])
def test_approx_entropy_estimates_the_policys_entropy_from_the_sampled_tokens(generator):
    """NeMo RL's approx_entropy: tokens sampled from the generator q, weighted by p / q, estimate
    the policy p's entropy -sum p log p (Monte Carlo, 40,000 tokens: within 0.02 nats)."""
    generator_rng = torch.Generator().manual_seed(0)
    policy = torch.softmax(torch.randn(50, generator=generator_rng) * 2, 0)
    sampler = policy if generator == "the policy" else torch.softmax(torch.randn(50, generator=generator_rng), 0)
    tokens = torch.multinomial(sampler, 40_000, replacement=True, generator=generator_rng)
    rows = torch.zeros((1, 40_001), dtype=torch.long)
    mask = torch.ones((1, 40_001), dtype=torch.bool)
    loss_mask = mask.clone()
    loss_mask[0, 0] = False
    generated = torch.cat([torch.zeros(1), sampler.log()[tokens]])[None]
    batch = TrainBatch.from_rows(rows, mask, loss_mask, torch.tensor([1.0]), generated)
    logprobs = torch.cat([torch.zeros(1), policy.log()[tokens]])
    _, metrics = clipped_pg_loss(logprobs.requires_grad_(), batch)
    entropy = -(policy * policy.log()).sum().item()
    assert float(metrics["approx_entropy"]) == pytest.approx(entropy, abs=0.02)
    assert entropy > 1.0  # not a degenerate distribution the estimate would match anyway


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
    batch = TrainBatch.from_rows(torch.zeros((size, length), dtype=torch.long),
                                 torch.ones((size, length), dtype=torch.bool), mask, torch.randn(size))
    batch.old_logprobs = -torch.rand(batch.num_tokens)
    logprobs = -torch.rand(batch.num_tokens)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        settings = ClippedPGSettings(aggregation=mode, aggregation_norm=7)
        full, _ = clipped_pg_loss(logprobs, batch, settings)
        parts = sum(float(clipped_pg_loss(logprobs[batch.token_index(range(i, i + 2))], batch.slice(i, i + 2),
                                          settings)[0])
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
    from novarl.rollout.batch import MISMATCH_WARNING, logprob_mismatch, mismatch_advice

    _, batch = _batch([0.0, 0.0, 0.0], [0.0, math.log(0.5), math.log(0.5)], 1.0)
    batch.generator_logprobs = torch.tensor([0.0, math.log(0.5), math.log(0.6)])
    got = logprob_mismatch(batch)
    # ratios 1.0 and 1.2 on the two loss tokens -> |r - 1| = 0 and 0.2
    assert got["logprob_mismatch"] == pytest.approx(0.1)
    assert got["logprob_mismatch_max"] == pytest.approx(0.2)
    assert got["logprob_mismatch"] > MISMATCH_WARNING
    assert "vllm_cfg.precision" in mismatch_advice(got["logprob_mismatch"])


def _random_batch(rows: int = 6, length: int = 10, seed: int = 0) -> TrainBatch:
    """Sequences of 4 to `length` tokens: a 3-token prompt, then a completion."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([4 + row % (length - 3) for row in range(rows)])
    attention_mask = torch.arange(length) < lengths[:, None]
    loss_mask = attention_mask.clone()
    loss_mask[:, :3] = False
    batch = TrainBatch.from_rows(torch.randint(4, 18, (rows, length), generator=gen), attention_mask, loss_mask,
                                 torch.randn(rows, generator=gen),
                                 -torch.rand(rows, length, generator=gen) * loss_mask)
    batch.reference_logprobs = -torch.rand(batch.num_tokens, generator=gen)
    return batch


@pytest.mark.parametrize("token_level", [True, False])
def test_old_logprobs_from_the_training_forward_give_the_same_loss_and_gradient(token_level):
    """One forward fewer: with no old logprobs the loss takes this forward's own, detached; the
    loss, its gradient and the metrics equal those of the same numbers given beforehand, and
    the logprob mismatch is measured from them."""
    from novarl.rollout.batch import logprob_mismatch

    settings = ClippedPGSettings(reference_policy_kl_penalty=0.05,
                                 aggregation="token-mean" if token_level else "seq-mean-token-mean",
                                 use_importance_sampling_correction=True, use_on_policy_kl_approximation=True)
    batch = _random_batch()
    logits = torch.randn(batch.num_tokens, generator=torch.Generator().manual_seed(1)) - 2
    given, fewer = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    batch.old_logprobs = logits.clone()
    loss_given, metrics_given = clipped_pg_loss(given, batch, settings)
    loss_given.backward()
    expected_mismatch = logprob_mismatch(batch)
    batch.old_logprobs = None
    loss_fewer, metrics_fewer = clipped_pg_loss(fewer, batch, settings)
    loss_fewer.backward()
    assert loss_fewer.item() == pytest.approx(loss_given.item(), rel=1e-6)
    torch.testing.assert_close(fewer.grad, given.grad, rtol=1e-6, atol=0)
    assert {k: v.item() for k, v in metrics_given.items()} == \
        pytest.approx({k: v.item() for k, v in metrics_fewer.items() if not k.startswith("logprob_mismatch")})
    assert metrics_fewer["logprob_mismatch"].item() == pytest.approx(expected_mismatch["logprob_mismatch"])
    assert metrics_fewer["logprob_mismatch_max"].item() == pytest.approx(expected_mismatch["logprob_mismatch_max"])


def test_metrics_ending_in_max_are_reduced_by_max():
    from novarl.backends.training.rows import accumulate

    totals: dict = {}
    for value in (0.2, 0.5, 0.1):
        accumulate(totals, {"loss": torch.tensor(value), "logprob_mismatch_max": torch.tensor(value)})
    assert totals["loss"].item() == pytest.approx(0.8) and totals["logprob_mismatch_max"].item() == pytest.approx(0.5)


def test_one_forward_fewer_trains_the_policy_like_two_forwards():
    """A real DTensor policy (one rank): old logprobs from a forward before training, or from the
    training forward itself, give the same loss, gradient norm and updated weights."""
    from novarl.backends.training.dtensor import DTensorPolicy
    from novarl.config import load_config
    from novarl.distributed.local import ensure_single_process_group
    from novarl.models.loading import resolve_model_path

    ensure_single_process_group()
    cfg = load_config(None, overrides=["policy.train_micro_batch_size=3"])
    loss = make_loss(LossConfig(reference_policy_kl_penalty=0.01))
    results = []
    for one_forward_fewer in (False, True):
        torch.manual_seed(0)
        policy = DTensorPolicy(cfg.policy, resolve_model_path("tiny-arith"), torch.device("cpu"), total_steps=4)
        batch = _random_batch()
        batch.old_logprobs = None if one_forward_fewer else policy.forward(batch, Logprobs())
        metrics = {**policy.forward_backward(batch, loss, Logprobs()), **policy.optim_step()}
        weights = {n: t.detach().clone() for n, t in policy.full_state_dict().items()}
        results.append((metrics, weights))
    (two, before), (one, after) = results
    assert one["loss"] == pytest.approx(two["loss"], rel=1e-5)
    assert one["grad_norm"] == pytest.approx(two["grad_norm"], rel=1e-5)
    assert "logprob_mismatch" in one and "logprob_mismatch" not in two
    for name in before:
        torch.testing.assert_close(after[name], before[name], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("token_level", [True, False])
def test_samples_without_advantage_are_left_out_of_the_update_with_the_same_result(token_level):
    """GRPO groups whose rewards are all equal have advantage 0: without a KL penalty they add
    nothing to the loss or its gradient, so the update leaves them out. The same loss,
    gradient norm and weights as training on every sample; the loss's other metrics become
    means over the samples trained on."""
    from novarl.backends.training.dtensor import DTensorPolicy
    from novarl.config import load_config
    from novarl.distributed.local import ensure_single_process_group
    from novarl.models.loading import resolve_model_path
    from novarl.trainer.stages import train_on_batch, with_signal

    ensure_single_process_group()
    cfg = load_config(None, overrides=["policy.train_micro_batch_size=2"])
    loss = make_loss(LossConfig(token_level_loss=token_level))
    batch = _random_batch(rows=8)
    batch.advantages[batch.token_index([1, 2, 5])] = 0.0  # three samples without signal
    noise = torch.rand(batch.num_tokens, generator=torch.Generator().manual_seed(3)) * 0.3
    results = []
    for skip in (False, True):
        torch.manual_seed(0)
        policy = DTensorPolicy(cfg.policy, resolve_model_path("tiny-arith"), torch.device("cpu"), total_steps=4)
        logprobs = policy.forward(batch, Logprobs())
        batch.old_logprobs = logprobs - noise  # ratios away from 1, some clipped
        metrics = train_on_batch(policy, Logprobs(), batch, loss, global_batch_size=8, skip_zero_advantage=skip,
                                 token_level=token_level)
        results.append((metrics, {n: t.detach().clone() for n, t in policy.full_state_dict().items()}))
    (every, before), (skipped, after) = results
    assert skipped["loss"] == pytest.approx(every["loss"], rel=1e-5)
    assert skipped["grad_norm"] == pytest.approx(every["grad_norm"], rel=1e-5)
    assert (every["samples_trained_fraction"], skipped["samples_trained_fraction"]) == (1.0, 5 / 8)
    assert skipped["tokens_computed"] < every["tokens_computed"]
    for name in before:
        torch.testing.assert_close(after[name], before[name], rtol=1e-5, atol=1e-7)
    trained, _ = with_signal(batch.with_own_counts(), token_level)
    assert len(trained) == 5
    ratio = torch.exp(noise[batch.token_index([0, 3, 4, 6, 7])])[trained.loss_mask]
    if token_level:  # the mean over the tokens trained on
        assert skipped["ratio_mean"] == pytest.approx(float(ratio.mean()), rel=1e-5)
