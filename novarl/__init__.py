"""novarl: reinforcement-learning post-training of language models.

Public API (kept light: no vllm, deepspeed, megatron or ray at import time)::

    import novarl
    result = novarl.train(model="tiny-arith", dataset="arithmetic", reward_fn="exact_match", max_num_steps=200)
    trainer = novarl.GRPOTrainer.from_pretrained("tiny-arith", max_num_steps=50)
    trainer = novarl.GRPOTrainer(novarl.load_config("recipe.yaml"))

With no config, `train` and `GRPOTrainer` start from a recipe for the model (`novarl train`'s too):
the bundled tiny one for a bundled model, NeMo RL's grpo_math_1B sizes for any other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from novarl.config import NovaRLConfig, load_config
from novarl.errors import ConfigError, UserError

__version__ = "0.1.0"
__all__ = ["ConfigError", "GRPOTrainer", "NovaRLConfig", "TrainResult", "UserError",
           "load_config", "train"]

if TYPE_CHECKING:
    from novarl.trainer.api import GRPOTrainer, TrainResult, train


def __getattr__(name: str) -> Any:
    # The trainer pulls in torch and transformers; load it on first use only.
    if name in ("GRPOTrainer", "TrainResult", "train"):
        from novarl.trainer import api

        return getattr(api, name)
    raise AttributeError(f"module 'novarl' has no attribute {name!r}")
