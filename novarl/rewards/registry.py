"""Reward functions: a registered name, an import path, or a Python file the config gives.

``reward.function`` is one of (or a list of them: novarl/rewards/scorer.py)
- a registered name: ``exact_match``, ``math_verify``, ``boxed_match``, ``last_number``,
  ``boxed_format`` (novarl/rewards/math.py), ``dapo_math_verify`` (novarl/rewards/dapo_math.py);
- ``module:function``: ``module`` is imported from sys.path, else from the working
  directory (``myreward.py`` or a package folder there), which the ``novarl``
  console script does not put on sys.path; the folder is then appended to
  sys.path, last, so it shadows nothing;
- ``path/to/file.py:function``: a module part that ends in ``.py`` or holds a
  ``/`` is a file, relative to the working directory unless absolute. It is
  loaded under a name of its own (two files both called rewards.py do not
  clash), with its folder appended to sys.path so it can import the files
  beside it.

How a function is called (per sample or batched, with the data's columns) and what
it may return: novarl/rewards/scorer.py. Only the names the config gives are
imported. Every import failure, and a function that raises, or returns something
that is not a number within +-REWARD_LIMIT (nan, inf, 1e308, a string), stops the
run with an error naming it (and the sample).

``reward.timeout_s`` bounds each call (one completion; a batched call, that many
seconds per completion). In the main thread (the
command line) the call runs there under a SIGALRM timer: the handler raises
inside the function, which interrupts sleeping, waiting on I/O, Python loops and
regular expressions alike, and nothing is left running. Elsewhere (train()
called from another thread) the call runs in a daemon thread that is abandoned
on expiry; the run stops, and the thread cannot keep the process alive. Either
way the run stops with an error naming the function and the completion. Not
bounded: C code that neither returns to Python nor checks signals; and a
function that sets its own SIGALRM timer (math-verify does) replaces ours for
that call, its own timeout then bounding it. ``timeout_s: null`` calls the
function directly, with no timer.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import os
import queue
import re
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from novarl.errors import UserError
from novarl.rewards.dapo_math import dapo_math_verify
from novarl.rewards.ifeval import ifeval
from novarl.rewards.math import boxed_format, boxed_match, last_number_match, math_verify
from novarl.rewards.verifiers import crossthinkqa, crossthinkqa_loose, crossthinkqa_strict, exact_match

REWARD_FUNCTIONS: dict[str, Callable[..., float]] = {
    "exact_match": exact_match, "math_verify": math_verify, "boxed_match": boxed_match,
    "last_number": last_number_match, "boxed_format": boxed_format, "crossthinkqa": crossthinkqa,
    "crossthinkqa_loose": crossthinkqa_loose, "crossthinkqa_strict": crossthinkqa_strict, "ifeval": ifeval,
    "dapo_math_verify": dapo_math_verify}

REWARD_FACTORIES: dict[str, str] = {"code_tests": "novarl.rewards.code:code_tests",
                                    "code_pass_rate": "novarl.rewards.code:code_pass_rate",
                                    "reward_model": "novarl.rollout.reward_host:reward_model",
                                    "llm_judge": "novarl.rollout.reward_host:llm_judge"}
"""Registered rewards built from the reward section's settings (factory(settings) -> function),
imported when named (by path, as a plugin: the model-based ones may run on Ray actors of their own,
rollout/reward_host.py, which the rewards' layer does not import)."""

NEEDS: dict[str, tuple[str, str]] = {"math_verify": ("math_verify", "pip install 'novarl[math]'")}
"""Registered rewards that need a package: (module, how to install it)."""

DEFAULT_TIMEOUT_S = 300.0
"""reward.timeout_s's default: seconds one call may take."""

REWARD_LIMIT = 1e15
"""The largest reward magnitude taken. Rewards become float32 tensors: past 3.4e38 a value is
inf outright, and well before that the group mean and the summed loss overflow (measured on
the bundled task: +-3e38 gives NaN weights with normalised rewards, +-1e37 without), so the
limit sits far below both and far above any real reward (past 2**53 ~ 9e15 even float64
integers are not all distinct)."""


def import_reward_fn(spec: str, settings: Any = None) -> Callable[..., float]:
    """'exact_match', 'package.module:function' or 'path/to/file.py:function' -> the function
    (a factory's with `settings`, the reward section)."""
    if spec in REWARD_FACTORIES:
        module, _, factory = REWARD_FACTORIES[spec].partition(":")
        return getattr(importlib.import_module(module), factory)(settings)
    if spec in REWARD_FUNCTIONS:
        if spec in NEEDS and importlib.util.find_spec(NEEDS[spec][0]) is None:
            raise UserError(f"reward.function='{spec}' needs the {NEEDS[spec][0].replace('_', '-')} package: "
                            f"{NEEDS[spec][1]}.")
        return REWARD_FUNCTIONS[spec]
    source, colon, attr = spec.rpartition(":")
    if not colon or not source or not attr:
        names = [*REWARD_FUNCTIONS, *REWARD_FACTORIES]
        close = difflib.get_close_matches(spec, names, n=1, cutoff=0.7)
        raise UserError(f"reward.function='{spec}' is neither a registered reward ({', '.join(names)}) nor an import "
                        "path 'module:function' or 'path/to/file.py:function'"
                        + (f": did you mean '{close[0]}'?" if close else "."))
    fn, where = import_attribute(spec, "reward.function")
    if not callable(fn):
        raise UserError(f"reward.function='{spec}': '{attr}' in {where} is not a function "
                        f"(its type is {type(fn).__name__}).")
    return fn


def import_attribute(spec: str, key: str, what: str = "function") -> tuple[Any, str]:
    """'package.module:name' or 'path/to/file.py:name' -> (that object of the module, where it was
    found, for messages): a module on sys.path or in the working directory, a file relative to it.
    Every error is a UserError naming `key`."""
    setting = f"{key}='{spec}'"
    source, colon, attr = spec.rpartition(":")
    if not colon or not source or not attr:
        raise UserError(f"{setting} is not an import path 'module:{what}' or 'path/to/file.py:{what}'.")
    if "\0" in spec:
        raise UserError(f"{key}={spec!r} contains a NUL character.")
    if source.endswith(".py") or "/" in source or os.sep in source:
        module = _load_file(setting, source)
        where = f"file '{module.__file__}'"
    else:
        module, where = _import_module(setting, source), f"module '{source}'"
    if not hasattr(module, attr):
        raise UserError(f"{setting}: {where} has no {what} '{attr}'.")
    return getattr(module, attr), where


def _import_module(setting: str, name: str) -> ModuleType:
    """`name` from sys.path, else from the working directory when it holds that module."""
    cwd = Path.cwd()
    top = name.partition(".")[0]
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        in_cwd = (cwd / f"{top}.py").is_file() or (cwd / top / "__init__.py").is_file()
        if err.name != top or not in_cwd or str(cwd) in sys.path:
            raise _import_failed(setting, f"importing module '{name}'", err,
                                 f" (looked on sys.path and in the working directory {cwd})") from None
    except Exception as err:  # SyntaxError, or whatever the module raises on import
        raise _import_failed(setting, f"importing module '{name}'", err) from None
    return _import_from_folder(setting, name, cwd)


def _import_from_folder(setting: str, name: str, folder: Path) -> ModuleType:
    """Import `name` with `folder` appended to sys.path; it stays there (the module may import
    its neighbours later), last, so it shadows nothing."""
    sys.path.append(str(folder))
    importlib.invalidate_caches()
    try:
        return importlib.import_module(name)
    except Exception as err:
        sys.path.remove(str(folder))
        raise _import_failed(setting, f"importing module '{name}' from the working directory {folder}", err) from None


def _load_file(setting: str, source: str) -> ModuleType:
    """The module of the Python file `source` (relative to the working directory unless
    absolute), loaded once per process under a name unique to its resolved path."""
    path = Path(source).expanduser()
    if not path.is_absolute():
        path = Path.cwd() / path
    try:
        is_file = path.is_file()
    except OSError as err:  # a name too long, a folder that may not be entered
        raise UserError(f"{setting}: cannot open '{path}' ({err.strerror}).") from None
    if not is_file:
        what = "is a folder, not a Python file" if path.is_dir() else "does not exist"
        relative = "" if Path(source).expanduser().is_absolute() else \
            f" (a relative path is taken from the working directory, {Path.cwd()})"
        raise UserError(f"{setting}: the file '{path}' {what}{relative}.")
    path = path.resolve()
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
    module_name = f"novarl_reward_file_{re.sub(r'[^0-9A-Za-z_]', '_', path.stem)}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise UserError(f"{setting}: cannot load '{path}' as a Python file; name it *.py.")
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
        raise _import_failed(setting, f"loading file '{path}'", err) from None
    return module


def _import_failed(setting: str, doing: str, err: Exception, hint: str = "") -> UserError:
    """One paragraph: what failed, the error, and the line that raised it."""
    message = " ".join(str(err).split())
    machinery = (__file__, importlib.__file__)
    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if f.filename not in machinery and not f.filename.startswith("<frozen")]
    at = f" (raised at {frames[-1].filename}:{frames[-1].lineno})" if frames and not isinstance(err, SyntaxError) else ""
    return UserError(f"{setting}: {doing} failed: {type(err).__name__}: {message}{at}{hint}.")


class RewardTimeout(BaseException):
    """A reward call ran past its time limit. A BaseException, like KeyboardInterrupt, so that
    the function's own `except Exception:` does not swallow it when it is raised inside it."""


GIVE_UP_AFTER_S = 10.0
"""Past the limit, how long (at most; as long again as the limit when that is shorter) a function
that swallows RewardTimeout (a bare `except:` in a retry loop) is interrupted again, once a
second, before the process exits with the error instead."""


def call_with_timeout(call: Callable[[], object], timeout_s: float | None, *,
                      error: Callable[[], str] = lambda: "A reward function did not return in time.") -> object:
    """call(), or RewardTimeout once it has run `timeout_s` seconds (see the module docstring).
    `error()`: the message to exit with if the function will not stop (main thread only)."""
    if timeout_s is None:
        return call()
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
        return _call_under_alarm(call, timeout_s, error)
    return _call_in_daemon_thread(call, timeout_s)


def _call_under_alarm(call: Callable[[], object], timeout_s: float, error: Callable[[], str]) -> object:
    """call() in this (the main) thread under a SIGALRM timer whose handler raises RewardTimeout
    inside it, and again every second should the function swallow it; after GIVE_UP_AFTER_S
    more seconds (or the limit again, if shorter) the process exits with `error` (exit code 2):
    nothing else can stop a function that catches every exception. An earlier SIGALRM handler
    and timer are put back afterwards."""
    armed, start = True, time.monotonic()

    def on_alarm(signum, frame):
        if not armed:  # a signal handled after the call returned
            return
        if time.monotonic() - start > timeout_s + min(timeout_s, GIVE_UP_AFTER_S):
            sys.stderr.write(f"novarl: error: {error()} It went on after being interrupted (it catches every "
                             "exception), so the process exits now.\n")
            sys.stderr.flush()
            os._exit(2)
        raise RewardTimeout

    previous = signal.signal(signal.SIGALRM, on_alarm)
    outer_delay, outer_interval = signal.setitimer(signal.ITIMER_REAL, timeout_s, min(timeout_s, 1.0))
    try:
        try:
            value = call()
        finally:
            armed = False
            signal.setitimer(signal.ITIMER_REAL, 0)
    except BaseException as err:
        if not isinstance(err, KeyboardInterrupt) and time.monotonic() - start >= timeout_s:
            raise RewardTimeout from None  # RewardTimeout, or what the function made of it
        raise
    finally:
        signal.signal(signal.SIGALRM, previous)
        if outer_delay > 0:
            signal.setitimer(signal.ITIMER_REAL, max(outer_delay - (time.monotonic() - start), 1e-3), outer_interval)
    if time.monotonic() - start >= timeout_s:  # it caught RewardTimeout and returned late
        raise RewardTimeout
    return value


def _call_in_daemon_thread(call: Callable[[], object], timeout_s: float) -> object:
    """call() in a daemon thread; RewardTimeout when it has not returned after `timeout_s`
    (the thread is abandoned: it cannot keep the process from exiting)."""
    outcome: queue.SimpleQueue = queue.SimpleQueue()

    def run() -> None:
        try:
            outcome.put((True, call()))
        except BaseException as err:  # handed to the caller, SystemExit included
            outcome.put((False, err))

    threading.Thread(target=run, name="novarl-reward-call", daemon=True).start()
    try:
        ok, value = outcome.get(timeout=timeout_s)
    except queue.Empty:
        raise RewardTimeout from None
    if not ok:
        raise value
    return value


def _signal_hint(err: BaseException) -> str:
    if isinstance(err, ValueError) and "signal only works in main thread" in str(err):
        return (" -- it sets a signal handler (math-verify does), which Python allows in the main thread "
                "only: call train() from the main thread, where novarl calls the reward function itself")
    return ""


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"
