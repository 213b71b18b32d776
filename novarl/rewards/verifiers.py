"""Verifiable rewards: functions of (completion, reference answer) -> float."""

from __future__ import annotations

import re


def exact_match(completion: str, answer: str) -> float:
    """1.0 if the completion equals the answer (surrounding whitespace ignored), else 0.0.

    `completion` is the decoded generated text with special tokens removed.
    """
    return 1.0 if completion.strip() == answer.strip() else 0.0


CROSSTHINKQA_TABLE = {"loose": (1.0, 1.0, -1.0, -1.0), "soft": (1.0, 0.5, -0.5, -1.0),
                      "strict": (1.0, -1.0, -1.0, -1.0)}
"""ROLL's CrossThinkQA rule rewards by reward_type: (right and boxed, right only, boxed only, neither)."""
_BOXED = re.compile(r"\\boxed\{([^}]+)\}")
_ANSWER_IS = re.compile(r"answer is", re.IGNORECASE)


def crossthinkqa(completion: str, answer: str, reward_type: str = "soft") -> float:
    """ROLL's CrossThinkQA rule (a multiple-choice letter): the last \\boxed{...} after the last
    </think> (else what follows the last "answer is", else the whole answer) is right when its first
    capital letter is the answer's first character; the reward is CROSSTHINKQA_TABLE's for
    `reward_type`, plus repetition_penalty of the completion."""
    text = completion.rpartition("</think>")[2]
    boxed = _BOXED.findall(text)
    if boxed:
        chosen = boxed[-1]
    else:
        parts = _ANSWER_IS.split(text)
        chosen = parts[-1] if len(parts) > 1 else text
    letter = next((ch for ch in chosen if ch.isupper()), None)
    right = bool(answer) and letter == str(answer).strip()[:1]
    table = CROSSTHINKQA_TABLE[reward_type]
    value = table[0] if right and boxed else table[1] if right else table[2] if boxed else table[3]
    return value + repetition_penalty(completion)


def crossthinkqa_loose(completion: str, answer: str) -> float:
    return crossthinkqa(completion, answer, "loose")


def crossthinkqa_strict(completion: str, answer: str) -> float:
    return crossthinkqa(completion, answer, "strict")


def repetition_penalty(text: str, weight: float = 0.5) -> float:
    """-weight x the share of repeated word 3-grams (ROLL's rule workers add it): 0 for a text
    without repeats or of fewer than 3 words."""
    words = text.lower().split()
    grams = [tuple(words[i:i + 3]) for i in range(len(words) - 2)]
    return -weight * (1 - len(set(grams)) / len(grams)) if grams else 0.0
