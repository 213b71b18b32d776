"""What every config section shares: the Section base (unknown keys refused, frozen, finite
numbers, 64-bit integers) and the path type."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, field_validator

Precision = Literal["float32", "bfloat16", "float16"]
NAME_MAX_BYTES = 255
"""Longest file or folder name (one path component) Linux and macOS file systems hold."""
PATH_MAX_BYTES = 4095
"""Longest whole path Linux takes (PATH_MAX, less the terminating NUL)."""


def _path_text(path: str) -> str:
    """A path (or hub id) a file system can take: no NUL byte, no name longer than 255 bytes."""
    if "\0" in path:
        raise ValueError("a path cannot contain a NUL character")
    if len(path.encode()) > PATH_MAX_BYTES:
        raise ValueError(f"a path is at most {PATH_MAX_BYTES} bytes long; this one is {len(path.encode()):,}")
    longest = max(path.replace("\\", "/").split("/"), key=lambda part: len(part.encode()))
    if len(longest.encode()) > NAME_MAX_BYTES:
        raise ValueError(f"the name '{longest[:40]}...' in it is {len(longest.encode()):,} bytes long; file "
                         f"systems hold at most {NAME_MAX_BYTES} bytes per file or folder name")
    return path


PathText = Annotated[str, AfterValidator(_path_text)]
"""A file or folder path (or a name that may be one, such as a hub id)."""


def _finite_numbers(value: Any, where: str = "") -> Any:
    """`value` (a dict or list of keyword arguments) when every float in it is finite."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where or 'the value'} is {value}; it must be a finite number")
    if isinstance(value, dict):
        for key, item in value.items():
            _finite_numbers(item, f"{where}.{key}" if where else str(key))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _finite_numbers(item, f"{where}[{i}]")
    return value


class Section(BaseModel):
    # allow_inf_nan=False: no setting takes inf or nan (a temperature or learning rate of
    # inf validates as a float and ends in NaN weights); "no limit" is None where allowed.
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, allow_inf_nan=False)

    @field_validator("*")
    @classmethod
    def _int64(cls, value: Any) -> Any:
        """Integers fit in 64 bits: torch and vLLM take nothing larger (a seed of 10**30 fails there)."""
        items = value if isinstance(value, list) else (value,)
        if any(isinstance(v, int) and not isinstance(v, bool) and not -2**63 <= v < 2**63 for v in items):
            raise ValueError("out of the 64-bit integer range")
        return value
