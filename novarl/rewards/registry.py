"""Reward functions: a registered name, an import path, or a Python file the config gives.

``reward.function`` is one of
- a registered name: ``exact_match``;
- ``module:function``: ``module`` is imported from sys.path, else from the working
  directory (``myreward.py`` or a package folder there), which the ``novarl``
  console script does not put on sys.path; the folder is then appended to
  sys.path, last, so it shadows nothing;
- ``path/to/file.py:function``: a module part that ends in ``.py`` or holds a
  ``/`` is a file, relative to the working directory unless absolute. It is
  loaded under a name of its own (two files both called rewards.py do not
  clash), with its folder appended to sys.path so it can import the files
  beside it.

A reward function is called once per completion as
``fn(completion: str, answer: str | None) -> float`` (plus ``prompt=`` when it
has a parameter of that name). Only the names the config gives are imported.
Every import failure, and a function that raises, or returns something that is
not a finite number, stops the run with an error naming it (and the sample).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import os
import re
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from novarl.errors import UserError
from novarl.rewards.verifiers import exact_match
from novarl.types import Completion

REWARD_FUNCTIONS: dict[str, Callable[..., float]] = {"exact_match": exact_match}


def import_reward_fn(spec: str) -> Callable[..., float]:
    """'exact_match', 'package.module:function' or 'path/to/file.py:function' -> the function."""
    if spec in REWARD_FUNCTIONS:
        return REWARD_FUNCTIONS[spec]
    source, colon, attr = spec.rpartition(":")
    if not colon or not source or not attr:
        raise UserError(f"reward.function='{spec}' is neither a registered reward "
                        f"({', '.join(REWARD_FUNCTIONS)}) nor an import path 'module:function' "
                        "or 'path/to/file.py:function'.")
    if source.endswith(".py") or "/" in source or os.sep in source:
        module = _load_file(spec, source)
        where = f"file '{module.__file__}'"
    else:
        module, where = _import_module(spec, source), f"module '{source}'"
    if not hasattr(module, attr):
        raise UserError(f"reward.function='{spec}': {where} has no function '{attr}'.")
    fn = getattr(module, attr)
    if not callable(fn):
        raise UserError(f"reward.function='{spec}': '{attr}' in {where} is not a function "
                        f"(its type is {type(fn).__name__}).")
    return fn


def _import_module(spec: str, name: str) -> ModuleType:
    """`name` from sys.path, else from the working directory when it holds that module."""
    cwd = Path.cwd()
    top = name.partition(".")[0]
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        in_cwd = (cwd / f"{top}.py").is_file() or (cwd / top / "__init__.py").is_file()
        if err.name != top or not in_cwd or str(cwd) in sys.path:
            raise _import_failed(spec, f"importing module '{name}'", err,
                                 f" (looked on sys.path and in the working directory {cwd})") from None
    except Exception as err:  # SyntaxError, or whatever the module raises on import
        raise _import_failed(spec, f"importing module '{name}'", err) from None
    return _import_from_folder(spec, name, cwd)


def _import_from_folder(spec: str, name: str, folder: Path) -> ModuleType:
    """Import `name` with `folder` appended to sys.path; it stays there (the module may import
    its neighbours later), last, so it shadows nothing."""
    sys.path.append(str(folder))
    importlib.invalidate_caches()
    try:
        return importlib.import_module(name)
    except Exception as err:
        sys.path.remove(str(folder))
        raise _import_failed(spec, f"importing module '{name}' from the working directory {folder}", err) from None


def _load_file(spec: str, source: str) -> ModuleType:
    """The module of the Python file `source` (relative to the working directory unless
    absolute), loaded once per process under a name unique to its resolved path."""
    path = Path(source).expanduser()
    if not path.is_absolute():
        path = Path.cwd() / path
    if not path.is_file():
        what = "is a folder, not a Python file" if path.is_dir() else "does not exist"
        relative = "" if Path(source).expanduser().is_absolute() else \
            f" (a relative path is taken from the working directory, {Path.cwd()})"
        raise UserError(f"reward.function='{spec}': the file '{path}' {what}{relative}.")
    path = path.resolve()
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
    module_name = f"novarl_reward_file_{re.sub(r'[^0-9A-Za-z_]', '_', path.stem)}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise UserError(f"reward.function='{spec}': cannot load '{path}' as a Python file; name it *.py.")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # before running it, as import does (dataclasses, pickling look it up)
    folder_added = str(path.parent) not in sys.path
    if folder_added:
        sys.path.append(str(path.parent))
    try:
        module_spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[module_name]
        if folder_added:
            sys.path.remove(str(path.parent))
        raise _import_failed(spec, f"loading file '{path}'", err) from None
    return module


def _import_failed(spec: str, doing: str, err: Exception, hint: str = "") -> UserError:
    """One paragraph: what failed, the error, and the line that raised it."""
    message = " ".join(str(err).split())
    machinery = (__file__, importlib.__file__)
    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if f.filename not in machinery and not f.filename.startswith("<frozen")]
    at = f" (raised at {frames[-1].filename}:{frames[-1].lineno})" if frames and not isinstance(err, SyntaxError) else ""
    return UserError(f"reward.function='{spec}': {doing} failed: {type(err).__name__}: {message}{at}{hint}.")


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
