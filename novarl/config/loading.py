"""Load a config from YAML, dicts, keyword and dotted overrides; validate it once.

Precedence, lowest first: the schema's defaults, the YAML file (over its `defaults:`
base files, composed as NeMo RL composes them: config/files.py), a Python dict,
keyword overrides, then dotted command-line overrides (`a.b.c=value`). The
merged tree has its aliases rewritten, its `${...}` interpolations resolved
(OmegaConf style, config/interpolation.py: `${policy.model_name}`, `${.sibling}`,
`${oc.env:HOME}`, `${mul:a, b}`); a ROLL pipeline config becomes novarl's sections (config/roll.py);
NeMo RL's spellings are rewritten and its keys outside the schema taken out
(config/nemo_rl.py); the tree is then validated into a frozen `NovaRLConfig`.
Every failure is a `ConfigError` that lists every problem, one line each, naming
the key path, the bad value, what is allowed and, for a misspelled key, the
closest valid one; what loading warns about rides on the config (`load_warnings`).

Before any of the recursive steps runs, every input tree (a file, a dict, an override
value) is checked by `check_tree` (string keys, at most MAX_DEPTH levels, at most MAX_VALUES values
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

from novarl.config.files import (NestingError, _clip, canonical, canonical_path, check_mandatory,
                                 check_tree, compose_file, merge_over, parse_yaml, show_value)
from novarl.config.interpolation import resolve_interpolations
from novarl.config.nemo_rl import VALUE_NOTES, take_foreign, translate
from novarl.config.roll import from_roll, is_roll
from novarl.config.schema import NovaRLConfig
from novarl.config.unused import check_settings, refuse_settings
from novarl.errors import ConfigError

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
        where += " with overrides " + " ".join([*(f"{_clip(k, 80)}=..." for k in keyword_overrides),
                                                *(_clip(item, 80) for item in overrides)])
    for key, value in keyword_overrides.items():
        path = keyword_path(key)
        check_tree(value, f"Keyword override {_clip(key, 80)}=", prefix=path)
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
    refused = [*refused, *critic_over_policy(tree)]
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


def critic_over_policy(tree: dict[str, Any]) -> list[str]:
    """PPO's `value` section (its critic) starts from the policy's settings: merged, in place,
    over the policy's block (its generation and backend choice left out: the critic generates
    nothing and runs on the policy's backend). What it cannot hold is returned, refused."""
    value = tree.get("value")
    if value is None:
        return []
    if not isinstance(value, dict):
        return [f"'value' = {show_value(value)}: the critic's section is a mapping of policy settings "
                "({} takes the policy's)."]
    refused = [f"'value.{key}': the critic generates nothing and runs on the policy's backend; set it on the "
               "policy." for key in ("generation", "backend") if value.get(key) is not None]
    policy = {k: v for k, v in (tree.get("policy") or {}).items() if k not in ("generation", "backend")}
    if "model_name" in value and value["model_name"] != policy.get("model_name"):
        policy.pop("tokenizer", None)  # another model: its own tokenizer, unless the section names one
    if isinstance(policy.get("dtensor_cfg"), dict):  # the critic trains all its weights: no LoRA from the policy
        policy["dtensor_cfg"] = {k: v for k, v in policy["dtensor_cfg"].items() if k != "lora_cfg"}
    tree["value"] = merge_over(copy.deepcopy(policy), {k: v for k, v in value.items()
                                                         if k not in ("generation", "backend")})
    return refused


def schema_has(path: str) -> bool:
    """Whether `path` (dotted) is a field of novarl's schema."""
    parts = path.split(".")
    parent = _model_at(NovaRLConfig, parts[:-1])
    return parent is not None and parts[-1] in _field_names(parent)


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
