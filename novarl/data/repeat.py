"""Repeat a two-digit string: the bundled variable-length task.

Prompt ``"ab*n="``, answer the two digits ``ab`` written ``n`` times (e.g.
``"37*4="`` -> ``"37373737"``), for every ``ab`` in 00..99 and ``n`` in 1..20:
2,000 examples whose answers run from 2 to 40 tokens, so that a batch's
sequences differ in length by up to 20x, as reasoning traces do. It exercises
what padding wastes and packing saves (benchmarks/bench_packing.py), on the
bundled vocabulary. The validation split is a fixed 200 drawn with
``random.Random(4321).sample``; the train split is the other 1,800, in order.
"""

from __future__ import annotations

import random
from functools import lru_cache

from novarl.data.arithmetic import SPLITS, Example

MAX_REPEATS = 20
VALIDATION_SIZE = 200
VALIDATION_SEED = 4321


@lru_cache(maxsize=None)
def _split_items() -> dict[str, tuple[tuple[str, int], ...]]:
    items = [(f"{ab:02d}", n) for ab in range(100) for n in range(1, MAX_REPEATS + 1)]
    held_out = set(random.Random(VALIDATION_SEED).sample(items, VALIDATION_SIZE))
    return {"train": tuple(i for i in items if i not in held_out),
            "validation": tuple(i for i in items if i in held_out)}


def repeat_examples(split: str) -> list[Example]:
    """The examples of `split` ("train": 1,800 or "validation": 200)."""
    if split not in SPLITS:
        raise ValueError(f"Unknown split {split!r} for the repeat task; allowed: {', '.join(SPLITS)}.")
    return [Example(prompt=f"{digits}*{n}=", answer=digits * n) for digits, n in _split_items()[split]]
