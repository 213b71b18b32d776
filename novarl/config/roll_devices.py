"""ROLL's pipeline configs, the pieces every part of the translation shares (config/roll.py
reads the file): the role names, the Translation being built, number checks, and the device
mappings turned into novarl's cluster and placement."""

from __future__ import annotations

import ast
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from novarl.config.files import show_value

ROLES = ("actor_train", "actor_infer", "reference")



@dataclass
class Translation:
    tree: dict[str, Any] = field(default_factory=dict)
    """novarl's sections."""
    refused: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    became: list[str] = field(default_factory=list)
    """One line per ROLL block: what it became in novarl's terms."""

    def set(self, path: str, value: Any) -> None:
        node = self.tree
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value

    def refuse(self, key: str, value: Any, why: str) -> None:
        self.refused.append(f"'{key}' = {show_value(value)}: {why}.")


def _number(block: Mapping[str, Any], key: str, out: Translation, where: str = "", *, integer: bool = False,
            positive: bool = True) -> Any:
    """block[key] when it is a number of the right kind (None when absent); refused otherwise."""
    value = block.get(key)
    if value is None:
        return None
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or (positive and value <= 0) or value != value:
        what = "a positive whole number" if integer and positive else "a positive number" if positive else "a number"
        out.refuse(f"{where}{key}", value, f"it must be {what}")
        return None
    return value


# ------------------------------------------------------------------ devices
@dataclass(frozen=True)
class Placement:
    train: tuple[int, ...]
    infer: tuple[int, ...]
    gpus_per_node: int
    colocated: bool


def parse_devices(value: Any, where: str) -> tuple[int, ...]:
    """ROLL's device_mapping: a list of ints, or a string `list(range(a, b[, step]))` / `[0, 1, ...]`."""
    if isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                                 for v in value):
        return tuple(value)
    if isinstance(value, str):
        match = re.fullmatch(r"\s*list\(\s*range\(\s*(\d+)\s*(?:,\s*(\d+)\s*)?(?:,\s*(\d+)\s*)?\)\s*\)\s*", value)
        if match:
            a, b, step = match.groups()
            start, stop = (0, int(a)) if b is None else (int(a), int(b))
            devices = tuple(range(start, stop, int(step or 1)))
            if devices:
                return devices
        listed = re.fullmatch(r"\s*list\(\s*(\[.*\])\s*\)\s*", value)  # list([0, 1, 8, 9])
        try:
            parsed = ast.literal_eval(listed.group(1) if listed else value)
        except (ValueError, SyntaxError):
            parsed = None
        if isinstance(parsed, (list, tuple)) and parsed and all(isinstance(v, int) and v >= 0 for v in parsed):
            return tuple(parsed)
    raise ValueError(f"'{where}' = {show_value(value)}: a device mapping is a list of GPU indices or "
                     "'list(range(a, b))'")


def own_devices(out: Translation, key: str, count: int, nodes: int, per_node: int) -> bool:
    """`count` devices of a role's own, apart from the training ones, as NeMo RL counts them: `key`.gpus_per_node
    of the one node, or `key`.num_nodes whole nodes of several; False (nothing set) when they are not whole
    nodes of several."""
    if nodes == 1:
        out.set(f"{key}.gpus_per_node", count)
    elif count % per_node == 0:
        out.set(f"{key}.num_nodes", count // per_node)
    else:
        return False
    return True


def role_devices(tree: Mapping[str, Any]) -> frozenset[int]:
    """Every device a role of the policy's names in its device_mapping (one that cannot be read is
    refused where its role is read)."""
    taken: set[int] = set()
    for role in ROLES:
        block = tree.get(role)
        if isinstance(block, Mapping) and block.get("device_mapping") is not None:
            try:
                taken.update(parse_devices(block["device_mapping"], role))
            except ValueError:
                pass
    return frozenset(taken)


def placement(tree: Mapping[str, Any], out: Translation) -> Placement | None:
    gpus_per_node = _number(tree, "num_gpus_per_node", out, integer=True) if "num_gpus_per_node" in tree else 8
    if gpus_per_node is None:
        return None
    mappings = {}
    for role in ROLES:
        block = tree.get(role)
        if isinstance(block, Mapping) and block.get("device_mapping") is not None:
            try:
                mappings[role] = parse_devices(block["device_mapping"], f"{role}.device_mapping")
            except ValueError as err:
                out.refused.append(f"{err}.")
    if "actor_train" not in mappings:
        out.refused.append("'actor_train.device_mapping' is missing: novarl needs the training devices.")
        return None
    train = mappings["actor_train"]
    infer = mappings.get("actor_infer", train)
    overlap = set(train) & set(infer)
    if overlap and not set(infer) <= set(train):
        out.refused.append(f"'actor_infer.device_mapping' shares {len(overlap)} of its {len(infer)} devices with "
                           "actor_train: generation is either on the training devices (colocated) or on devices of "
                           "its own (dedicated), not partly both.")
        return None
    every = sorted({*train, *infer, *mappings.get("reference", ())})
    devices = max(every) + 1
    nodes = math.ceil(devices / gpus_per_node)
    out.set("cluster.gpus_per_node", gpus_per_node)
    out.set("cluster.num_nodes", nodes)
    colocated = bool(overlap)
    out.set("policy.generation.colocated.enabled", colocated)
    if colocated and len(infer) < len(train):
        out.warnings.append(f"actor_infer.device_mapping names {len(infer)} of actor_train's {len(train)} devices: "
                            f"novarl's colocated generation runs an engine on each of the {len(train)}")
    if not colocated:
        if not own_devices(out, "policy.generation.colocated.resources", len(infer), nodes, gpus_per_node):
            out.refused.append(f"'actor_infer.device_mapping': {len(infer)} devices on a {nodes}-node cluster; "
                               "dedicated generation on several nodes takes whole nodes "
                               f"({gpus_per_node} devices each).")
    if len(train) + (0 if colocated else len(infer)) != devices:
        out.warnings.append(f"the roles name {len(set(every))} of devices 0-{devices - 1}: novarl's cluster is "
                            f"{nodes} node(s) x {gpus_per_node}, and training takes every device generation does not")
    return Placement(train, infer, gpus_per_node, colocated)
