"""Load a config from YAML, dicts, keyword and dotted overrides; validate it once.

Precedence, lowest first: the schema's defaults, the YAML file (over its `defaults:`
base files, composed as NeMo RL composes them: `compose_file`), a Python dict,
keyword overrides, then dotted command-line overrides (`a.b.c=value`). The
merged tree has its aliases rewritten, its `${...}` interpolations resolved
(OmegaConf style: `${policy.model_name}`, `${.sibling}`, `${oc.env:HOME}`,
`${mul:a, b}`); a ROLL pipeline config becomes novarl's sections (config/roll.py);
NeMo RL's spellings are rewritten and its keys outside the schema taken out
(config/nemo_rl.py); the tree is then validated into a frozen `NovaRLConfig`.
Every failure is a `ConfigError` that lists every problem, one line each, naming
the key path, the bad value, what is allowed and, for a misspelled key, the
closest valid one; what loading warns about rides on the config (`load_warnings`).

Before any of the recursive steps runs, every input tree is checked by
`check_tree` (string keys, at most MAX_DEPTH levels, at most MAX_VALUES values
with every use of a YAML alias counted), and interpolation is bounded the same
way: a hostile or broken file ends in a ConfigError, not a RecursionError or a
run that expands an alias bomb forever.
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

from novarl.config.nemo_rl import VALUE_NOTES, take_foreign, translate
from novarl.config.roll import from_roll, is_roll
from novarl.config.schema import NovaRLConfig
from novarl.config.unused import check_settings, refuse_settings
from novarl.errors import ConfigError

MAX_DEPTH = 64
"""Deepest nesting of values a config may have (NeMo RL's deepest is under 10)."""

MAX_VALUES = 100_000
"""Most values (scalars, lists, mappings) a config may expand to, counting a YAML alias or
a `${...}` reference as often as it is used: enough for any real config, and small enough
that a "billion laughs" file (anchors of anchors, 1 KB expanding to 10^9 values) is refused
in milliseconds."""

MAX_INTERPOLATED_CHARS = 1_000_000
"""Longest string an interpolation may build."""


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
ALIASES: tuple[tuple[str, str, str], ...] = (
    ("", "algorithm", "grpo"),
    ("grpo", "batch_size", "num_prompts_per_step"),
    ("policy", "dtensor_config", "dtensor_cfg"),
    ("policy", "max_total_sequence_length", "max_seq_length"),
    ("loss_fn", "reference_policy_kl_type", "kl_estimator"),
    ("policy.megatron_cfg.fp8_cfg", "fp8", "fp8_format"),
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
        tree = compose_file(Path(source))
    elif isinstance(source, Mapping):
        check_tree(source, "The config dict")
        tree = copy.deepcopy(dict(source))
        if "defaults" in tree:
            raise ConfigError("The config dict has 'defaults': base files are read only from a YAML file "
                              "(relative to it); load the file, or merge the base into the dict.")
    elif source is not None:
        raise ConfigError(f"A config is a YAML file path or a dict, not {type(source).__name__}.")
    tree = canonical(tree)
    overrides = list(overrides)
    if overrides or keyword_overrides:
        where += " with overrides " + " ".join([*(f"{k}=..." for k in keyword_overrides),
                                                *(_clip(item, 80) for item in overrides)])
    for key, value in keyword_overrides.items():
        path = keyword_path(key)
        check_tree(value, f"Keyword override {key}=", prefix=path)
        set_path(tree, path, canonical(dict(value), path) if isinstance(value, Mapping) else value, merge=True)
    for item in overrides:
        path, value = parse_override(item)
        path = canonical_path(path)
        check_tree(value, f"Override '{_clip(item)}'", prefix=path)
        set_path(tree, path, canonical(value, path), merge=False)
    check_mandatory(tree)
    try:
        tree = resolve_interpolations(tree)
    except ConfigError as err:
        # A broken reference is reported with the unknown keys (often the key it meant), not alone.
        unknown = unknown_keys(tree)
        if not unknown:
            raise
        lines = "\n".join(f"  - {line}" for line in [str(err), *unknown])
        raise ConfigError(f"Invalid config ({where}):\n{lines}") from None
    tree, refused, warnings, notes = read_roll(tree, where)
    more_refused, more_warnings = translate(tree)
    foreign = take_foreign(tree, schema_has)
    config = validate(tree, where, refused=[*refused, *more_refused, *foreign.refused, *refuse_settings(tree)])
    return with_warnings(config, [*warnings, *more_warnings, *filter(None, [foreign.warning()]),
                                  *check_settings(config)], notes)


def read_roll(tree: dict[str, Any], where: str) -> tuple[dict[str, Any], list[str], list[str], list[str]]:
    """(tree, refusals, warnings, notes): a ROLL pipeline config's keys turned into novarl's
    sections (config/roll.py), with novarl's own sections (overrides) merged over them; any
    other tree as it is."""
    if not is_roll(tree):
        return tree, [], [], []
    try:
        roll = from_roll({k: v for k, v in tree.items() if k not in NovaRLConfig.model_fields})
    except (TypeError, ValueError, AttributeError, ArithmeticError) as err:  # a value of a type ROLL never has
        raise ConfigError(f"Invalid config ({where}): a ROLL setting has a value of the wrong type or shape "
                          f"({type(err).__name__}: {_clip(str(err))}); compare it with ROLL's example "
                          "configs.") from None
    merged = merge_over(roll.tree, {k: v for k, v in tree.items() if k in NovaRLConfig.model_fields})
    return merged, roll.refused, roll.warnings, [f"ROLL: {line}" for line in roll.became]


def with_warnings(config: NovaRLConfig, warnings: Iterable[str], notes: Iterable[str] = ()) -> NovaRLConfig:
    """`config`, carrying the lines loading it gave (NeMo RL keys accepted and not used, names
    rewritten; what a ROLL config's blocks became): `novarl validate`, `plan` and `train` say
    each once (NovaRLConfig.load_warnings, load_notes)."""
    config._load_warnings = tuple(dict.fromkeys([*config.load_warnings, *warnings]))
    config._load_notes = tuple(dict.fromkeys([*config.load_notes, *notes]))
    return config


def schema_has(path: str) -> bool:
    """Whether `path` (dotted) is a field of novarl's schema."""
    parts = path.split(".")
    parent = _model_at(NovaRLConfig, parts[:-1])
    return parent is not None and parts[-1] in _field_names(parent)


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
    than MAX_DEPTH levels of nesting, more than MAX_VALUES values (YAML aliases counted as
    often as they are used), and a value that contains itself (a recursive alias).
    Iterative, and never visits more than MAX_VALUES values."""
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
        if len(parents) >= MAX_DEPTH:
            raise ConfigError(f"{where}: '{path}' is nested more than {MAX_DEPTH} levels deep; no setting is.")
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


def _clip(text: str, limit: int = 200) -> str:
    """`text`, or its start and end around an ellipsis when it is longer than `limit`."""
    if len(text) <= limit:
        return text
    return f"{text[:limit // 2]}...{text[-limit // 4:]} ({len(text):,} characters)"


def _os_reason(err: Exception) -> str:
    return getattr(err, "strerror", None) or str(err)


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
    if not sep or not key or not re.fullmatch(r"[A-Za-z_]\w*(?:\.\w+)*", key):
        raise ConfigError(f"Override '{_clip(item)}' is not of the form key.path=value "
                          "(e.g. policy.precision=bfloat16).")
    try:
        value = parse_yaml(raw) if raw.strip() else None
    except NestingError as err:
        raise ConfigError(f"Override '{_clip(item)}': {err.problem}.") from None
    except (yaml.YAMLError, ValueError, OverflowError):
        value = raw  # not YAML: the text itself (validation says if a string is wrong there)
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
    """Resolve `${a.b}` references, relative ones (`${.sibling}`, `${..key_of_the_parent}`, as
    OmegaConf reads them: one dot is the mapping that holds the string, each further dot one
    level up), `${oc.env:NAME}` / `${oc.env:NAME,default}` and `${mul:x, y}`-style resolvers in
    place of strings. A reference copies what it names, so references to references multiply
    like YAML aliases: the values built are counted against MAX_VALUES, strings against
    MAX_INTERPOLATED_CHARS."""
    built = 0

    def count(at: str) -> None:
        nonlocal built
        built += 1
        if built > MAX_VALUES:
            raise ConfigError(f"'{at}': the ${{...}} references expand to more than {MAX_VALUES:,} values "
                              "(references to references multiply); no config needs that many.")

    def walk(node: Any, path: str, stack: tuple[str, ...]) -> Any:
        count(path)
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
        for part in _path_parts(ref):
            if isinstance(node, dict) and part in node or isinstance(node, list) and isinstance(part, int) \
                    and 0 <= part < len(node):
                node = node[part]
            else:
                raise ConfigError(f"'{at}': '${{{ref}}}' refers to a key that is not in the config.")
        return walk(node, ref, stack + (ref,))

    def resolve_string(text: str, at: str, stack: tuple[str, ...]) -> Any:
        original = text
        while True:
            match = _INTERP.search(text)
            if match is None:
                return text
            # The message names the text as written: after substitution '${sub:${a}, 1}' is '${sub:inf, 1}'.
            where = at if text == original else f"{at}' = '{_clip(original)}"
            value = evaluate(match.group(1).strip(), at, where, stack)
            if match.span() == (0, len(text)):
                return value
            text = text[:match.start()] + str(value) + text[match.end():]
            if len(text) > MAX_INTERPOLATED_CHARS:
                raise ConfigError(f"'{at}': interpolation builds a string longer than "
                                  f"{MAX_INTERPOLATED_CHARS:,} characters.")

    def evaluate(expr: str, at: str, where: str, stack: tuple[str, ...]) -> Any:
        name, colon, args = expr.partition(":")
        if not colon:
            return lookup(canonical_path(absolute_reference(expr, at, where)), where, stack)
        if name == "oc.env":
            return environment_value(args, expr, where)
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

    return walk(tree, "", ())


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


# ------------------------------------------------------------------ validation
def validate(tree: dict[str, Any], where: str = "the config", *, refused: Iterable[str] = ()) -> NovaRLConfig:
    """The frozen config, or one ConfigError listing every problem: `refused` (lines found
    before, e.g. NeMo RL features that are on), then the schema's errors, one line each, then
    for each section with an unknown key the keys allowed there, once."""
    lines, allowed = list(refused), []
    try:
        config = NovaRLConfig.model_validate(tree)
    except ValidationError as err:
        problems, allowed = format_errors(err.errors(), tree)
        lines.extend(problems)
    else:
        if not lines:
            return config
    raise ConfigError(f"Invalid config ({where}): {len(lines)} problem(s):\n"
                      + "\n".join([*(f"  - {line}" for line in lines), *(f"  {line}" for line in allowed)])) from None


def format_errors(errors: list[Mapping[str, Any]], tree: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """One line per error, and the allowed keys of each section with an unknown key (and no
    close match), once per section."""
    lines, allowed = [], {}
    for error in errors:
        lines.append(format_error(error, tree))
        if error["type"] == "extra_forbidden":
            loc = _input_path(error["loc"], tree)
            parent = _model_at(NovaRLConfig, loc[:-1])
            choices = _field_names(parent) if parent else []
            if choices and not _did_you_mean(loc[-1], choices):
                allowed[".".join(loc[:-1]) or "the top level"] = choices
    return lines, [f"(allowed under '{section}': {', '.join(choices)})" for section, choices in allowed.items()]


def unknown_keys(tree: dict[str, Any]) -> list[str]:
    """validate's lines for the keys the schema does not have, whatever the values in `tree`."""
    try:
        NovaRLConfig.model_validate(tree)
    except ValidationError as err:
        problems, allowed = format_errors([e for e in err.errors() if e["type"] == "extra_forbidden"], tree)
        return [*problems, *allowed]
    return []


def format_error(error: Mapping[str, Any], tree: Mapping[str, Any]) -> str:
    loc = _input_path(error["loc"], tree)
    path = ".".join(loc) or "(top level)"
    if error["type"] == "extra_forbidden":
        parent = _model_at(NovaRLConfig, loc[:-1])
        choices = _field_names(parent) if parent else []
        return f"unknown key '{path}'{_did_you_mean(loc[-1], choices)}."
    msg = error["msg"].removeprefix("Value error, ")
    value = error.get("input")
    if isinstance(value, (str, int, float, bool)) and (".".join(loc), value) in VALUE_NOTES:
        msg = VALUE_NOTES[".".join(loc), value]
    if not loc or error.get("type") == "value_error" and isinstance(error.get("input"), dict) \
            and _model_at(NovaRLConfig, loc) is not None:
        return msg  # a check across the keys of a section: the message names them
    value = error.get("input")
    shown = "missing" if error["type"] == "missing" else _clip(repr(value))
    return f"'{path}' = {shown}: {msg}"


_TYPE_TAGS = {"str", "int", "float", "bool", "none", "dict", "list", "tuple"}


def _input_path(loc: Iterable[Any], tree: Any) -> list[str]:
    """The parts of a pydantic error location that are keys (or list indices) of the input:
    union members and validators also show up in it ('SchedulerStep', 'str', 'function-after')."""
    path, node = [], tree
    for part in loc:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        elif isinstance(node, dict) and isinstance(part, str) and part not in _TYPE_TAGS \
                and not part[:1].isupper() and not part.startswith("function-") and "[" not in part:
            node = None  # a key the input lacks: a missing field, named in the message
        else:
            continue
        path.append(str(part))
    return path


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
