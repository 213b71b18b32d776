"""Backend name -> spec: the one place a new backend is added.

A spec (backends/spec.py) says what the run's contract, the planner and the
trainer need to know of a backend, and names its implementation, imported only
when a run uses it (so `import novarl` stays light). A new training backend is a
module with its spec and classes (TrainingBackend / ReferenceBackend and
WeightSender, see protocols.py) plus a line in TRAINING; a new generation backend
(SGLang, say) a module with its spec and an Engine class plus a line in
GENERATION.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from novarl.backends.spec import GenerationSpec, TrainingSpec
    from novarl.config.schema import NovaRLConfig

TRAINING: dict[str, str] = {
    "megatron": "novarl.backends.training.megatron_spec",
    "deepspeed": "novarl.backends.training.deepspeed_spec",
    "dtensor": "novarl.backends.training.dtensor_spec",
}
"""Training backend -> the module of its SPEC, in the seeds' precedence (the first enabled one
trains; DTensor, the last, is the default)."""

GENERATION: dict[str, str] = {
    "hf": "novarl.backends.generation.hf_spec",
    "vllm": "novarl.backends.generation.vllm_spec",
    "megatron": "novarl.backends.generation.megatron_spec",
}
"""Generation backend -> the module of its SPEC."""

TRAINING_BACKENDS = tuple(TRAINING)
GENERATION_BACKENDS = tuple(GENERATION)
DEFAULT_TRAINING = TRAINING_BACKENDS[-1]
PREFERRED_GENERATION = "vllm"
"""The generation backend measured fastest on GPUs (and on CPUs for models of 10M parameters or more)."""
FALLBACK_GENERATION = "hf"
"""The generation backend that runs wherever the policy's model does (transformers alone)."""


def training_spec(name: str) -> TrainingSpec:
    return importlib.import_module(TRAINING[name]).SPEC


def generation_spec(name: str) -> GenerationSpec:
    return importlib.import_module(GENERATION[name]).SPEC


def training_specs() -> list[TrainingSpec]:
    """Every training backend's spec, in precedence order."""
    return [training_spec(name) for name in TRAINING]


def trains_on(cfg: NovaRLConfig) -> TrainingSpec:
    """The training backend `cfg` runs on: the first enabled one in precedence order, else the default.
    Also which backend wrote a checkpoint, from the config saved in it."""
    return next((spec for spec in training_specs() if spec.enabled(cfg)), training_spec(DEFAULT_TRAINING))
