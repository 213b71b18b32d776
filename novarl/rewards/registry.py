"""Reward functions: a registered name or an import path the config gives.

A reward function is called once per completion as
``fn(completion: str, answer: str | None) -> float`` (plus ``prompt=`` when it
has a parameter of that name). Only the names the config gives are imported.
A function that raises, or returns something that is not a finite number,
stops the run with an error naming it and the sample.
"""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from novarl.errors import UserError
from novarl.rewards.verifiers import exact_match
from novarl.types import Completion

REWARD_FUNCTIONS: dict[str, Callable[..., float]] = {"exact_match": exact_match}


def import_reward_fn(spec: str) -> Callable[..., float]:
    """'exact_match' or 'package.module:function' -> the function."""
    if spec in REWARD_FUNCTIONS:
        return REWARD_FUNCTIONS[spec]
    module_name, colon, attr = spec.partition(":")
    if not colon or not module_name or not attr:
        raise UserError(f"reward.function='{spec}' is neither a registered reward "
                        f"({', '.join(REWARD_FUNCTIONS)}) nor an import path 'module:function'.")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # ImportError, SyntaxError, or whatever the module raises on import
        hint = " Give a module name importable from PYTHONPATH, not a file path." if "/" in module_name or \
            module_name.startswith(".") else ""
        raise UserError(f"reward.function='{spec}': importing module '{module_name}' failed: "
                        f"{type(err).__name__}: {err}.{hint}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise UserError(f"reward.function='{spec}': module '{module_name}' has no function '{attr}'.")
    return fn


@dataclass
class RewardScorer:
    """Scores completions with one reward function and checks what it returns."""

    fn: Callable[..., float]
    name: str

    @classmethod
    def from_spec(cls, spec: str | Callable[..., float]) -> "RewardScorer":
        if callable(spec):
            return cls(spec, getattr(spec, "__qualname__", repr(spec)))
        return cls(import_reward_fn(spec), spec)

    def __post_init__(self) -> None:
        try:
            self._wants_prompt = "prompt" in inspect.signature(self.fn).parameters
        except (TypeError, ValueError):
            self._wants_prompt = False

    def score(self, completions: Sequence[Completion]) -> list[float]:
        return [self._one(c) for c in completions]

    def _one(self, completion: Completion) -> float:
        kwargs = {"prompt": completion.prompt.text} if self._wants_prompt else {}
        sample = f"prompt {completion.prompt.text!r}, completion {completion.text!r}"
        try:
            value = self.fn(completion.text, completion.prompt.answer, **kwargs)
        except Exception as err:  # a user's function may raise anything
            raise UserError(f"Reward function '{self.name}' raised {type(err).__name__}: {err} "
                            f"(on {sample}).") from None
        if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
            raise UserError(f"Reward function '{self.name}' returned {value!r} "
                            f"({type(value).__name__}), not a finite number (on {sample}).")
        return float(value)
