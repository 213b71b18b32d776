"""The package layers of docs/architecture.md, read from the code: every import between novarl's
packages (those inside functions too) points down the declared order, except the edges listed in
KNOWN_UPWARD, each of which is to be removed (the test fails when a listed edge is gone, so that the
list only shrinks, and when a new one appears). Also: the count of backend-name comparisons outside
backends/ (issue 32's target: under 10) may not grow."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import novarl

PACKAGE = Path(novarl.__file__).parent
LAYERS = (
    ("errors", "types", "host"),
    ("config",),
    ("logging",),
    ("models",),
    ("data", "rewards"),
    ("algorithms",),
    ("distributed",),
    ("backends",),
    ("rollout",),
    ("plan",),
    ("trainer", "core"),
    ("cli", "__init__", "__main__"),
)
"""novarl's top-level packages and modules, lowest first: a package imports only from its own layer's
others and below (see docs/architecture.md for what each holds)."""
LEVEL = {name: level for level, names in enumerate(LAYERS) for name in names}
KNOWN_UPWARD: dict[tuple[str, str], str] = {}
"""(file under novarl/, imported module under novarl.) -> what removes it."""
BACKEND_NAMES = {"dtensor", "deepspeed", "megatron", "vllm", "hf", "sglang"}
BACKEND_COMPARISONS_AT_MOST = 9
"""Comparisons with a backend's name outside backends/ (issue 32: under 10), all in config/: ROLL's and
NeMo RL's translations (2026-11-26: 69 before the backend specs)."""


def imports() -> dict[tuple[str, str], int]:
    """(file under novarl/, imported novarl module without the prefix) -> line, for every import."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = str(path.relative_to(PACKAGE))
        for node in ast.walk(ast.parse(path.read_text(), name)):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("novarl."):
                found.setdefault((name, node.module.removeprefix("novarl.")), node.lineno)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("novarl."):
                        found.setdefault((name, alias.name.removeprefix("novarl.")), node.lineno)
    return found


def top(path_or_module: str) -> str:
    """The top-level package or module: 'backends' for 'backends/training/dtensor.py' or 'backends.protocols'."""
    first = path_or_module.replace("/", ".").split(".")[0]
    return first


def test_every_package_has_a_layer():
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    assert packages | modules <= set(LEVEL), sorted((packages | modules) - set(LEVEL))


def test_imports_point_down_the_layers_apart_from_the_listed_ones():
    upward = {}
    for (source, target), line in imports().items():
        here, there = top(source), top(target)
        if here != there and LEVEL[there] > LEVEL[here]:
            upward[(source, target)] = line
    new = {edge: line for edge, line in upward.items() if edge not in KNOWN_UPWARD}
    assert not new, "imports up the layers (docs/architecture.md): " + "; ".join(
        f"novarl/{source}:{line} imports novarl.{target}" for (source, target), line in sorted(new.items()))
    gone = set(KNOWN_UPWARD) - set(upward)
    assert not gone, f"no longer imported, take them out of KNOWN_UPWARD: {sorted(gone)}"
    print(f"{len(upward)} upward imports left: {sorted(upward)}")


def test_no_package_cycles_outside_the_listed_edges():
    graph = defaultdict(set)
    for source, target in imports():
        if (source, target) not in KNOWN_UPWARD and top(source) != top(target):
            graph[top(source)].add(top(target))
    order = sorted(LEVEL, key=LEVEL.get)
    for package in order:  # with the listed edges left out, the graph is layered, hence acyclic
        assert all(LEVEL[t] <= LEVEL[package] for t in graph[package]), package
        same_layer = {t for t in graph[package] if LEVEL[t] == LEVEL[package]}
        assert not any(package in graph[t] for t in same_layer), f"{package} and a package of its layer import each other"


def test_backend_name_comparisons_outside_backends_do_not_grow():
    count = 0
    for path in PACKAGE.rglob("*.py"):
        if path.relative_to(PACKAGE).parts[0] == "backends":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                names = [s.value for s in sides if isinstance(s, ast.Constant)]
                names += [e.value for s in sides if isinstance(s, (ast.Tuple, ast.Set, ast.List)) for e in s.elts
                          if isinstance(e, ast.Constant)]
                count += any(n in BACKEND_NAMES for n in names if isinstance(n, str))
    print(f"backend-name comparisons outside backends/: {count}")
    assert count <= BACKEND_COMPARISONS_AT_MOST


def test_no_checkpoint_folder_is_sniffed_for_its_backend_outside_backends():
    """Which backend wrote a checkpoint comes from its saved config (trainer/checkpoint.written_by), and
    its spec checks and exports its files: no `(path / "deepspeed").is_dir()` (a folder named for a
    backend looked for) outside backends/ (issue 32: there were 7)."""
    sniffs = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).parts[0] == "backends":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in ("is_dir", "is_file", "exists", "glob", "iterdir") \
                    and isinstance(joined := node.func.value, ast.BinOp) and isinstance(joined.op, ast.Div) \
                    and isinstance(joined.right, ast.Constant) and joined.right.value in BACKEND_NAMES:
                sniffs.append(f"novarl/{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not sniffs, sniffs
