"""The roles' Protocols (backends/protocols.py) held to: every registered backend's classes inherit the
Protocols of their role and define each of its methods themselves (a Protocol's `...` body, inherited,
would silently return None), and mypy finds no type error in backends/, trainer/ and distributed/
(its settings: pyproject.toml's [tool.mypy])."""

from __future__ import annotations

import importlib
import subprocess
import sys
import time
from pathlib import Path

import pytest

from novarl.backends import protocols
from novarl.backends.registry import GENERATION, TRAINING, generation_spec, training_spec
from novarl.backends.spec import load

ROOT = Path(__file__).resolve().parents[1]
WORKER_GROUPS = {
    "novarl.backends.generation.engines:LocalGeneration": (protocols.GenerationBackend, protocols.QueuedWeights,
                                                           protocols.Offloadable),
    "novarl.backends.generation.engines:ColocatedEngines": (protocols.GenerationBackend, protocols.Offloadable),
    "novarl.backends.generation.engines:DedicatedEngines": (protocols.GenerationBackend, protocols.QueuedWeights),
    "novarl.backends.generation.engines:Ready": (protocols.Rollout,),
    "novarl.backends.generation.engines:RayRollout": (protocols.Rollout,),
    "novarl.backends.remote:RemotePolicy": (protocols.TrainingBackend, protocols.Stoppable),
    "novarl.backends.remote:RemoteReference": (protocols.ReferenceBackend, protocols.Stoppable),
    "novarl.backends.remote:RemoteCritic": (protocols.TrainingBackend, protocols.Stoppable),
}
"""The classes outside the registry that the driver holds as a role, and their Protocols."""


def registered() -> dict[str, tuple[type, ...]]:
    """'module:Class' -> the Protocols it implements, for every class the registry's specs name."""
    roles: dict[str, tuple[type, ...]] = {}
    for name in TRAINING:
        spec = training_spec(name)
        roles[spec.policy_class] = (protocols.TrainingBackend, protocols.WeightSender)
        roles[spec.reference_class] = (protocols.ReferenceBackend,)
        roles[spec.critic_class] = (protocols.TrainingBackend,)
    for name in GENERATION:
        spec = generation_spec(name)
        if spec.engine_class:
            roles[spec.engine_class] = (protocols.Engine,)
        if spec.on_policy_ranks_class:
            roles[spec.on_policy_ranks_class] = (protocols.GenerationBackend,)
    return roles


def implementation(path: str) -> type:
    """The class, imported; skipped only where megatron-core is what fails to import."""
    if "megatron" in path:
        try:
            importlib.import_module("megatron.core")
        except ImportError as err:
            pytest.skip(f"megatron-core does not import: {err}")
    return load(path)


def protocol_methods(protocol: type) -> set[str]:
    """The methods a Protocol declares, its own and its Protocol bases'."""
    return {name for base in protocol.__mro__ if getattr(base, "_is_protocol", False)
            and base.__module__ != "typing" for name, value in vars(base).items()
            if callable(value) and not name.startswith("_")}


@pytest.mark.parametrize("path, roles", [*registered().items(), *WORKER_GROUPS.items()])
def test_each_role_class_inherits_its_protocols_and_defines_their_methods(path, roles):
    cls = implementation(path)
    missing = [role.__name__ for role in roles if role not in cls.__mro__]
    assert not missing, f"{path} does not inherit {missing}"
    inherited = []
    for role in roles:
        for name in sorted(protocol_methods(role)):
            owner = next(base for base in cls.__mro__ if name in vars(base))
            if getattr(owner, "_is_protocol", False):
                inherited.append(f"{name} (only {owner.__name__}'s declaration)")
    assert not inherited, f"{path} does not define: {', '.join(inherited)}"


def test_mypy_finds_no_type_errors():
    """Cold on a 2-core CPU about 25 s (torch's own types read; the heavy optional libraries skipped)."""
    pytest.importorskip("mypy")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "mypy"],
                          cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    print(f"mypy: {seconds:.0f} s\n{done.stdout}{done.stderr}")
    assert done.returncode == 0, f"mypy (pyproject.toml's [tool.mypy]) found:\n{done.stdout}{done.stderr}"
