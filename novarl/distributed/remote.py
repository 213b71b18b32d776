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
from novarl.distributed.ray_group import RayWorkerGroup, wait_groups
from novarl.types import TrainBatch


class RemotePolicy:
    """TrainingBackend over a RayWorkerGroup of policy ranks (any training backend)."""

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

    def sample_tokens(self, prompts: list[list[int]], sampling, stop_ids: list[int], max_seq_length: int,
                      config) -> list[tuple[list[int], list[float]]]:
        """Megatron generation on the policy's own ranks (MegatronPolicy only)."""
        return self.group.call("sample_tokens", prompts, sampling, stop_ids, max_seq_length, config)

    def shutdown(self) -> None:
        self.group.shutdown()


class RemoteGenerator:
    """GenerationBackend on its own Ray actors (dedicated generation resources).

    After `connect(policy)` the weights go from the policy's rank 0 to the
    generator ranks over a process group of their own (see weight_sync), not
    through the driver; prompts and completions travel through Ray.
    """

    def __init__(self, group: RayWorkerGroup) -> None:
        self.group = group
        self.policy: RemotePolicy | None = None

    def connect(self, policy: RemotePolicy) -> None:
        """Form the weight-transfer group: policy rank 0 (which hosts its rendezvous) and every
        generator rank; both sides must join at once."""
        sender = policy.group.actors[0]
        host, port = policy.group._get([sender.address.remote()])[0]
        world = 1 + self.group.world_size
        wait_groups([(policy.group, [sender.join_weight_bridge.remote(host, port, 0, world)]),
                     (self.group, [a.join_weight_bridge.remote(host, port, 1 + i, world)
                                   for i, a in enumerate(self.group.actors)])])
        self.policy = policy

    def generate(self, prompts, sampling):
        return self.group.call("generate", list(prompts), sampling)

    def pull_weights(self, version: int) -> int:
        """The connected policy's current weights, sent rank to rank; bytes sent."""
        sent, _ = wait_groups([(self.policy.group, [a.send_weights.remote() for a in self.policy.group.actors]),
                               (self.group, [a.receive_weights.remote(version) for a in self.group.actors])])
        return sent[0]

    def update_weights(self, weights, version: int) -> None:
        """Weights given by the caller, through Ray's object store (when not connected)."""
        self.group.call("update_weights", list(weights), version)

    def shutdown(self) -> None:
        self.group.shutdown()


class RemoteReference:
    """The frozen reference, built beside the policy on the policy group's ranks (same
    processes and devices, as NeMo RL keeps it in the policy's workers)."""

    ROLE = "reference"

    def __init__(self, group: RayWorkerGroup) -> None:
        self.group = group

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return self.group.call_role(self.ROLE, "logprobs", batch)

    def shutdown(self) -> None:
        """Nothing of its own: the policy's group stops its processes."""
