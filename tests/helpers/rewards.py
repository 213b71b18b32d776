"""Reward functions for tests whose model is random (exact match would score 0 everywhere)."""


def digit_fraction(completion: str, answer: str) -> float:
    """The share of the completion's characters that are digits: varies across samples of a
    random model, so GRPO's advantages are not all zero."""
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)


def constant(completion: str, answer: str) -> float:
    """The same reward for every completion: no GRPO group ever carries a signal."""
    return 1.0
