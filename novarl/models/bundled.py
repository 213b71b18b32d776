"""Models shipped inside the package, addressable by a short name."""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent

BUNDLED_MODELS: dict[str, Path] = {
    "tiny-arith": _HERE / "tiny_arith",
    "tiny-math": _HERE / "tiny_math",
    "tiny-tools": _HERE / "tiny_tools",
}


def resolve_bundled(name: str) -> Path | None:
    """The folder of the bundled model called `name`, or None if there is none."""
    return BUNDLED_MODELS.get(name)
