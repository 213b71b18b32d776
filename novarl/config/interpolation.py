"""`${...}` in config values, resolved after composing (OmegaConf's meanings): references
`${a.b}`, relative ones `${.sibling}` / `${..key_of_the_parent}`, `${oc.env:NAME[,default]}`
and arithmetic resolvers `${mul:a, b}`, bounded like YAML aliases (config/files.py)."""

from __future__ import annotations

import re
from typing import Any

import yaml

from novarl.config.files import MAX_VALUES, _clip, _join, canonical_path, parse_yaml
from novarl.errors import ConfigError

MAX_INTERPOLATED_CHARS = 1_000_000
"""Longest string an interpolation may build."""


_INTERP = re.compile(r"\$\{([^${}]*)\}")
_RESOLVERS = {
    "mul": lambda *xs: _product(xs),
    "add": lambda *xs: sum(xs),
    "sub": lambda a, b: a - b,
    "div": lambda a, b: a / b,
    "floordiv": lambda a, b: a // b,
    "max": lambda *xs: max(xs),
    "min": lambda *xs: min(xs),
}


def _product(values: tuple) -> Any:
    out = 1
    for v in values:
        out *= v
    return out


def resolve_interpolations(tree: dict[str, Any]) -> dict[str, Any]:
    """Resolve `${a.b}` references, relative ones (`${.sibling}`, `${..key_of_the_parent}`, as
    OmegaConf reads them: one dot is the mapping that holds the string, each further dot one
    level up), `${oc.env:NAME}` / `${oc.env:NAME,default}` and `${mul:x, y}`-style resolvers in
    place of strings. A reference copies what it names, so references to references multiply
    like YAML aliases: the values built are counted against MAX_VALUES, strings against
    MAX_INTERPOLATED_CHARS."""
    return Interpolation(tree).walk(tree, "", ())


class Interpolation:
    """One pass over a config tree: the tree references are read from, and the values built so far."""

    def __init__(self, tree: dict[str, Any]) -> None:
        self.tree = tree
        self.built = 0

    def count(self, at: str) -> None:
        self.built += 1
        if self.built > MAX_VALUES:
            raise ConfigError(f"'{at}': the ${{...}} references expand to more than {MAX_VALUES:,} values "
                              "(references to references multiply); no config needs that many.")

    def walk(self, node: Any, path: str, stack: tuple[str, ...]) -> Any:
        """`node` (at `path`) with its strings resolved; stack: the references being resolved."""
        self.count(path)
        if isinstance(node, dict):
            return {k: self.walk(v, _join(path, str(k)), stack) for k, v in node.items()}
        if isinstance(node, list):
            return [self.walk(v, f"{path}[{i}]", stack) for i, v in enumerate(node)]
        if isinstance(node, str) and "${" in node:
            return self.resolve_string(node, path, stack)
        return node

    def lookup(self, ref: str, at: str, stack: tuple[str, ...]) -> Any:
        if ref in stack:
            raise ConfigError(f"'{at}': interpolation cycle {' -> '.join(stack + (ref,))}.")
        return self.walk(referenced(self.tree, ref, at), ref, stack + (ref,))

    def resolve_string(self, text: str, at: str, stack: tuple[str, ...]) -> Any:
        original = text
        while True:
            match = _INTERP.search(text)
            if match is None:
                return text
            # The message names the text as written: after substitution '${sub:${a}, 1}' is '${sub:inf, 1}'.
            where = at if text == original else f"{at}' = '{_clip(original)}"
            value = self.evaluate(match.group(1).strip(), at, where, stack)
            if match.span() == (0, len(text)):
                return value
            text = text[:match.start()] + str(value) + text[match.end():]
            if len(text) > MAX_INTERPOLATED_CHARS:
                raise ConfigError(f"'{at}': interpolation builds a string longer than "
                                  f"{MAX_INTERPOLATED_CHARS:,} characters.")

    def evaluate(self, expr: str, at: str, where: str, stack: tuple[str, ...]) -> Any:
        name, colon, args = expr.partition(":")
        if not colon:
            return self.lookup(canonical_path(absolute_reference(expr, at, where)), where, stack)
        if name == "oc.env":
            return environment_value(args, expr, where)
        return resolver_value(name, args, expr, where)


def referenced(tree: dict[str, Any], ref: str, at: str) -> Any:
    """The value that the absolute reference `ref` names (ConfigError where it names none)."""
    node: Any = tree
    for part in _path_parts(ref):
        if isinstance(node, dict) and part in node or isinstance(node, list) and isinstance(part, int) \
                and 0 <= part < len(node):
            node = node[part]
        else:
            raise ConfigError(f"'{at}': '${{{ref}}}' refers to a key that is not in the config.")
    return node


def resolver_value(name: str, args: str, expr: str, where: str) -> Any:
    """An arithmetic resolver's `${name:a, b}` (_RESOLVERS): numbers in, a number in 64 bits out."""
    if name not in _RESOLVERS:
        raise ConfigError(f"'{where}': unknown resolver '{name}' in '${{{expr}}}'; "
                          f"known: {', '.join(sorted([*_RESOLVERS, 'oc.env']))}.")
    try:
        values = [parse_yaml(a.strip()) for a in args.split(",")]
    except yaml.YAMLError:
        raise ConfigError(f"'{where}': cannot parse the arguments of '${{{expr}}}'.") from None
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        raise ConfigError(f"'{where}': '${{{expr}}}' takes numbers, got {values}.")
    try:
        result = _RESOLVERS[name](*values)
    except (TypeError, ZeroDivisionError, OverflowError) as err:
        raise ConfigError(f"'{where}': cannot evaluate '${{{_clip(expr)}}}': {err}.") from None
    if isinstance(result, int) and abs(result) >= 2**63:
        raise ConfigError(f"'{where}': '${{{_clip(expr)}}}' is out of the 64-bit integer range.")
    return result


def absolute_reference(ref: str, at: str, where: str | None = None) -> str:
    """`ref` as a path from the top: a relative reference (leading dots) read from the value
    at `at`. `${.x}` is x beside the value, `${..x}` x beside the mapping that holds it."""
    dots = len(ref) - len(ref.lstrip("."))
    if not dots:
        return ref
    parts = _path_parts(at)[:-1]  # the mapping that holds the value
    if dots - 1 > len(parts):
        raise ConfigError(f"'{where or at}': '${{{ref}}}' goes {dots - 1} level(s) up from '{at}', above the "
                          "top of the config.")
    base = parts[:len(parts) - (dots - 1)]
    return _parts_path([*base, *_path_parts(ref[dots:])]) if ref[dots:] else _parts_path(base)


def environment_value(args: str, expr: str, where: str) -> str:
    """OmegaConf's `${oc.env:NAME}` (the variable must be set) and `${oc.env:NAME,default}`."""
    import os

    name, comma, default = (a.strip() for a in args.partition(","))
    if name in os.environ:
        return os.environ[name]
    if comma:
        value = parse_yaml(default) if default else None
        return "" if value is None and default in ("''", '""') else value
    raise ConfigError(f"'{where}': '${{{expr}}}' reads the environment variable {name}, which is not set; set "
                      f"it, or give a default (${{oc.env:{name},VALUE}}).")


def _path_parts(path: str) -> list[str | int]:
    """'a.b[0].c' -> ['a', 'b', 0, 'c']."""
    parts: list[str | int] = []
    for piece in path.split("."):
        name, *indices = piece.split("[")
        if name:
            parts.append(name)
        parts.extend(int(i.rstrip("]")) for i in indices if i.rstrip("]").isdigit())
    return parts


def _parts_path(parts: list[str | int]) -> str:
    out = ""
    for part in parts:
        out = f"{out}[{part}]" if isinstance(part, int) else _join(out, part)
    return out


