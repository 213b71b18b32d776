"""KL estimators between the policy and a reference, per token.

Each takes logprobs [..., L] of the sampled tokens under the policy and under
the reference and returns a per-token estimate of KL(policy || reference) with
the same shape (Schulman, "Approximating KL divergence").
"""

from __future__ import annotations

import torch

from novarl.algorithms.registry import Registry

KL_ESTIMATORS: Registry = Registry("KL estimator", "loss_fn.kl_estimator")


@KL_ESTIMATORS.register("k1")
def kl_k1(logprobs: torch.Tensor, reference_logprobs: torch.Tensor) -> torch.Tensor:
    """log p - log q: unbiased, high variance, can be negative."""
    return logprobs - reference_logprobs


@KL_ESTIMATORS.register("k2")
def kl_k2(logprobs: torch.Tensor, reference_logprobs: torch.Tensor) -> torch.Tensor:
    """(log p - log q)^2 / 2: biased, low variance, non-negative."""
    return 0.5 * (logprobs - reference_logprobs) ** 2


@KL_ESTIMATORS.register("k3")
def kl_k3(logprobs: torch.Tensor, reference_logprobs: torch.Tensor) -> torch.Tensor:
    """exp(log q - log p) - (log q - log p) - 1: unbiased, low variance, non-negative."""
    log_ratio = reference_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1
