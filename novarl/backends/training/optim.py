"""Optimizer and learning-rate schedule from the config (torch.optim classes only)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from novarl.config.schema import OptimizerConfig, SchedulerMilestones, SchedulerStep
from novarl.errors import ConfigError


FUSED = ("Adam", "AdamW", "SGD", "Adagrad")
"""torch.optim classes with a fused kernel on FUSED_DEVICES: all the parameters in one kernel (on CUDA one
launch and no host sync; on the CPU one vectorised loop instead of a dozen operators a parameter, each of them
dispatched through DTensor on the DTensor backend: 3-6x faster steps of a small model's optimizer)."""
FUSED_DEVICES = ("cuda", "cpu")
FUSED_ON_DTENSORS = ("Adam", "AdamW")
"""Those whose fused kernel runs on DTensor parameters (FSDP2's, tensor parallelism's): torch gives DTensor a
sharding rule for fused Adam and AdamW alone, so SGD and Adagrad fuse on plain ones (one device) only."""


def build_optimizer(cfg: OptimizerConfig, params: Iterable[torch.nn.Parameter],
                    device: torch.device | None = None) -> torch.optim.Optimizer:
    """The configured torch optimizer; on a CUDA or CPU device its fused kernel where the class has one and
    policy.optimizer.kwargs chooses no implementation (neither `fused` nor `foreach`)."""
    from torch.distributed.tensor import DTensor

    name = cfg.name.removeprefix("torch.optim.")
    cls = getattr(torch.optim, name)
    kwargs = dict(cfg.kwargs)
    params = list(params)
    fusable = FUSED_ON_DTENSORS if any(isinstance(param, DTensor) for param in params) else FUSED
    chosen = {"fused", "foreach"} & set(kwargs)
    if device is not None and device.type in FUSED_DEVICES and name in fusable and not chosen:
        kwargs["fused"] = True
    try:
        if "betas" in kwargs:
            kwargs["betas"] = tuple(kwargs["betas"])
        return cls(params, **kwargs)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"policy.optimizer: {cfg.name}({kwargs}) failed: {err}.") from None


def build_scheduler(steps: Sequence[SchedulerStep | SchedulerMilestones] | None,
                    optimizer: torch.optim.Optimizer, total_steps: int) -> torch.optim.lr_scheduler.LRScheduler:
    """One scheduler, or several chained by SequentialLR at the given milestones; None (policy.scheduler:
    null): a constant learning rate."""
    import torch.optim.lr_scheduler as lrs

    steps = steps or []
    schedulers = []
    for i, step in enumerate(s for s in steps if isinstance(s, SchedulerStep)):
        cls = getattr(lrs, step.name.removeprefix("torch.optim.lr_scheduler."))
        try:
            schedulers.append(cls(optimizer, **step.kwargs))
        except (TypeError, ValueError) as err:
            raise ConfigError(f"policy.scheduler[{i}]: {step.name}({step.kwargs}) failed: {err}.") from None
    milestones = [m.milestones for m in steps if isinstance(m, SchedulerMilestones)]
    if not schedulers:
        return lrs.ConstantLR(optimizer, factor=1.0, total_iters=total_steps)
    if len(schedulers) == 1:
        return schedulers[0]
    return lrs.SequentialLR(optimizer, schedulers, milestones=milestones[0])
