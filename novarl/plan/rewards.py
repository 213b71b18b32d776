"""The model-based rewards in a plan: the devices they hold apart from the policy, and whether each
model's weights fit the device it loads on.

A reward model (reward.reward_model) and an HF judge load whole on one device; a vLLM judge too (its
engine runs with tensor_parallel_size 1). On devices of their own (`resources`) the policy's layout
is planned over the rest (backends/generation/layout.py reward_devices); without them they load on
the driver's first GPU, beside whatever else the driver's node runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from novarl.config.schema import NovaRLConfig
from novarl.errors import UserError

HEADROOM = 0.9
"""Share of a device the weights may take (the rest: activations, KV cache, CUDA context)."""
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class RewardModelFit:
    key: str
    """reward.reward_model or reward.judge."""
    model: str
    parameters: int | None
    """None: the model's shape is not known without downloading it."""
    weights_gb: float | None
    devices: int
    """The devices it holds of its own (0: the driver's)."""
    fits: bool | None

    def describe(self, gpu_memory_gb: float) -> str:
        place = f"{self.devices} GPU(s) of its own" if self.devices else "the driver's first GPU"
        if self.parameters is None or self.weights_gb is None:
            return f"{self.key}: {self.model} on {place} (its size is not known without downloading it)"
        verdict = "fits" if self.fits else f"does not fit (at most {HEADROOM:.0%} of it for the weights)"
        unused = f"; it loads on one, the other {self.devices - 1} are idle" if self.devices > 1 else ""
        size = f"{self.parameters / 1e9:.1f}B" if self.parameters >= 1e9 else f"{self.parameters / 1e6:.1f}M"
        return (f"{self.key}: {self.model}, {size} parameters, {self.weights_gb:.1f} GB of "
                f"weights on {place}{unused}: {verdict} on a {gpu_memory_gb:.0f} GB GPU")


def reward_model_fits(cfg: NovaRLConfig, gpu_memory_gb: float) -> list[RewardModelFit]:
    """Each model-based reward the run calls, sized against one device of gpu_memory_gb GB."""
    from novarl.backends.contract.model_shape import ModelShape
    from novarl.models.loading import resolve_model_path

    used, reward = cfg.reward.used, cfg.reward
    blocks = [(key, block) for key, name, block in (("reward.reward_model", "reward_model", reward.reward_model),
                                                     ("reward.judge", "llm_judge", reward.judge)) if name in used]
    fits = []
    for key, block in blocks:
        held = block.resources
        devices = held.num_nodes * cfg.cluster.gpus_per_node if held.num_nodes else (held.gpus_per_node or 0)
        if not block.model_name:  # refused where the reward is built
            continue
        model = str(block.model_name)
        try:
            shape = ModelShape.from_name(resolve_model_path(model, download=False))
        except UserError:
            fits.append(RewardModelFit(key, model, None, None, devices, None))
            continue
        weights = shape.parameters * BYTES.get(block.precision, 2) / 1e9
        fits.append(RewardModelFit(key, model, shape.parameters, weights, devices,
                                   weights <= HEADROOM * gpu_memory_gb))
    return fits


def policy_cluster(cfg: NovaRLConfig) -> tuple[int, int]:
    """(GPUs per node, nodes) the policy's layout is planned over: the cluster's, less the devices the
    model-based rewards hold of their own."""
    from novarl.backends.generation.layout import reward_devices

    return reward_devices(cfg)
