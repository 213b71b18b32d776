"""Driver-side handles that make a Ray worker group look like one role.

The driver calls `policy.forward_backward(batch, loss)` the same way whether
the policy is an in-process object or ranks behind Ray; these classes forward
each call to every rank (the methods are collective) and return rank 0's
result, which the backends make the whole group's (metrics all-reduced,
logprobs all-gathered, full weights gathered on rank 0).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from novarl.algorithms.losses import LossFn
from novarl.distributed.ray_group import RayWorkerGroup
from novarl.types import TrainBatch


class RemotePolicy:
    """TrainingBackend over a RayWorkerGroup of DTensorPolicy ranks."""

    def __init__(self, group: RayWorkerGroup) -> None:
        self.group = group

    def forward_backward(self, batch: TrainBatch, loss: LossFn) -> dict[str, float]:
        return self.group.call("forward_backward", batch, loss)

    def optim_step(self) -> dict[str, float]:
        return self.group.call("optim_step")

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return self.group.call("logprobs", batch)

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.group.call("full_state_dict").items()

    def save(self, path: Path) -> None:
        self.group.call("save", path)

    def load(self, path: Path) -> None:
        self.group.call("load", path)

    def save_hf(self, path: Path, tokenizer) -> None:
        self.group.call("save_hf", path, tokenizer)

    def shutdown(self) -> None:
        self.group.shutdown()


class RemoteGenerator:
    """GenerationBackend on its own Ray actor (dedicated generation resources).

    Weights travel from the trainer through the driver and Ray's object store,
    one copy per update; completions come back the same way.
    """

    def __init__(self, group: RayWorkerGroup) -> None:
        self.group = group

    def generate(self, prompts, sampling):
        return self.group.call("generate", list(prompts), sampling)

    def update_weights(self, weights, version: int) -> None:
        self.group.call("update_weights", list(weights), version)

    def shutdown(self) -> None:
        self.group.shutdown()


class RemoteReference:
    """The frozen reference over a RayWorkerGroup of DTensorReference ranks."""

    def __init__(self, group: RayWorkerGroup) -> None:
        self.group = group

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return self.group.call("logprobs", batch)

    def shutdown(self) -> None:
        self.group.shutdown()
