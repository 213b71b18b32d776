"""Driver-side handles that make a Ray worker group look like one role.

The driver calls `policy.forward_backward(batch, loss, head)` the same way whether
the policy is an in-process object or ranks behind Ray; these classes forward
each call to every rank (the methods are collective) and return rank 0's
result, which the backends make the whole group's (metrics all-reduced,
logprobs all-gathered). Weights never come back to the driver: the generation
engines get them rank to rank (see backends/generation/engines.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from novarl.algorithms.losses import LossFn
from novarl.backends.protocols import Parkable, ReferenceBackend, Stoppable, TrainingBackend
from novarl.distributed.ray_group import RayWorkerGroup
from novarl.models.scores import Head
from novarl.types import TrainBatch


class RemotePolicy(TrainingBackend, Parkable, Stoppable):
    """TrainingBackend over a RayWorkerGroup of policy ranks (any training backend)."""

    def __init__(self, group: RayWorkerGroup) -> None:
        self.group = group

    def park(self, group: str, host_too: bool = False) -> int:
        """Each rank's role parks `group` where it parks (rank 0's bytes)."""
        return self.group.call_all_actors("park_role", None, group, host_too)[0]

    def forward_backward(self, batch: TrainBatch, loss: LossFn, head: Head) -> dict[str, float]:
        return self.group.call("forward_backward", batch, loss, head)

    def optim_step(self) -> dict[str, float]:
        return self.group.call("optim_step")

    def gpu_stats(self) -> dict[str, float]:
        return self.group.call("gpu_stats")

    def forward(self, batch: TrainBatch, head: Head) -> torch.Tensor:
        return self.group.call("forward", batch, head)

    def base_forward(self, batch: TrainBatch, head: Head) -> torch.Tensor:
        """A LoRA policy's base model, its adapters off (models/lora.py BaseReference)."""
        return self.group.call("base_forward", batch, head)

    def save(self, path: Path) -> None:
        self.group.call("save", path)

    def load(self, path: Path) -> None:
        self.group.call("load", path)

    def save_hf(self, path: Path, tokenizer, fmt=None) -> None:
        self.group.call("save_hf", path, tokenizer, fmt)

    def sample_tokens(self, prompts: list[list[int]], sampling, stop_ids: list[int], max_seq_length: int,
                      config) -> list[tuple[list[int], list[float]]]:
        """Megatron generation on the policy's own ranks (MegatronPolicy only)."""
        return self.group.call("sample_tokens", prompts, sampling, stop_ids, max_seq_length, config)

    def shutdown(self) -> None:
        self.group.shutdown()


class RemoteReference(ReferenceBackend, Parkable, Stoppable):
    """The frozen reference, built beside the policy on the policy group's ranks (same
    processes and devices, as NeMo RL keeps it in the policy's workers)."""

    ROLE = "reference"

    def __init__(self, group: RayWorkerGroup) -> None:
        self.group = group

    def forward(self, batch: TrainBatch, head: Head) -> torch.Tensor:
        return self.group.call_role(self.ROLE, "forward", batch, head)

    def park(self, group: str, host_too: bool = False) -> int:
        return self.group.call_all_actors("park_role", self.ROLE, group, host_too)[0]

    def shutdown(self) -> None:
        """Nothing of its own: the policy's group stops its processes."""


class RemoteCritic(TrainingBackend, Parkable, Stoppable):
    """PPO's critic, built beside the policy on the policy group's ranks (as NeMo RL's value
    workers share the training GPUs); its head is Values() (models/scores.py)."""

    ROLE = "critic"

    def __init__(self, group: RayWorkerGroup) -> None:
        self.group = group

    def forward_backward(self, batch: TrainBatch, loss: LossFn, head: Head) -> dict[str, float]:
        return self.group.call_role(self.ROLE, "forward_backward", batch, loss, head)

    def optim_step(self) -> dict[str, float]:
        return self.group.call_role(self.ROLE, "optim_step")

    def gpu_stats(self) -> dict[str, float]:
        return self.group.call_role(self.ROLE, "gpu_stats")

    def forward(self, batch: TrainBatch, head: Head) -> torch.Tensor:
        return self.group.call_role(self.ROLE, "forward", batch, head)

    def save(self, path: Path) -> None:
        self.group.call_role(self.ROLE, "save", path)

    def load(self, path: Path) -> None:
        self.group.call_role(self.ROLE, "load", path)

    def save_hf(self, path: Path, tokenizer, fmt=None) -> None:
        self.group.call_role(self.ROLE, "save_hf", path, tokenizer, fmt)

    def park(self, group: str, host_too: bool = False) -> int:
        return self.group.call_all_actors("park_role", self.ROLE, group, host_too)[0]

    def shutdown(self) -> None:
        """Nothing of its own: the policy's group stops its processes."""
