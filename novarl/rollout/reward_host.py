"""Model-based rewards on devices of their own (reward.reward_model.resources, reward.judge.resources;
NeMo RL's env.reward_model.resources): the reward model or the judge runs in a Ray actor holding those
devices -- GPUs, or on a host without them as many CPU slots -- counted apart from the policy's
(backends/generation/layout.py reward_devices). Without resources it runs in the driver's process.

The actor starts at the reward's first call (the run's checks load no weights) and ends with the
run's Ray instance or when the reward is dropped.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

LOCAL = {"reward_model": "novarl.rewards.reward_model:reward_model", "llm_judge": "novarl.rollout.judge:llm_judge"}
"""Each model-based reward's factory in the process that runs it."""


def _local(name: str, settings: Any) -> Any:
    module, _, factory = LOCAL[name].partition(":")
    return getattr(importlib.import_module(module), factory)(settings)


class RewardHost:
    """The actor: the reward built where it runs."""

    def __init__(self, name: str, settings: Any) -> None:
        self.reward = _local(name, settings)

    def score(self, completions: list[str], columns: dict[str, Any]) -> list[Any]:
        return self.reward(completions, **columns)


class RemoteReward:
    """A model-based reward whose model runs in a Ray actor on `devices` devices of its own."""

    loads_model = True

    def __init__(self, name: str, settings: Any, devices: int) -> None:
        _local(name, settings)  # its settings checked here, its weights loaded by the actor
        self.name, self.settings, self.devices = name, settings, devices
        self.__name__ = name
        self._actor: Any = None

    def _start(self) -> Any:
        if self._actor is None:
            import ray

            from novarl.distributed.kept_ranks import drop_kept_ranks
            from novarl.distributed.ray_group import ensure_ray, forwarded_env, require_capacity
            from novarl.errors import UserError
            from novarl.logging.console import info

            ensure_ray()
            on_gpus = ray.cluster_resources().get("GPU", 0) > 0
            resource = "GPU" if on_gpus else "CPU"
            require_capacity({resource: self.devices}, f"{self.name}'s resources")
            drop_kept_ranks()  # rank processes kept from earlier runs (NOVARL_REUSE_RANKS) give their slots back
            free = _free(resource, self.devices, FREE_WAIT_S)
            if free < self.devices:  # else the actor would wait for them for ever
                raise UserError(f"{self.name} asks {self.devices} {resource}(s) of its own, and the Ray cluster has "
                                f"{free:g} free now: lower its resources or give the cluster more.")
            kind = "num_gpus" if on_gpus else "num_cpus"
            self._actor = ray.remote(RewardHost).options(**{kind: self.devices}, **forwarded_env()).remote(
                self.name, self.settings)
            info(f"{self.name}: a Ray actor on {self.devices} {'GPU' if on_gpus else 'CPU slot'}(s) of its own")
        return self._actor

    def __call__(self, completions: Sequence[str], **columns: Any) -> list[Any]:
        import ray

        return ray.get(self._start().score.remote(list(completions), columns))


FREE_WAIT_S = 30.0
"""Seconds a reward's actor waits for its devices to come free (processes just stopped give them back)."""


def _free(resource: str, wanted: float, wait_s: float) -> float:
    """The Ray cluster's free amount of `resource`, once it reaches `wanted` or after `wait_s` seconds."""
    import time

    import ray

    deadline = time.monotonic() + wait_s
    while True:
        free = ray.available_resources().get(resource, 0)
        if free >= wanted or time.monotonic() > deadline:
            return free
        time.sleep(0.2)


def _placed(name: str, settings: Any, block: Any) -> Any:
    resources = getattr(block, "resources", None)
    if resources is not None and (resources.gpus_per_node or resources.num_nodes):
        return RemoteReward(name, settings, resources.gpus_per_node or 1)
    return _local(name, settings)


def reward_model(settings: Any = None) -> Any:
    """The registered reward ``reward_model``: on reward.reward_model.resources, else in this process."""
    return _placed("reward_model", settings, getattr(settings, "reward_model", None))


def llm_judge(settings: Any = None) -> Any:
    """The registered reward ``llm_judge``: on reward.judge.resources, else in this process."""
    return _placed("llm_judge", settings, getattr(settings, "judge", None))
