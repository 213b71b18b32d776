"""Load a config from YAML, dicts, keyword and dotted overrides; validate it once.

Precedence, lowest first: the schema's defaults, the YAML file, a Python dict,
keyword overrides, then dotted command-line overrides (`a.b.c=value`). The
merged tree has its aliases rewritten, its `${...}` interpolations resolved
(OmegaConf style: `${policy.model_name}`, `${mul:a, b}`), and is then
validated into a frozen `NovaRLConfig`. Every failure is a `ConfigError` whose
message names the key path, the bad value, what is allowed and, for a
misspelled key, the closest valid one.
"""

from __future__ import annotations

import copy
import difflib
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from novarl.config.schema import NovaRLConfig
from novarl.errors import ConfigError

class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads 1e-3 as a float (YAML 1.1 wants 1.0e-3)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+][0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."),
)


def parse_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # noqa: S506 -- a SafeLoader subclass


# Where two seeds name one thing differently: (parent path, alias, canonical).
ALIASES: tuple[tuple[str, str, str], ...] = (
    ("", "algorithm", "grpo"),
    ("grpo", "batch_size", "num_prompts_per_step"),
    ("policy", "dtensor_config", "dtensor_cfg"),
    ("policy", "max_total_sequence_length", "max_seq_length"),
)

# Flat keyword overrides the seeds' Python examples use, e.g.
# GRPOTrainer.from_pretrained(name, tensor_parallel_size=8).
KEYWORD_SHORTCUTS: dict[str, str] = {
    "model_name": "policy.model_name",
    "tensor_parallel_size": "policy.dtensor_cfg.tensor_parallel_size",
    "context_parallel_size": "policy.dtensor_cfg.context_parallel_size",
    "precision": "policy.precision",
    "max_seq_length": "policy.max_seq_length",
    "learning_rate": "policy.optimizer.kwargs.lr",
    "num_prompts_per_step": "grpo.num_prompts_per_step",
    "num_generations_per_prompt": "grpo.num_generations_per_prompt",
    "max_num_steps": "grpo.max_num_steps",
    "seed": "grpo.seed",
    "checkpoint_dir": "checkpointing.checkpoint_dir",
    "log_dir": "logger.log_dir",
}


BUNDLED_RECIPE = Path(__file__).parent / "recipes" / "tiny_arith.yaml"
"""The bundled default: GRPO on the bundled tiny model and arithmetic task. `novarl train`
and the Python API start from it when no config is given."""


def load_config(
    source: str | Path | Mapping[str, Any] | None = None,
    *,
    overrides: Iterable[str] = (),
    **keyword_overrides: Any,
) -> NovaRLConfig:
    """Build a validated, frozen config.

    source: a YAML file path, a dict, or None (schema defaults only).
    overrides: dotted `a.b.c=value` strings; values are parsed as YAML scalars.
    keyword_overrides: a section name with a dict, a dotted path written with
    double underscores (`policy__precision="bfloat16"`), or a shortcut
    (`tensor_parallel_size=2`, see KEYWORD_SHORTCUTS).
    """
    where = "the config"
    tree: dict[str, Any] = {}
    if isinstance(source, (str, Path)):
        where = str(source)
        tree = read_yaml(Path(source))
    elif isinstance(source, Mapping):
        tree = copy.deepcopy(dict(source))
    elif source is not None:
        raise ConfigError(f"A config is a YAML file path or a dict, not {type(source).__name__}.")
    tree = canonical(tree)
    overrides = list(overrides)
    if overrides or keyword_overrides:
        where += " with overrides " + " ".join([*(f"{k}=..." for k in keyword_overrides), *overrides])
    for key, value in keyword_overrides.items():
        path = keyword_path(key)
        set_path(tree, path, canonical(dict(value), path) if isinstance(value, Mapping) else value, merge=True)
    for item in overrides:
        path, value = parse_override(item)
        path = canonical_path(path)
        set_path(tree, path, canonical(value, path), merge=False)
    try:
        tree = resolve_interpolations(tree)
    except ConfigError as err:
        # A Hydra child file (`defaults:`) often refers to keys of its base file: report
        # the unknown keys with the broken reference, not one of them alone.
        unknown = unknown_keys(tree)
        if not unknown:
            raise
        lines = "\n".join(f"  - {line}" for line in [str(err), *unknown])
        raise ConfigError(f"Invalid config ({where}):\n{lines}") from None
    return validate(tree, where)


def read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"Config file '{path}' does not exist.")
    try:
        data = parse_yaml(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, OSError) as err:
        raise ConfigError(f"Config file '{path}' cannot be read as UTF-8 text ({err}).") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"Config file '{path}' is not valid YAML{at}: "
                          f"{getattr(err, 'problem', err)}.") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"Config file '{path}' must hold a mapping at the top, "
                          f"not a {type(data).__name__}.")
    # A Hydra `defaults:` list is left in: validation reports it as an unknown key,
    # together with every other key novarl does not support (see format_error).
    return data


# ------------------------------------------------------------------- aliases
def canonical(tree: Any, parent: str = "") -> Any:
    """Rewrite alias keys to their canonical names, recursively."""
    if not isinstance(tree, dict):
        return tree
    out: dict[str, Any] = {}
    written: dict[str, str] = {}
    for key, value in tree.items():
        name = _canonical_key(parent, str(key))
        if name in out:
            raise ConfigError(f"'{_join(parent, written[name])}' and '{_join(parent, str(key))}' "
                              "name the same setting; give only one.")
        written[name] = str(key)
        out[name] = canonical(value, _join(parent, name))
    return out


def canonical_path(path: str) -> str:
    parts = path.split(".")
    fixed: list[str] = []
    for part in parts:
        fixed.append(_canonical_key(".".join(fixed), part))
    return ".".join(fixed)


def _canonical_key(parent: str, key: str) -> str:
    for alias_parent, alias, name in ALIASES:
        if alias_parent == parent and key == alias:
            return name
    return key


def _join(parent: str, key: str) -> str:
    return f"{parent}.{key}" if parent else key


# ------------------------------------------------------------------ overrides
def parse_override(item: str) -> tuple[str, Any]:
    key, sep, raw = item.partition("=")
    key = key.strip().lstrip("+")
    if not sep or not key or not re.fullmatch(r"[A-Za-z_][\w.]*", key):
        raise ConfigError(f"Override '{item}' is not of the form key.path=value "
                          "(e.g. policy.precision=bfloat16).")
    try:
        value = parse_yaml(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return key, value


def keyword_path(key: str) -> str:
    if key in KEYWORD_SHORTCUTS:
        return KEYWORD_SHORTCUTS[key]
    path = canonical_path(key.replace("__", "."))
    if "." in path or path in NovaRLConfig.model_fields:
        return path
    choices = list(KEYWORD_SHORTCUTS) + list(NovaRLConfig.model_fields)
    raise ConfigError(f"Unknown keyword override '{key}'{_did_you_mean(key, choices)}. Use a section "
                      "name with a dict, a shortcut, or a path with double underscores "
                      "(policy__precision='bfloat16').")


def set_path(tree: dict[str, Any], path: str, value: Any, *, merge: bool) -> None:
    node = tree
    parts = path.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"Cannot set '{path}': '{'.'.join(parts[:i + 1])}' is a value "
                              f"({child!r}), not a section.")
        node = child
    leaf = parts[-1]
    if merge and isinstance(value, dict) and isinstance(node.get(leaf), dict):
        node[leaf] = deep_merge(node[leaf], value)
    else:
        node[leaf] = value


def deep_merge(base: dict[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


# ------------------------------------------------------------- interpolation
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
    """Resolve `${a.b}` references and `${mul:x, y}`-style resolvers in place of strings."""

    def walk(node: Any, path: str, stack: tuple[str, ...]) -> Any:
        if isinstance(node, dict):
            return {k: walk(v, _join(path, str(k)), stack) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v, f"{path}[{i}]", stack) for i, v in enumerate(node)]
        if isinstance(node, str) and "${" in node:
            return resolve_string(node, path, stack)
        return node

    def lookup(ref: str, at: str, stack: tuple[str, ...]) -> Any:
        if ref in stack:
            raise ConfigError(f"'{at}': interpolation cycle {' -> '.join(stack + (ref,))}.")
        node: Any = tree
        for part in ref.split("."):
            if not isinstance(node, dict) or part not in node:
                raise ConfigError(f"'{at}': '${{{ref}}}' refers to a key that is not in the config.")
            node = node[part]
        return walk(node, ref, stack + (ref,))

    def resolve_string(text: str, at: str, stack: tuple[str, ...]) -> Any:
        while True:
            match = _INTERP.search(text)
            if match is None:
                return text
            value = evaluate(match.group(1).strip(), at, stack)
            if match.span() == (0, len(text)):
                return value
            text = text[:match.start()] + str(value) + text[match.end():]

    def evaluate(expr: str, at: str, stack: tuple[str, ...]) -> Any:
        name, colon, args = expr.partition(":")
        if not colon:
            return lookup(canonical_path(expr), at, stack)
        if name not in _RESOLVERS:
            raise ConfigError(f"'{at}': unknown resolver '{name}' in '${{{expr}}}'; "
                              f"known: {', '.join(sorted(_RESOLVERS))}.")
        try:
            values = [parse_yaml(a.strip()) for a in args.split(",")]
        except yaml.YAMLError:
            raise ConfigError(f"'{at}': cannot parse the arguments of '${{{expr}}}'.") from None
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            raise ConfigError(f"'{at}': '${{{expr}}}' takes numbers, got {values}.")
        try:
            return _RESOLVERS[name](*values)
        except (TypeError, ZeroDivisionError) as err:
            raise ConfigError(f"'{at}': cannot evaluate '${{{expr}}}': {err}.") from None

    return walk(tree, "", ())


# ------------------------------------------------------------------ validation
def validate(tree: dict[str, Any], where: str = "the config") -> NovaRLConfig:
    try:
        return NovaRLConfig.model_validate(tree)
    except ValidationError as err:
        lines = [format_error(e, tree) for e in err.errors()]
        raise ConfigError(f"Invalid config ({where}):\n" + "\n".join(f"  - {line}" for line in lines)) from None


def unknown_keys(tree: dict[str, Any]) -> list[str]:
    """validate's lines for the keys the schema does not have, whatever the values in `tree`."""
    try:
        NovaRLConfig.model_validate(tree)
    except ValidationError as err:
        return [format_error(e, tree) for e in err.errors() if e["type"] == "extra_forbidden"]
    return []


def format_error(error: Mapping[str, Any], tree: Mapping[str, Any]) -> str:
    loc = [str(p) for p in error["loc"] if not str(p).startswith(("function-after", "function-"))]
    # Union members show up as extra loc items (e.g. 'SchedulerStep'); keep real keys only.
    loc = [p for p in loc if not p[:1].isupper()]
    path = ".".join(loc) or "(top level)"
    if error["type"] == "extra_forbidden":
        parent = _model_at(NovaRLConfig, loc[:-1])
        choices = _field_names(parent) if parent else []
        if loc == ["defaults"]:
            return ("unknown key 'defaults': 'defaults' (Hydra inheritance) is not supported; "
                    "merge the base file into this one.")
        hint = _did_you_mean(loc[-1], choices)
        allowed = f" Allowed here: {', '.join(choices)}." if choices and not hint else ""
        return f"unknown key '{path}'{hint}.{allowed}"
    msg = error["msg"].removeprefix("Value error, ")
    if not loc or error.get("type") == "value_error" and isinstance(error.get("input"), dict):
        return msg  # a check across keys: the message names them
    value = error.get("input")
    shown = "missing" if error["type"] == "missing" else repr(value)
    return f"'{path}' = {shown}: {msg}"


def _model_at(model: type[BaseModel], loc: list[str]) -> type[BaseModel] | None:
    import typing

    for part in loc:
        if part.isdigit():
            continue
        field = model.model_fields.get(part)
        if field is None:
            return None
        candidates = [field.annotation, *typing.get_args(field.annotation)]
        nested = [c for arg in candidates for c in (arg, *typing.get_args(arg))
                  if isinstance(c, type) and issubclass(c, BaseModel)]
        if not nested:
            return None
        model = nested[0]
    return model


def _field_names(model: type[BaseModel]) -> list[str]:
    return [f.alias or name for name, f in model.model_fields.items()]


def _did_you_mean(key: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def dump_config(config: NovaRLConfig) -> str:
    """The resolved config as YAML, with canonical names (written beside each run)."""
    return yaml.safe_dump(config.model_dump(mode="json", by_alias=True), sort_keys=False)
