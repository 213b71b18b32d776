"""Verifiable rewards: functions of (completion, reference answer) -> float."""

from __future__ import annotations


def exact_match(completion: str, answer: str) -> float:
    """1.0 if the completion equals the answer (surrounding whitespace ignored), else 0.0.

    `completion` is the decoded generated text with special tokens removed.
    """
    return 1.0 if completion.strip() == answer.strip() else 0.0
