"""Backend name -> implementation: the one place a new backend is added.

Each entry names a module and its classes, imported only when a run uses them
(so `import novarl` stays light). A new training backend is a module with a
policy and a reference class (TrainingBackend / ReferenceBackend and
WeightSender, see protocols.py) plus a line in TRAINING; a new generation engine
(SGLang, say) is a module with an Engine class that has `engine_kwargs` plus a
line in ENGINES.
"""

from __future__ import annotations

import importlib

TRAINING: dict[str, tuple[str, str, str]] = {
    "dtensor": ("novarl.backends.training.dtensor", "DTensorPolicy", "DTensorReference"),
    "deepspeed": ("novarl.backends.training.deepspeed", "DeepSpeedPolicy", "DeepSpeedReference"),
    "megatron": ("novarl.backends.training.megatron", "MegatronPolicy", "MegatronReference"),
}
"""Training backend -> (module, policy class, reference class)."""

CRITICS: dict[str, tuple[str, str]] = {
    "dtensor": ("novarl.backends.training.dtensor", "DTensorCritic"),
    "deepspeed": ("novarl.backends.training.deepspeed", "DeepSpeedCritic"),
    "megatron": ("novarl.backends.training.megatron_critic", "MegatronCritic"),
}
"""Training backend -> (module, PPO critic class): a TrainingBackend whose logprobs are values."""

ENGINES: dict[str, tuple[str, str]] = {
    "hf": ("novarl.backends.generation.hf", "HFGeneration"),
    "vllm": ("novarl.backends.generation.vllm", "VllmGeneration"),
}
"""Generation backend with engines of its own -> (module, Engine class)."""

ON_POLICY_RANKS: dict[str, tuple[str, str]] = {
    "megatron": ("novarl.backends.generation.megatron", "MegatronGeneration"),
}
"""Generation backend that samples with the policy's own model on its ranks -> (module,
GenerationBackend class taking the policy)."""

TRAINING_BACKENDS = tuple(TRAINING)
GENERATION_BACKENDS = (*ENGINES, *ON_POLICY_RANKS)


def training_classes(name: str) -> tuple[type, type]:
    """(policy class, reference class) of a training backend."""
    module, policy, reference = TRAINING[name]
    loaded = importlib.import_module(module)
    return getattr(loaded, policy), getattr(loaded, reference)


def critic_class(name: str) -> type:
    module, cls = CRITICS[name]
    return getattr(importlib.import_module(module), cls)


def engine_class(name: str) -> type:
    module, cls = ENGINES[name]
    return getattr(importlib.import_module(module), cls)


def on_policy_class(name: str) -> type:
    module, cls = ON_POLICY_RANKS[name]
    return getattr(importlib.import_module(module), cls)
