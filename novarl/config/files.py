"""Config files: YAML read safely and bounded, composed over their `defaults:` base files
as NeMo RL composes them, checked for shape, and with the seeds' aliases rewritten.

Before any of the recursive steps runs, every input tree is checked by `check_tree`
(string keys, at most MAX_DEPTH levels, at most MAX_VALUES values with every use of a
YAML alias counted): a hostile or broken file ends in a ConfigError, not a
RecursionError or a run that expands an alias bomb forever.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from novarl.errors import ConfigError

MAX_DEPTH = 64
"""Deepest nesting of values a config may have (NeMo RL's deepest is under 10)."""

MAX_VALUES = 100_000
"""Most values (scalars, lists, mappings) a config may expand to, counting a YAML alias or
a `${...}` reference as often as it is used: enough for any real config, and small enough
that a "billion laughs" file (anchors of anchors, 1 KB expanding to 10^9 values) is refused
in milliseconds."""

class NestingError(yaml.composer.ComposerError):
    """The YAML is nested deeper than MAX_DEPTH."""


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads 1e-3 as a float (YAML 1.1 wants 1.0e-3), and stops at
    MAX_DEPTH levels of nesting (PyYAML's composer recurses once per level; past about
    300 it would end in a RecursionError)."""

    _depth = 0

    def compose_node(self, parent, index):
        if self._depth >= MAX_DEPTH:
            raise NestingError(None, None, f"values nested more than {MAX_DEPTH} levels deep; no setting is",
                               self.peek_event().start_mark)
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


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
def read_yaml(path: Path) -> dict[str, Any]:
    try:
        exists = path.is_file()
    except (OSError, ValueError) as err:  # a name too long, a NUL byte, a folder we may not enter
        raise ConfigError(f"Config file '{_clip(str(path))}' cannot be opened ({_os_reason(err)}).") from None
    if not exists:
        what = "is a folder, not a YAML file" if path.is_dir() else "does not exist"
        raise ConfigError(f"Config file '{path}' {what}.")
    try:
        data = parse_yaml(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, OSError) as err:
        raise ConfigError(f"Config file '{path}' cannot be read as UTF-8 text ({err}).") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"Config file '{path}' is not valid YAML{at}: "
                          f"{getattr(err, 'problem', err)}.") from None
    except (ValueError, OverflowError) as err:  # a scalar PyYAML matched but cannot build (2024-13-45, 10**5000)
        raise ConfigError(f"Config file '{path}' has a value YAML cannot read: {_clip(str(err))}.") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"Config file '{path}' must hold a mapping at the top, "
                          f"not a {type(data).__name__}.")
    return data


# -------------------------------------------------------------- base files
MAX_BASE_FILES = 64
"""Most files one `defaults:` chain may read (NeMo RL's longest is 3)."""

OVERRIDE_MARK = "_override_"
"""`_override_: true` in a mapping: it replaces the base file's mapping rather than merging into it."""

MANDATORY = "???"
"""OmegaConf's "must be given" value: a base file leaves it for a child or an override to set."""


def compose_file(path: Path) -> dict[str, Any]:
    """The file's tree merged over its base files, as NeMo RL's loader
    (nemo_rl/utils/config.py, load_config_with_inheritance) composes them: `defaults:` names
    one base file or a list of them, each relative to the folder of the file that names it
    (or absolute); each base is composed the same way first; bases merge in list order, so a
    later one wins, and the file itself merges last. Mappings merge key by key, anything else
    (lists, scalars, null) replaces. A mapping holding `_override_: true` replaces the base's
    mapping instead of merging into it. A value of '???' does not replace the base's value.
    Interpolations are resolved after composing, so a base's `${policy.model_name}` reads
    the child's model."""
    return _compose(path, ())


def _compose(path: Path, chain: tuple[Path, ...]) -> dict[str, Any]:
    key = path.expanduser().absolute()
    if key in chain:
        names = " -> ".join(str(p) for p in (*chain, key))
        raise ConfigError(f"Config file '{chain[0]}': its `defaults:` chain comes back to a file it has read "
                          f"({names}).")
    if len(chain) >= MAX_BASE_FILES:
        raise ConfigError(f"Config file '{chain[0]}': its `defaults:` chain reads more than {MAX_BASE_FILES} "
                          "files; no config needs that many.")
    tree = read_yaml(path)
    check_tree(tree, f"Config file '{path}'")
    defaults = tree.pop("defaults", None)
    tree = canonical(tree)
    if defaults is None:
        return merge_over({}, tree)
    names = [defaults] if isinstance(defaults, str) else defaults
    if not isinstance(names, list) or not names or not all(isinstance(n, str) and n.strip() for n in names):
        raise ConfigError(f"Config file '{path}': 'defaults' = {_clip(repr(defaults))} must name a base file "
                          "(a path relative to this file's folder) or a list of them.")
    base: dict[str, Any] = {}
    for name in names:
        parent = Path(name).expanduser()
        parent = parent if parent.is_absolute() else path.parent / parent
        if not parent.is_file():
            raise ConfigError(f"Config file '{path}': its base file 'defaults: {name}' ({parent}) "
                              f"{'is a folder' if parent.is_dir() else 'does not exist'}.")
        base = merge_over(base, _compose(parent, (*chain, key)))
    return merge_over(base, tree)


def merge_over(base: dict[str, Any], child: Mapping[str, Any]) -> dict[str, Any]:
    """`child` merged over `base` the way NeMo RL composes files (see compose_file)."""
    out = dict(base)
    for key, value in child.items():
        if key == OVERRIDE_MARK or value == MANDATORY and key in out:
            continue
        if isinstance(value, Mapping):
            replace = value.get(OVERRIDE_MARK) is True or not isinstance(out.get(key), dict)
            out[key] = merge_over({} if replace else out[key], value)
        else:
            out[key] = value
    return out


def check_mandatory(tree: Mapping[str, Any], parent: str = "") -> None:
    """Refuse, all in one message, the values a base file marked '???' that nothing set."""
    missing = _mandatory(tree, parent)
    if missing:
        raise ConfigError(f"{len(missing)} value(s) the config marks as mandatory ('{MANDATORY}') are not set: "
                          f"{', '.join(missing)}. Set each in the file or as an override (key.path=value).")


def _mandatory(node: Any, path: str) -> list[str]:
    if isinstance(node, dict):
        return [m for k, v in node.items() for m in _mandatory(v, _join(path, str(k)))]
    if isinstance(node, list):
        return [m for i, v in enumerate(node) for m in _mandatory(v, f"{path}[{i}]")]
    return [path] if node == MANDATORY else []


# ------------------------------------------------------------------ tree check
def check_tree(tree: Any, where: str, *, prefix: str = "") -> None:
    """Refuse, naming `where` and the key path, what the recursive steps after it cannot
    take: a key that is not a string (YAML reads unquoted null, true, no, 1 as values), more
    than MAX_DEPTH levels of nesting (counting the levels of `prefix`, the dotted path the
    tree goes under), more than MAX_VALUES values (YAML aliases counted as often as they are
    used), and a value that contains itself (a recursive alias).
    Iterative, and never visits more than MAX_VALUES values."""
    levels = prefix.count(".") + 1 if prefix else 0
    if levels > MAX_DEPTH:
        raise ConfigError(f"{where}: the key path has {levels:,} levels ('{_clip(prefix, 60)}'); no setting is nested "
                          f"more than {MAX_DEPTH} levels deep. Give the setting's own path (e.g. "
                          "policy.precision=bfloat16).")
    stack: list[tuple[Any, str, tuple[int, ...]]] = [(tree, prefix, ())]
    visited = 0
    while stack:
        node, path, parents = stack.pop()
        visited += 1
        if visited > MAX_VALUES:
            raise ConfigError(
                f"{where}: more than {MAX_VALUES:,} values (every use of a YAML alias counts, so anchors "
                f"that refer to anchors multiply); no config needs that many. Look near '{path or '(top level)'}' "
                "for aliases of aliases or a huge list.")
        if not isinstance(node, (dict, list)):
            continue
        if id(node) in parents:
            raise ConfigError(f"{where}: '{path}' contains itself (a YAML alias inside its own anchor).")
        if levels + len(parents) >= MAX_DEPTH:
            raise ConfigError(f"{where}: '{_clip(path, 120)}' is nested more than {MAX_DEPTH} levels deep; no setting "
                              "is.")
        inner = (*parents, id(node))
        if isinstance(node, list):
            stack.extend((value, f"{path}[{i}]", inner) for i, value in enumerate(node))
            continue
        for key, value in node.items():
            if not isinstance(key, str):
                raise ConfigError(
                    f"{where}: the key {_yaml_scalar(key)} {f'under {path!r}' if path else 'at the top level'} is "
                    "not a name: YAML reads unquoted null, ~, true, false, yes, no, on, off and numbers as "
                    "values, not strings. Setting names are strings; quote the key if it is meant as one.")
            stack.append((value, _join(path, key), inner))


def _yaml_scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value)


MISSING = object()
"""What tree_get returns for a path the tree does not hold (when no default is given)."""


def tree_get(tree: Any, path: str, default: Any = MISSING) -> Any:
    """The value at dotted `path` in a tree of mappings, or `default`."""
    for part in path.split("."):
        if not isinstance(tree, Mapping) or part not in tree:
            return default
        tree = tree[part]
    return tree


def show_value(value: Any, limit: int = 80) -> str:
    """A config value as a message shows it: YAML's null / true / false, long values cut."""
    text = "null" if value is None else str(value).lower() if isinstance(value, bool) else repr(value)
    return text if len(text) <= limit else f"{text[:limit - 20]}...{text[-10:]}"


def _clip(text: str, limit: int = 200) -> str:
    """`text`, or its start and end around an ellipsis when it is longer than `limit`."""
    if len(text) <= limit:
        return text
    return f"{text[:limit // 2]}...{text[-limit // 4:]} ({len(text):,} characters)"


def _os_reason(err: Exception) -> str:
    return getattr(err, "strerror", None) or str(err)


# ------------------------------------------------------------------- aliases
ALIASES: tuple[tuple[str, str, str], ...] = (
    ("", "algorithm", "grpo"),
    ("", "ppo", "grpo"),  # NeMo RL's PPO files: GRPO's keys (and PPO's) under another name
    ("grpo", "async_ppo", "async_grpo"),
    ("value", "dtensor_config", "dtensor_cfg"),
    ("value", "max_total_sequence_length", "max_seq_length"),
    ("grpo", "batch_size", "num_prompts_per_step"),
    ("policy", "dtensor_config", "dtensor_cfg"),
    ("policy", "max_total_sequence_length", "max_seq_length"),
    ("loss_fn", "reference_policy_kl_type", "kl_estimator"),
    ("policy.megatron_cfg.fp8_cfg", "fp8", "fp8_format"),
    ("value.megatron_cfg.fp8_cfg", "fp8", "fp8_format"),
)

# Flat keyword overrides the seeds' Python examples use, e.g.
# GRPOTrainer.from_pretrained(name, tensor_parallel_size=8).
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
    if path.count(".") >= MAX_DEPTH:  # no alias is that deep; check_tree refuses the path (this loop is quadratic)
        return path
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


