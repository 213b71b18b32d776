"""Scoring completions with one or several reward functions, each called the way it is written.

A reward function is called in one of two ways, told apart by its first parameter:

- per sample, ``fn(completion: str, answer: str | None, ...) -> float``: once per completion.
  It also gets, by name, ``prompt`` (the rendered prompt) and any column of the data row it
  names as a parameter (``def score(completion, answer, difficulty): ...``); with ``**kwargs``
  it gets them all.
- batched, TRL's convention, when the first parameter is ``completions``:
  ``fn(completions: list[str], **kwargs) -> list[float]``, once per batch, with keyword lists
  ``prompts``, ``answers``, ``sources`` (each prompt as the data gave it: chat messages or text,
  before the template) and every column of the rows (only those it names, unless it has
  ``**kwargs``). A function that is expensive per call (a model, a sandbox) should be batched.

A function returns a number, or a dict with a number under ``"reward"`` and other numbers that
are logged (mean per step, as ``reward/<function>/<key>``). With several functions
(`reward.function` a list, `reward.weights` their weights, 1.0 each by default) the reward is the
weighted sum, and each function's mean is logged; a function may then return None for a sample
it does not apply to (TRL's convention), which adds nothing. Anything else (NaN, inf, a
string, a list of the wrong length) stops the run with an error naming the function and sample.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from novarl.errors import UserError
from novarl.rewards.registry import (DEFAULT_TIMEOUT_S, REWARD_LIMIT, RewardTimeout, _clip, _signal_hint,
                                     call_with_timeout, import_reward_fn)
from novarl.types import Completion


@dataclass
class RewardTerm:
    """One reward function and how it is called."""

    fn: Callable
    name: str
    weight: float = 1.0
    batched: bool = False
    named: tuple[str, ...] = ()
    """The keyword parameters it names (after the first one or two)."""
    takes_all: bool = False
    """It has **kwargs: every keyword is passed."""
    required: tuple[str, ...] = ()
    """Keyword parameters without defaults: each must be offered (prompt, a column)."""
    metric: str = ""
    """Its name in metrics (reward/<metric>): the function's own name."""

    @classmethod
    def of(cls, fn: Callable, name: str, weight: float = 1.0) -> "RewardTerm":
        try:
            parameters = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):  # a builtin without a signature: called as per-sample
            return cls(fn, name, weight)
        positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        batched = bool(positional) and positional[0].name == "completions"
        takes_all = any(p.kind == p.VAR_KEYWORD for p in parameters)
        fixed = 1 if batched else 2
        accepts = len(positional) >= fixed or any(p.kind == p.VAR_POSITIONAL for p in parameters)
        if not accepts:
            raise UserError(f"Reward function '{name}' takes {len(positional)} positional parameter(s); novarl calls "
                            "a per-sample reward as fn(completion, answer, ...) and a batched one as "
                            "fn(completions, **kwargs) (first parameter named 'completions').")
        named = tuple(p.name for p in positional[fixed:]) + tuple(p.name for p in parameters
                                                                  if p.kind == p.KEYWORD_ONLY)
        required = [p.name for p in positional[fixed:] + [p for p in parameters if p.kind == p.KEYWORD_ONLY]
                    if p.default is p.empty]
        return cls(fn, name, weight, batched, named, takes_all, tuple(required))


@dataclass
class RewardScorer:
    """Scores completions with its terms and checks what each returns."""

    terms: list[RewardTerm]
    timeout_s: float | None = DEFAULT_TIMEOUT_S
    """Seconds one call may take (a batched call: that many per completion); None: no limit."""
    _metrics: dict[str, list[float]] = field(default_factory=dict, repr=False)

    @classmethod
    def from_spec(cls, spec: str | Callable | Sequence[str | Callable], *, weights: Sequence[float] | None = None,
                  timeout_s: float | None = DEFAULT_TIMEOUT_S, settings: Any = None) -> "RewardScorer":
        """The scorer of reward.function `spec` (registered rewards built from `settings`, the reward section)."""
        specs = [spec] if isinstance(spec, str) or callable(spec) else list(spec)
        if not specs:
            raise UserError("reward.function is an empty list: give at least one reward function.")
        weights = list(weights) if weights is not None else [1.0] * len(specs)
        if len(weights) != len(specs):
            raise UserError(f"reward.weights has {len(weights)} weight(s) for {len(specs)} reward function(s): give "
                            "one weight per function.")
        terms = []
        for one, weight in zip(specs, weights):
            fn = one if callable(one) else import_reward_fn(one, settings)
            name = one if isinstance(one, str) else getattr(one, "__name__", repr(one))
            term = RewardTerm.of(fn, name, float(weight))
            term.metric = name.rpartition(":")[2]
            if any(t.metric == term.metric for t in terms):  # two files' functions of one name: kept apart
                term.metric = f"{term.metric}_{len(terms)}"
            terms.append(term)
        return cls(terms, timeout_s)

    @property
    def loads_models(self) -> bool:
        """A function of it loads a model at its first call (a reward model, an LLM judge)."""
        return any(getattr(t.fn, "loads_model", False) for t in self.terms)

    @property
    def name(self) -> str:
        return " + ".join(t.name if t.weight == 1.0 else f"{t.weight:g} x {t.name}" for t in self.terms)

    def score(self, completions: Sequence[Completion]) -> list[float]:
        """The (weighted) reward of each completion; extra metrics kept for `take_metrics`."""
        totals = [0.0] * len(completions)
        several = len(self.terms) > 1
        for term in self.terms:
            values = self._batch(term, completions) if term.batched else \
                [self._one(term, c) for c in completions]
            given = []
            for i, value in enumerate(values):
                reward, extras = self._checked(term, value, completions[i], allow_none=several)
                if reward is not None:
                    totals[i] += term.weight * reward
                    given.append(reward)
                for key, number in extras.items():
                    self._metrics.setdefault(f"reward/{term.metric or term.name}/{key}", []).append(number)
            if several and given:
                self._metrics.setdefault(f"reward/{term.metric or term.name}", []).extend(given)
        return totals

    def take_metrics(self) -> dict[str, float]:
        """Means of the extra metrics (and, with several functions, of each) since the last call."""
        out = {key: sum(v) / len(v) for key, v in self._metrics.items() if v}
        self._metrics.clear()
        return out

    # ---------------------------------------------------------------- calls
    def _keywords(self, term: RewardTerm, prompt: str, columns: Mapping[str, object], taken: set[str]) -> dict:
        offered = {"prompt": prompt, **{k: v for k, v in columns.items() if isinstance(k, str)}}
        keys = offered.keys() - taken if term.takes_all else set(term.named) & offered.keys()
        return {k: offered[k] for k in keys}

    def _one(self, term: RewardTerm, completion: Completion) -> object:
        prompt = completion.prompt
        kwargs = self._keywords(term, prompt.text, prompt.columns, {"completion", "answer"})
        self._check_required(term, kwargs, prompt.columns)
        return self._call(term, lambda: term.fn(completion.text, prompt.answer, **kwargs), self.timeout_s,
                          lambda: _sample(completion))

    def _batch(self, term: RewardTerm, completions: Sequence[Completion]) -> list[object]:
        columns = sorted({k for c in completions for k in c.prompt.columns if isinstance(k, str)})
        offered = {"prompts": [c.prompt.text for c in completions], "answers": [c.prompt.answer for c in completions],
                   "sources": [c.prompt.source for c in completions],
                   **{k: [c.prompt.columns.get(k) for c in completions] for k in columns}}
        offered = {k: v for k, v in offered.items() if k != "completions"}
        kwargs = offered if term.takes_all else {k: v for k, v in offered.items() if k in term.named}
        self._check_required(term, kwargs, completions[0].prompt.columns if completions else {})
        timeout = None if self.timeout_s is None else self.timeout_s * max(1, len(completions))
        values = self._call(term, lambda: term.fn([c.text for c in completions], **kwargs), timeout,
                            lambda: f"a batch of {len(completions)}, the first {_sample(completions[0])}")
        if not isinstance(values, (list, tuple)) or len(values) != len(completions):
            got = f"a {type(values).__name__} of {len(values)}" if isinstance(values, (list, tuple)) else \
                type(values).__name__
            raise UserError(f"Reward function '{term.name}' is batched (its first parameter is 'completions') and "
                            f"must return a list of {len(completions)} rewards, one per completion; it returned {got}.")
        return list(values)

    def _check_required(self, term: RewardTerm, kwargs: dict, columns: Mapping[str, object]) -> None:
        missing = [name for name in term.required if name not in kwargs]
        if missing:
            raise UserError(f"Reward function '{term.name}' needs {', '.join(repr(m) for m in missing)}, which is "
                            f"neither 'prompt{'s' if term.batched else ''}' nor a column of the data (columns: "
                            f"{', '.join(sorted(map(str, columns))) or 'none'}). Give it a default, or add the column.")

    def _call(self, term: RewardTerm, call: Callable[[], object], timeout_s: float | None,
              sample: Callable[[], str]) -> object:
        def expired() -> str:
            limit = f"reward.timeout_s={self.timeout_s:g} s (on " if timeout_s == self.timeout_s else \
                f"{timeout_s:g} s (reward.timeout_s={self.timeout_s:g} s per completion, on "
            return (f"Reward function '{term.name}' did not return within {limit}{sample()}); the run stopped. "
                    "Make it faster, or raise reward.timeout_s (null: no limit).")

        try:
            return call_with_timeout(call, timeout_s, error=expired)
        except RewardTimeout:
            raise UserError(expired()) from None
        except UserError:  # a registered reward's own, already naming what is wrong
            raise
        except (Exception, SystemExit) as err:  # a user's function may raise anything
            raise UserError(f"Reward function '{term.name}' raised {type(err).__name__}: {_clip(str(err), 300)}"
                            f"{_signal_hint(err)} (on {sample()}).") from None

    def _checked(self, term: RewardTerm, value: object, completion: Completion, *,
                 allow_none: bool) -> tuple[float | None, dict[str, float]]:
        """(reward, extra metrics) from what `term` returned for `completion`."""
        extras: dict[str, float] = {}
        if isinstance(value, Mapping):
            if "reward" not in value:
                raise UserError(f"Reward function '{term.name}' returned a dict without 'reward' (keys: "
                                f"{', '.join(map(str, value))}) on {_sample(completion)}; put the reward under "
                                "'reward', other numbers are logged.")
            extras = {str(k): _number(term, v, completion, f"its '{k}'") for k, v in value.items() if k != "reward"}
            value = value["reward"]
        if value is None and allow_none:
            return None, extras
        return _number(term, value, completion, "it"), extras


def _number(term: RewardTerm, value: object, completion: Completion, what: str) -> float:
    """`value` as a float, if it is a real number within +-REWARD_LIMIT."""
    problem = None
    if not isinstance(value, numbers.Real):
        problem = "not a finite number"
    else:
        try:
            number = float(value)
        except (OverflowError, ValueError, TypeError):
            number = math.inf
        if not math.isfinite(number):
            problem = "not a finite number"
        elif abs(number) > REWARD_LIMIT:
            problem = (f"beyond +-{REWARD_LIMIT:.0e}, the largest reward taken: rewards are trained in float32, "
                       "where such values overflow (inf, then NaN weights). Scale the reward down")
    if problem:
        subject = "returned" if what == "it" else f"returned {what} ="
        raise UserError(f"Reward function '{term.name}' {subject} {_clip(repr(value))} ({type(value).__name__}), "
                        f"{problem} (on {_sample(completion)}).")
    return number


def _sample(completion: Completion) -> str:
    return f"prompt {_clip(repr(completion.prompt.text))}, completion {_clip(repr(completion.text))}"
