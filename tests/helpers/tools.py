"""Tools for tests/test_tools.py, named by import path as a user's are (env.<name>.cfg.tools)."""

from __future__ import annotations

import time


def add(a: int, b: int = 0) -> int:
    """Add two integers.

    a: the first
    b: the second
    """
    return a + b


def wait(seconds: float) -> str:
    """Sleep, then say so."""
    time.sleep(seconds)
    return f"slept {seconds}"


def boom() -> None:
    """Always fails."""
    raise RuntimeError("the tool broke")
