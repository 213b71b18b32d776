"""NeMo RL's loss variants against hand-computed values: CISPO (loss_fn.use_cispo), VAPO's
positive-example NLL (loss_fn.positive_example_nll_weight) and the masking of sequences by their
logprob error (grpo.seq_logprob_error_threshold); the settings refused with them; each through
the real loop in tests/test_algorithm_loop.py."""

from __future__ import annotations

import math

import pytest
import torch

from novarl.algorithms.losses import ClippedPGSettings, clipped_pg_loss, positive_example_nll
from novarl.backends.training.batching import micro_batch
from novarl.config import load_config
from novarl.errors import ConfigError
from novarl.rollout.batch import build_train_batch
from novarl.trainer.stages import LogprobErrorMask, StepWork, one_forward_fewer, zero_advantage_trains_nothing
from novarl.types import Completion, Prompt, TrainBatch


def two_sequences() -> TrainBatch:
    """Two sequences of a prompt token and two completion tokens, advantages +1 and -1; the
    ratios pi / pi_old on the completion tokens: 1.5, 0.5 (sequence 0) and 1.1, 0.7 (sequence 1)."""
    ones = torch.ones((2, 3), dtype=torch.bool)
    loss_mask = torch.tensor([[False, True, True], [False, True, True]])
    out = TrainBatch.from_rows(torch.tensor([[1, 2, 3], [1, 4, 5]]), ones, loss_mask, torch.tensor([1.0, -1.0]))
    out.old_logprobs = torch.tensor([0.0, -1.0, -1.0, 0.0, -2.0, -0.5])
    return out


RATIOS = torch.tensor([1.0, 1.5, 0.5, 1.0, 1.1, 0.7])


def loss_and_grad(batch: TrainBatch, settings: ClippedPGSettings) -> tuple[float, torch.Tensor, dict]:
    logprobs = (batch.old_logprobs + RATIOS.log()).requires_grad_(True)
    loss, metrics = clipped_pg_loss(logprobs, batch, settings)
    loss.backward()
    return float(loss.detach()), logprobs.grad, metrics


# ------------------------------------------------------------------ CISPO
def test_cispo_weighs_each_tokens_reinforce_gradient_by_its_clipped_ratio():
    """CISPO: loss_t = -sg(clip(r, 0.8, 1.2)) A log p, so d loss / d log p_t = -clip(r_t) A_t / 4 on
    each of the 4 loss tokens: the clipped ones (1.5 and 0.5 with A = +1, 0.7 with A = -1) keep a
    gradient, where PPO's clip gives them none."""
    batch = two_sequences()
    logprobs = batch.old_logprobs + RATIOS.log()
    clipped, advantages = [1.2, 0.8, 1.1, 0.8], [1.0, 1.0, -1.0, -1.0]
    loss, grad, metrics = loss_and_grad(batch, ClippedPGSettings(use_cispo=True))
    tokens = logprobs[batch.loss_mask].tolist()
    assert loss == pytest.approx(-sum(c * a * lp for c, a, lp in zip(clipped, advantages, tokens)) / 4)
    assert grad[batch.loss_mask].tolist() == pytest.approx([-c * a / 4 for c, a in zip(clipped, advantages)])
    assert grad[~batch.loss_mask].tolist() == [0.0, 0.0]
    assert float(metrics["clip_fraction"]) == pytest.approx(3 / 4)
    # PPO: a token whose clipped side is the minimum has no gradient (1.5 with A > 0, 0.7 with A < 0), and
    # 0.5 with A > 0 keeps the unclipped r: -r A / 4 (the gradient of r is r)
    _, ppo, _ = loss_and_grad(two_sequences(), ClippedPGSettings())
    assert ppo[batch.loss_mask].tolist() == pytest.approx([0.0, -0.5 / 4, 1.1 / 4, 0.0])


def test_cispo_is_weighed_by_the_importance_weights_and_is_reinforce_at_ratio_one():
    batch = two_sequences()
    batch.generator_logprobs = batch.old_logprobs - math.log(2)  # pi_old / pi_generator = 2 on every token
    plain, grad, _ = loss_and_grad(batch, ClippedPGSettings(use_cispo=True))
    weighted, weighted_grad, metrics = loss_and_grad(batch, ClippedPGSettings(use_cispo=True,
                                                                              use_importance_sampling_correction=True))
    assert weighted == pytest.approx(2 * plain) and torch.allclose(weighted_grad, 2 * grad)
    assert float(metrics["is_weight_mean"]) == pytest.approx(2.0)
    # the old logprobs from the training forward (None): r = 1, loss -A log p, REINFORCE's
    batch = two_sequences()
    batch.old_logprobs = None
    logprobs = torch.tensor([0.0, -1.0, -1.0, 0.0, -2.0, -0.5], requires_grad=True)
    cispo, _ = clipped_pg_loss(logprobs, batch, ClippedPGSettings(use_cispo=True))
    reinforce, _ = clipped_pg_loss(logprobs, batch, ClippedPGSettings(disable_ppo_ratio=True))
    assert float(cispo.detach()) == pytest.approx(float(reinforce.detach()))


@pytest.mark.parametrize("override, says", [
    ("loss_fn.disable_ppo_ratio=true", "removes the ratio CISPO clips"),
    ("loss_fn.force_on_policy_ratio=true", "forces the ratio CISPO clips to 1"),
    ("loss_fn.ratio_clip_c=3", "dual clipping is PPO's"),
])
def test_cispo_refuses_what_nemo_rl_refuses_with_it(override, says):
    with pytest.raises(ConfigError) as raised:
        load_config(None, overrides=["loss_fn.use_cispo=true", override])
    assert f"loss_fn.use_cispo does not go with {override.replace('=true', '=True').replace('=3', '=3.0')}" \
        in str(raised.value) and says in str(raised.value)
    with pytest.raises(ConfigError, match="CISPO's ratios are per token"):
        load_config(None, overrides=["loss_fn.use_cispo=true", "loss_fn.sequence_level_importance_ratios=true",
                                     "loss_fn.token_level_loss=false"])


# ------------------------------------------------------------------ VAPO's positive-example NLL
def completion(prompt_ids: list[int], token_ids: list[int]) -> Completion:
    prompt = Prompt(text="p", token_ids=prompt_ids, answer="a")
    return Completion(prompt=prompt, token_ids=token_ids, logprobs=[-0.5] * len(token_ids), text="c",
                      finish_reason="stop", policy_version=0)


def positive_batch() -> TrainBatch:
    """Three samples of 2, 3 and 1 completion tokens; the first and the third correct."""
    completions = [completion([1], [2, 3]), completion([1, 4], [5, 6, 7]), completion([1], [8])]
    return build_train_batch(completions, torch.tensor([0.5, -0.5, 0.0]), positive=torch.tensor([True, False, True]))


def test_the_nll_term_is_the_mean_nll_of_the_correct_samples_tokens_over_the_whole_step():
    batch = positive_batch()
    assert batch.global_positive_tokens == 3 and batch.global_valid_tokens == 6
    logprobs = torch.linspace(-3, -0.1, batch.num_tokens)
    positive = [float(lp) for lp, on in zip(logprobs, batch.positive_mask()) if on]
    assert positive_example_nll(logprobs, batch) == pytest.approx(-sum(positive) / 3)
    # micro-batches' shares add up to the step's mean (each divides by the step's count), an empty one's is 0
    shares = [positive_example_nll(logprobs[batch.token_index(part)], micro_batch(batch, part))
              for part in ([0], [1, 2])]
    empty = micro_batch(batch, None)
    assert float(sum(shares)) == pytest.approx(-sum(positive) / 3)
    assert float(positive_example_nll(torch.zeros(1), empty)) == 0.0 and not bool(empty.positive.any())
    # the loss adds mu x the term; its gradient on a correct sample's token is -mu / 3 beside the PPO term's
    grads = []
    for mu in (0.0, 0.1):
        lp = logprobs.clone().requires_grad_(True)
        loss, metrics = clipped_pg_loss(lp, batch, ClippedPGSettings(positive_example_nll_weight=mu))
        loss.backward()
        grads.append(lp.grad)
    extra = grads[1] - grads[0]
    assert extra[batch.positive_mask()].tolist() == pytest.approx([-0.1 / 3] * 3)
    assert extra[~batch.positive_mask()].abs().max() == 0
    assert float(metrics["nll_loss"]) == pytest.approx(-sum(positive) / 3)


def test_vapo_marks_correct_samples_by_the_shaped_reward_and_keeps_zero_advantage_samples():
    from novarl.rollout.collect import Rollouts

    cfg = load_config(None, overrides=["loss_fn.positive_example_nll_weight=0.1", "grpo.num_generations_per_prompt=2",
                                       "grpo.num_prompts_per_step=1"])
    completions = [completion([1], [2]), completion([1], [3])]
    # the task's 1 and 0.5 (partial credit) scaled onto [-1, 1]: 1 and 0; positive is read after it, as NeMo
    # RL's PPO reads its rewards
    rollouts = Rollouts.of(cfg, completions, torch.tensor([1.0, 0.5]), torch.tensor([1.0, 0.0]), {})
    assert rollouts.positive.tolist() == [True, False]
    assert Rollouts.of(load_config(None), completions, torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.0]),
                       {}).positive is None
    # a group whose rewards are all equal has no advantage, but its correct samples still get the NLL
    assert zero_advantage_trains_nothing(load_config(None)) and not zero_advantage_trains_nothing(cfg)


# ------------------------------------------------------------------ masking by logprob error
def test_sequences_whose_logprob_error_exceeds_the_threshold_get_no_loss():
    """Per sequence, the mean over its loss tokens of exp(|log p_generator - log p_old|): 1.0 for the
    first, (e^0.1 + e^0.3) / 2 = 1.227 for the second, e^0.5 = 1.649 for the third; at a threshold of
    1.5 the third is masked, and the step's counts leave it out."""
    completions = [completion([1], [2, 3]), completion([1, 4], [5, 6]), completion([1], [8])]
    batch = build_train_batch(completions, torch.zeros(3))
    batch.old_logprobs = batch.generator_logprobs.clone()
    batch.old_logprobs[batch.token_index([1])[2:]] += torch.tensor([0.1, -0.3])
    batch.old_logprobs[batch.token_index([2])[1:]] -= 0.5
    work = StepWork(batch, rewards=torch.tensor([1.0, 0.0, 1.0]))
    LogprobErrorMask(1.5)(work)
    errors = [1.0, (math.exp(0.1) + math.exp(0.3)) / 2, math.exp(0.5)]
    assert batch.sequence_sum(batch.loss_mask.long()).tolist() == [2, 2, 0]
    assert (batch.global_valid_tokens, batch.global_valid_sequences) == (4, 2)
    m = work.metrics
    assert (m["max_seq_mult_prob_error"], m["mean_seq_mult_prob_error"], m["min_seq_mult_prob_error"]) == \
        pytest.approx((errors[2], sum(errors) / 3, 1.0))
    assert (m["max_seq_mult_prob_error_after_mask"], m["min_seq_mult_prob_error_after_mask"]) == \
        pytest.approx((errors[1], 1.0))
    assert m["num_masked_seqs_by_logprob_error"] == 1 and m["masked_correct_pct"] == 1.0
    # under the lowest error, nothing is masked and nothing changes
    again = build_train_batch(completions, torch.zeros(3))
    again.old_logprobs = batch.old_logprobs
    work = StepWork(again, rewards=torch.tensor([1.0, 0.0, 1.0]))
    LogprobErrorMask(2.0)(work)
    assert work.metrics["num_masked_seqs_by_logprob_error"] == 0 and again.global_valid_tokens == 5


def test_the_threshold_needs_the_forward_before_training():
    from types import SimpleNamespace

    inputs = SimpleNamespace(batches=SimpleNamespace(optimizer_steps_per_step=1))
    assert one_forward_fewer(load_config(None), inputs)
    assert not one_forward_fewer(load_config(None, overrides=["grpo.seq_logprob_error_threshold=1.5"]), inputs)
    with pytest.raises(ConfigError, match="seq_logprob_error_threshold"):
        load_config(None, overrides=["grpo.seq_logprob_error_threshold=0.5"])  # exp(|.|) >= 1: it would mask all


def test_nemo_rl_files_with_these_keys_load_and_are_read():
    cfg = load_config({"loss_fn": {"use_cispo": True, "positive_example_nll_weight": 0.1, "ratio_clip_c": None},
                       "grpo": {"seq_logprob_error_threshold": 1.5}})
    assert cfg.loss_fn.use_cispo and cfg.loss_fn.positive_example_nll_weight == 0.1
    assert cfg.grpo.seq_logprob_error_threshold == 1.5 and cfg.load_warnings == ()
