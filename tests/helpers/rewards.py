"""Reward functions for tests whose model is random (exact match would score 0 everywhere)."""


def digit_fraction(completion: str, answer: str) -> float:
    """The share of the completion's characters that are digits: varies across samples of a
    random model, so GRPO's advantages are not all zero."""
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)
