"""loss_fn.force_on_policy_ratio (NeMo RL's ClippedPGLossFn, nemo_rl/algorithms/loss/loss_functions.py
at 7ea279a): the ratio is exp(log p - log p detached), 1 with the gradient of log p, never clipped;
pi_old is the training forward's own. Its rules (grpo.py's setup) are refused at load."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from novarl.algorithms.losses import ClippedPGSettings, clipped_pg_loss, make_loss
from novarl.config import load_config
from novarl.config.schema import LossConfig
from novarl.errors import ConfigError
from novarl.types import TrainBatch

FORCED = ClippedPGSettings(force_on_policy_ratio=True)


def _one_sequence(new: list[float], old: list[float], advantage: float, generator: list[float] | None = None):
    """One sequence: position 0 is the prompt, positions 1.. are trained (token-mean over them)."""
    mask = torch.tensor([[False] + [True] * (len(new) - 1)])
    generator = torch.tensor([generator if generator is not None else [0.0] * len(new)])
    batch = TrainBatch.from_rows(torch.zeros(mask.shape, dtype=torch.long), torch.ones(mask.shape, dtype=torch.bool),
                                 mask, torch.tensor([advantage]), generator)
    batch.old_logprobs = torch.tensor(old)
    return torch.tensor(new, requires_grad=True), batch


def _loss_and_grad(new, batch, settings):
    logprobs = new.detach().clone().requires_grad_()
    loss, metrics = clipped_pg_loss(logprobs, batch, settings)
    loss.backward()
    return loss.item(), logprobs.grad.tolist(), {k: v.item() for k, v in metrics.items()}


def test_the_forced_ratio_is_one_with_the_gradient_of_log_p_and_no_clipping():
    new, batch = _one_sequence([0.0, math.log(1.5), math.log(0.5), math.log(2.0)], [0.0] * 4, 1.0)
    # PPO: ratios 1.5, 0.5, 2 -> min(r, clip(r)) = 1.2, 0.5, 1.2; only token 2 inside the clip has a gradient
    loss, grad, _ = _loss_and_grad(new, batch, ClippedPGSettings())
    assert loss == pytest.approx(-(1.2 + 0.5 + 1.2) / 3)
    assert grad == pytest.approx([0.0, 0.0, -0.5 / 3, 0.0])
    # forced: every ratio is 1 (the old logprobs given are not read) and every token has -A / 3
    loss, grad, metrics = _loss_and_grad(new, batch, FORCED)
    assert loss == pytest.approx(-1.0)
    assert grad == pytest.approx([0.0, -1 / 3, -1 / 3, -1 / 3])
    assert (metrics["ratio_mean"], metrics["clip_fraction"], metrics["kl_to_old"]) == pytest.approx((1.0, 0.0, 0.0))


@pytest.mark.parametrize("other", [
    dict(disable_ppo_ratio=True),  # REINFORCE's -A log p would be -(log 1.5 + log 0.5 + log 2) / 3
    dict(sequence_level_importance_ratios=True, aggregation="seq-mean-token-mean"),  # GSPO's sequence ratio
    dict(ratio_clip_c=3.0),  # dual clipping: min(-A r, -A c) = -A r for A < 0 at r = 1
], ids=["reinforce", "gspo", "dual-clip"])
def test_the_forced_ratio_wins_over_the_other_ratio_switches(other):
    new, batch = _one_sequence([0.0, math.log(1.5), math.log(0.5), math.log(2.0)], [0.0] * 4, -1.0)
    loss, grad, _ = _loss_and_grad(new, batch, ClippedPGSettings(force_on_policy_ratio=True, **other))
    assert loss == pytest.approx(1.0)
    assert grad == pytest.approx([0.0, 1 / 3, 1 / 3, 1 / 3])


def test_importance_weights_under_a_forced_ratio_take_pi_old_from_this_forward():
    # pi_old = this forward's (2, 0.5, 1 over the generator's 1): not the stale old logprobs given (-5)
    new, batch = _one_sequence([0.0, math.log(2.0), math.log(0.5), 0.0], [0.0, -5.0, -5.0, -5.0], 1.0)
    settings = ClippedPGSettings(force_on_policy_ratio=True, use_importance_sampling_correction=True)
    loss, grad, metrics = _loss_and_grad(new, batch, settings)
    assert loss == pytest.approx(-(2.0 + 0.5 + 1.0) / 3)
    assert grad == pytest.approx([0.0, -2 / 3, -0.5 / 3, -1 / 3])  # the weights carry no gradient
    assert metrics["is_weight_mean"] == pytest.approx(3.5 / 3) and metrics["is_weight_max"] == pytest.approx(2.0)
    # truncated (tis at 1.5): -(1.5 + 0.5 + 1) / 3
    loss, _, metrics = _loss_and_grad(new, batch, ClippedPGSettings(
        force_on_policy_ratio=True, use_importance_sampling_correction=True, truncation="tis", truncation_max=1.5))
    assert loss == pytest.approx(-1.0) and metrics["is_oob_ratio"] == pytest.approx(1 / 3)


def test_forcing_equals_one_forward_fewer_and_ignores_a_separate_forwards_noise():
    """In novarl's synchronous loop with one optimizer step per batch the old logprobs are the
    training forward's own (old_logprobs None): the forced ratio gives the same loss and gradient.
    Given old logprobs with a forward's noise (1e-3), the forced loss does not read them."""
    gen = torch.Generator().manual_seed(0)
    mask = torch.rand(3, 8, generator=gen) > 0.3
    mask[:, 0] = False
    batch = TrainBatch.from_rows(torch.zeros((3, 8), dtype=torch.long), torch.ones((3, 8), dtype=torch.bool), mask,
                                 torch.randn(3, generator=gen), -torch.rand(3, 8, generator=gen))
    batch.reference_logprobs = -torch.rand(batch.num_tokens, generator=gen)
    logits = -torch.rand(batch.num_tokens, generator=gen) - 0.1
    common = dict(reference_policy_kl_penalty=0.05, use_importance_sampling_correction=True)
    loss, grad, _ = _loss_and_grad(logits, batch, ClippedPGSettings(**common))  # old_logprobs None
    batch.old_logprobs = logits + 1e-3 * torch.randn(batch.num_tokens, generator=gen)
    forced_loss, forced_grad, _ = _loss_and_grad(logits, batch, ClippedPGSettings(force_on_policy_ratio=True, **common))
    assert forced_loss == pytest.approx(loss, rel=1e-6)
    assert forced_grad == pytest.approx(grad, rel=1e-6, abs=1e-9)


def test_make_loss_reads_force_on_policy_ratio():
    assert make_loss(LossConfig(force_on_policy_ratio=True)).keywords["settings"].force_on_policy_ratio
    assert not make_loss(LossConfig()).keywords["settings"].force_on_policy_ratio


# ------------------------------------------------------------------ NeMo RL's rules, refused at load
FORCE = "loss_fn.force_on_policy_ratio=true"
SMALL = ["grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=2"]  # 8 samples per step


@pytest.mark.parametrize("overrides, says", [
    (["policy.train_global_batch_size=4"], "policy.train_global_batch_size=4 must equal grpo.num_prompts_per_step x "
                                           "grpo.num_generations_per_prompt = 4 x 2 = 8; set it to 8"),
    (["grpo.gradient_accumulation_steps=2"], "set policy.train_global_batch_size=8"),
    (["grpo.ppo_epochs=2"], "grpo.ppo_epochs=2 trains each batch again"),
    (["loss_fn.use_kl_in_reward=true", "loss_fn.reference_policy_kl_penalty=0.1"], "as NeMo RL refuses it"),
], ids=["global-batch", "accumulation", "ppo-epochs", "kl-in-reward"])
def test_more_than_one_update_per_batch_is_refused_naming_the_key(overrides, says):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides=[FORCE, *SMALL, *overrides])
    (line,) = [line for line in str(info.value).splitlines() if line.startswith("  - ")]
    assert line.startswith(f"  - {FORCE} ") and says in line, line


def test_one_update_per_batch_loads_and_the_log_says_the_ratio_is_forced():
    from novarl.trainer.grpo import old_logprobs_source

    for extra in ([], ["policy.train_global_batch_size=8"],
                  ["loss_fn.use_kl_in_reward=true", "loss_fn.reference_policy_kl_penalty=0"]):
        cfg = load_config(None, overrides=[FORCE, *SMALL, *extra])
        assert cfg.loss_fn.force_on_policy_ratio
    inputs = SimpleNamespace(batches=SimpleNamespace(optimizer_steps_per_step=1))
    line = old_logprobs_source(load_config(None, overrides=[FORCE, *SMALL]), inputs)
    assert line.startswith("loss_fn.force_on_policy_ratio: the ratio is 1") and "still runs" not in line
