"""Two-digit addition: the bundled task that the tiny model is trained on.

Every ordered pair (a, b) with 10 <= a, b <= 99 gives one example, prompt
``"ab+cd="`` and answer ``str(a + b)`` (e.g. ``"37+58="`` -> ``"95"``): 8,100 in
all. The validation split is a fixed set of 1,000 pairs drawn with
``random.Random(1234).sample`` from the sorted pairs; the train split is the
other 7,100, in sorted order. Both are deterministic.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from functools import lru_cache

SPLITS = ("train", "validation")
VALIDATION_SIZE = 1_000
VALIDATION_SEED = 1234


@dataclass(frozen=True)
class Example:
    prompt: str | tuple[dict[str, str], ...]
    """The question, e.g. "37+58=", or chat messages ({"role": "system" | "user" | "assistant",
    "content": text}, ending with the user's turn) that the tokenizer's chat template renders."""
    answer: str  # e.g. "95"
    columns: Mapping[str, Any] = field(default_factory=dict, compare=False)
    """The row's other fields (the answer's too; not the prompt's), for the reward."""


@lru_cache(maxsize=None)
def _split_pairs() -> dict[str, tuple[tuple[int, int], ...]]:
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    held_out = set(random.Random(VALIDATION_SEED).sample(pairs, VALIDATION_SIZE))
    return {
        "train": tuple(p for p in pairs if p not in held_out),
        "validation": tuple(p for p in pairs if p in held_out),
    }


def arithmetic_examples(split: str) -> list[Example]:
    """The examples of `split` ("train": 7,100 or "validation": 1,000), sorted by (a, b)."""
    if split not in SPLITS:
        raise ValueError(f"Unknown split {split!r} for the arithmetic task; allowed: {', '.join(SPLITS)}.")
    return [Example(prompt=f"{a}+{b}=", answer=str(a + b)) for a, b in _split_pairs()[split]]
