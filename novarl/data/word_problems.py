"""Math word problems: the bundled math-style task (`data.dataset_name: word_problems`).

Short problems rendered from templates -- a name, an item, two two-digit numbers, a sum or
a difference -- whose answer goes in \\boxed{}, as math recipes ask for it, and is checked by
math-verify (`reward.function: math_verify`). E.g. "Ann has 37 pens and gets 58 more. How
many pens does Ann have? Put the answer in \\boxed{}." -> "95". 8,000 problems, drawn with a
fixed seed; the last 1,000 are the validation split. Both splits are deterministic.
"""

from __future__ import annotations

import random
from functools import lru_cache

from novarl.data.arithmetic import Example

SPLITS = ("train", "validation")
SIZE, VALIDATION_SIZE, SEED = 8_000, 1_000, 20261124
NAMES = ("Ann", "Tom", "Mia", "Sam", "Eva", "Max")
ITEMS = ("pens", "cards", "books", "coins", "shells", "stamps")
TEMPLATES = (
    ("{name} has {a} {item} and gets {b} more. How many {item} does {name} have?", "+"),
    ("{name} has {a} {item} and gives away {b}. How many {item} does {name} have?", "-"),
    ("A box holds {a} {item}. {b} more are put in. How many {item} are in the box?", "+"),
    ("A box holds {a} {item}. {b} are taken out. How many {item} are in the box?", "-"),
)
SUFFIX = " Put the answer in \\boxed{}."


def render(template: str, op: str, name: str, item: str, a: int, b: int) -> Example:
    if op == "-" and b > a:
        a, b = b, a
    answer = a + b if op == "+" else a - b
    return Example(prompt=template.format(name=name, item=item, a=a, b=b) + SUFFIX, answer=str(answer))


@lru_cache(maxsize=None)
def _all() -> tuple[Example, ...]:
    rng = random.Random(SEED)
    seen, examples = set(), []
    while len(examples) < SIZE:
        template, op = rng.choice(TEMPLATES)
        ex = render(template, op, rng.choice(NAMES), rng.choice(ITEMS), rng.randrange(10, 100), rng.randrange(10, 100))
        if ex.prompt not in seen:
            seen.add(ex.prompt)
            examples.append(ex)
    return tuple(examples)


def word_problem_examples(split: str) -> list[Example]:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    examples = _all()
    return list(examples[:SIZE - VALIDATION_SIZE] if split == "train" else examples[SIZE - VALIDATION_SIZE:])


def alphabet() -> str:
    """Every character a problem or its boxed answer uses (the bundled model's tokenizer)."""
    text = "".join(ex.prompt + ex.answer for ex in _all()) + "\\boxed{}-0123456789"
    return "".join(sorted(set(text)))
