"""The loss's importance-sampling correction (NeMo RL's use_importance_sampling_correction and
truncated importance sampling: tis, icepop, seq-mask-tis) against hand-computed values, and the
settings it refuses."""

from __future__ import annotations

import math

import pytest
import torch

from novarl.algorithms.losses import ClippedPGSettings, clipped_pg_loss, importance_weights
from novarl.config import load_config
from novarl.errors import ConfigError
from novarl.types import TrainBatch


def batch() -> TrainBatch:
    """Two sequences of a prompt token and two completion tokens; pi_old / pi_generator on the
    completion tokens: (2, 0.25) and (1, 1.5)."""
    ones = torch.ones((2, 3), dtype=torch.bool)
    loss_mask = torch.tensor([[False, True, True], [False, True, True]])
    out = TrainBatch.from_rows(torch.tensor([[1, 2, 3], [1, 4, 5]]), ones, loss_mask, torch.tensor([1.0, -1.0]))
    out.old_logprobs = torch.tensor([0.0, math.log(2), math.log(0.25), 0.0, 0.0, math.log(1.5)])
    return out


def weights_of(**settings):
    b = batch()
    weights, metrics = importance_weights(b.old_logprobs, b, ClippedPGSettings(**settings))
    return weights[b.loss_mask].tolist(), {k: float(v) for k, v in metrics.items()}


@pytest.mark.parametrize("settings, weights, oob, mean", [
    ({}, [2.0, 0.25, 1.0, 1.5], None, 4.75 / 4),
    # tis: clamped to [0, 1.5]; one token of four above
    ({"truncation": "tis", "truncation_max": 1.5}, [1.5, 0.25, 1.0, 1.5], 0.25, 4.25 / 4),
    # icepop: tokens outside [0.5, 1.6] get 0
    ({"truncation": "icepop", "truncation_min": 0.5, "truncation_max": 1.6}, [0, 0, 1.0, 1.5], 0.5, 2.5 / 4),
    # seq-mask-tis: geometric means sqrt(0.5) = 0.707 (out of [0.8, 1.3]) and sqrt(1.5) = 1.225 (in)
    ({"truncation": "seq-mask-tis", "truncation_min": 0.8, "truncation_max": 1.3}, [0, 0, 1.0, 1.5], 0.5, 2.5 / 4),
    # sequence-level ratios: each sequence's product, 0.5 and 1.5, on all its tokens
    ({"sequence_level_importance_ratios": True}, [0.5, 0.5, 1.5, 1.5], None, 1.0),
], ids=["plain", "tis", "icepop", "seq-mask-tis", "sequence-level"])
def test_importance_weights_by_hand(settings, weights, oob, mean):
    got, metrics = weights_of(**settings)
    assert got == pytest.approx(weights)
    assert metrics["is_weight_mean"] == pytest.approx(mean) and metrics["is_weight_max"] == pytest.approx(max(weights))
    assert metrics.get("is_oob_ratio") == (None if oob is None else pytest.approx(oob))


def test_the_loss_weighs_each_tokens_loss_by_its_importance_weight():
    b = batch()
    logprobs = b.old_logprobs.clone().requires_grad_(True)  # ratio 1: each token's loss is -A
    plain, _ = clipped_pg_loss(logprobs, b, ClippedPGSettings())
    weighted, metrics = clipped_pg_loss(logprobs, b, ClippedPGSettings(use_importance_sampling_correction=True,
                                                                       truncation="tis", truncation_max=1.5))
    # token-mean over the 4 loss tokens: -(1 x (1.5 + 0.25) - 1 x (1.0 + 1.5)) / 4
    assert float(plain) == pytest.approx(0.0) and float(weighted) == pytest.approx(0.75 / 4)
    assert float(metrics["is_oob_ratio"]) == pytest.approx(0.25)


@pytest.mark.parametrize("overrides, message", [
    (["loss_fn.truncated_importance_sampling_type=tis", "loss_fn.truncated_importance_sampling_ratio=2"],
     "truncates the importance weights of loss_fn.use_importance_sampling_correction, which is false"),
    (["loss_fn.use_importance_sampling_correction=true", "loss_fn.truncated_importance_sampling_type=icepop",
      "loss_fn.truncated_importance_sampling_ratio=5"], "needs loss_fn.truncated_importance_sampling_ratio_min"),
    (["loss_fn.use_importance_sampling_correction=true", "loss_fn.truncated_importance_sampling_type=tis"],
     "needs loss_fn.truncated_importance_sampling_ratio (its upper bound)"),
    (["loss_fn.use_importance_sampling_correction=true", "loss_fn.truncated_importance_sampling_type=tis",
      "loss_fn.truncated_importance_sampling_ratio=2", "loss_fn.truncated_importance_sampling_ratio_min=3"],
     "ratio_min=3.0 is above truncated_importance_sampling_ratio=2.0"),
    (["loss_fn.truncated_importance_sampling_ratio=2"], "is set without loss_fn.truncated_importance_sampling_type"),
    (["loss_fn.use_importance_sampling_correction=true", "loss_fn.truncated_importance_sampling_type=seq-mask-tis",
      "loss_fn.truncated_importance_sampling_ratio=1.002", "loss_fn.truncated_importance_sampling_ratio_min=0.999",
      "loss_fn.sequence_level_importance_ratios=true", "loss_fn.token_level_loss=false"],
     "does not go with sequence_level_importance_ratios"),
    (["loss_fn.sequence_level_importance_ratios=true"], "goes with a per-sequence loss (NeMo RL's rule)"),
    (["loss_fn.use_importance_sampling_correction=true", "loss_fn.truncated_importance_sampling_type=tis2",
      "loss_fn.truncated_importance_sampling_ratio=2"], "'loss_fn.truncated_importance_sampling_type' = 'tis2'"),
])
def test_bad_truncation_settings_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as raised:
        load_config(None, overrides=overrides)
    assert message in str(raised.value)


def test_nemo_rl_truncation_keys_are_read():
    cfg = load_config({"loss_fn": {"use_importance_sampling_correction": True,
                                   "truncated_importance_sampling_type": "icepop",
                                   "truncated_importance_sampling_ratio": 5.0,
                                   "truncated_importance_sampling_ratio_min": 0.5}})
    loss = cfg.loss_fn
    assert (loss.truncated_importance_sampling_type, loss.truncated_importance_sampling_ratio_min) == ("icepop", 0.5)
    assert cfg.load_warnings == ()


def test_a_non_finite_ratio_gets_weight_zero_and_zeroes_its_sequence_with_sequence_ratios():
    b = batch()
    b.generator_logprobs = b.generator_logprobs.clone()
    b.generator_logprobs[1] = float("-inf")  # a token the generator gave no probability: ratio inf
    b.generator_logprobs[5] = float("nan")
    weights, _ = importance_weights(b.old_logprobs, b, ClippedPGSettings())
    assert weights[b.loss_mask].tolist() == [0.0, 0.25, 1.0, 0.0]
    per_sequence, _ = importance_weights(b.old_logprobs, b, ClippedPGSettings(sequence_level_importance_ratios=True))
    assert per_sequence[b.loss_mask].tolist() == [0.0, 0.0, 0.0, 0.0]
