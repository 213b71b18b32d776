"""Multiplication with a calculator tool: the bundled multi-turn task (README: "Agents and tools").

A prompt asks for the product of a three-digit and a two-digit number, ``"347*29="``, answer
``"10063"``: more than the bundled tiny-tools model computes alone, and what its tool,
`multiply`, gives. The model calls it in the Hermes form the tool environment parses
(rollout/tools.py): ``<tool_call>{"name": "multiply", "arguments": {"a": 347, "b": 29}}</tool_call>``,
gets ``<tool_response>\\n10063\\n</tool_response>\\n`` back, and answers.

The validation split is 1,000 pairs drawn with ``random.Random(VALIDATION_SEED)``, the train split
8,000 others: both deterministic, and disjoint.
"""

from __future__ import annotations

import json
import random
from functools import lru_cache

from novarl.data.arithmetic import SPLITS, Example

VALIDATION_SIZE, TRAIN_SIZE = 1_000, 8_000
VALIDATION_SEED = 4321


def multiply(a: int, b: int) -> int:
    """Multiply two whole numbers.

    Args:
        a: the first factor
        b: the second factor
    """
    return int(a) * int(b)


def tool_call(a: int, b: int) -> str:
    """The model's call of `multiply` for a and b, as the Hermes parser reads it."""
    return "<tool_call>" + json.dumps({"name": "multiply", "arguments": {"a": a, "b": b}}) + "</tool_call>"


def tool_response(result: int) -> str:
    """What the tool environment sends back for one call's result (rollout/tools.py ToolEnvironment.step)."""
    return f"<tool_response>\n{result}\n</tool_response>\n"


@lru_cache(maxsize=None)
def _split_pairs() -> dict[str, tuple[tuple[int, int], ...]]:
    pairs = [(a, b) for a in range(100, 1000) for b in range(11, 100)]
    drawn = random.Random(VALIDATION_SEED).sample(pairs, VALIDATION_SIZE + TRAIN_SIZE)
    return {"validation": tuple(drawn[:VALIDATION_SIZE]), "train": tuple(drawn[VALIDATION_SIZE:])}


def multiplication_examples(split: str) -> list[Example]:
    """The examples of `split` ("train": 8,000 or "validation": 1,000), in their drawn order."""
    if split not in SPLITS:
        raise ValueError(f"Unknown split {split!r} for the multiplication task; allowed: {', '.join(SPLITS)}.")
    return [Example(prompt=f"{a}*{b}=", answer=str(a * b)) for a, b in _split_pairs()[split]]


def alphabet() -> str:
    """Every character a prompt, a tool call, a tool response or an answer uses."""
    text = tool_call(123, 45) + tool_response(6789) + "*=0123456789"
    return "".join(sorted(set(text)))
