"""Megatron-core's optimizer, schedule and data-parallel wrapper from policy.megatron_cfg, and the
optimizer state as checkpoints hold it (used by megatron.py)."""

from __future__ import annotations

from typing import Any

import torch

from novarl.backends.training.optim import FUSED_DEVICES
from novarl.errors import ConfigError


# ------------------------------------------------------------------ mapping
def ddp_config(mc, distributed_optimizer: bool):
    """megatron_cfg.distributed_data_parallel_config (and the top-level overlap_grad_reduce)
    as megatron-core's DistributedDataParallelConfig."""
    from megatron.core.distributed import DistributedDataParallelConfig

    d = mc.distributed_data_parallel_config
    kwargs: dict[str, Any] = dict(
        grad_reduce_in_fp32=d.grad_reduce_in_fp32, overlap_grad_reduce=mc.overlap_grad_reduce if "overlap_grad_reduce" in mc.model_fields_set
        else d.overlap_grad_reduce,
        overlap_param_gather=False, average_in_collective=False, use_distributed_optimizer=distributed_optimizer)
    if d.use_custom_fsdp:
        kwargs.update(use_custom_fsdp=True, data_parallel_sharding_strategy=d.data_parallel_sharding_strategy)
    return DistributedDataParallelConfig(**kwargs)


def build_optimizer(mc, model_chunks: list, *, precision: str, distributed: bool):
    """megatron_cfg.optimizer as megatron-core's optimizer over the stage's (DDP-wrapped) model
    chunks (Adam or SGD; distributed: its state and fp32 master weights partitioned over
    data-parallel ranks)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    o = mc.optimizer
    try:
        config = OptimizerConfig(
            optimizer=o.optimizer, lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
            bf16=precision == "bfloat16", fp16=precision == "float16",
            params_dtype={"bfloat16": torch.bfloat16, "float16": torch.float16}.get(precision, torch.float32),
            adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, sgd_momentum=o.sgd_momentum,
            use_distributed_optimizer=distributed, use_precision_aware_optimizer=o.use_precision_aware_optimizer,
            clip_grad=o.clip_grad)
    except (AssertionError, ValueError) as err:
        raise ConfigError(f"policy.megatron_cfg.optimizer: megatron-core refused it: {err}") from None
    _norms_without_host_reads()
    optimizer = get_megatron_optimizer(config, model_chunks)
    fuse_adam(optimizer)
    return optimizer


def fuse_adam(optimizer, device_types: tuple[str, ...] = FUSED_DEVICES) -> None:
    """torch's Adam behind megatron-core's optimizer (its choice where neither Transformer Engine nor Apex is
    installed, in torch's foreach implementation) switched to torch's fused kernel where every parameter it steps is
    on one device of a type in `device_types` (CUDA or the CPU), as the DTensor backend's optimizer is (optim.py):
    one kernel for all the parameters. Step counts already kept move to the parameters' device, where the fused
    kernel reads them (a state loaded from a checkpoint written before). Idempotent; after loading a state too (it
    brings its groups' settings)."""
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(chained, "optimizer", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):  # (Apex's and TE's are fused already)
            continue
        params = [param for group in inner.param_groups for param in group["params"]]
        if not params or params[0].device.type not in device_types or \
                any(param.device != params[0].device for param in params):
            continue
        for group in inner.param_groups:
            group.update(fused=True, foreach=False)
        inner.defaults.update(fused=True, foreach=False)
        for param in params:
            state = inner.state.get(param)
            if state and isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].to(param.device, torch.float32)


def foreach_l2_norm(chunk_size: int, noop_flag, tensor_lists: list[list[torch.Tensor]], per_tensor: bool, *args):
    """What megatron-core's gradient clipping asks of Apex's multi_tensor_l2norm: ([1] float32 L2 norm of the
    tensors of tensor_lists[0], None), in torch's foreach kernels, with no value read on the host."""
    tensors = tensor_lists[0]
    if not tensors:  # (megatron-core does not ask: it makes the zero norm itself, on the GPU)
        return torch.zeros(1, dtype=torch.float32, device="cuda" if torch.cuda.is_available() else "cpu"), None
    norms = torch._foreach_norm(tensors)
    return torch.linalg.vector_norm(torch.stack(norms).float()).reshape(1), None


def _norms_without_host_reads() -> None:
    """Where neither Transformer Engine nor Apex is installed, megatron-core's gradient clipping falls back to
    a local L2 norm that reads each gradient's norm on the host (`torch.tensor` of the per-tensor norms: a
    wait for the GPU per parameter, ~200 a step for a 28-layer model); `foreach_l2_norm` computes the same
    on the device (idempotent; this process's megatron-core)."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = foreach_l2_norm


def build_scheduler(mc, optimizer, total_steps: int):
    """megatron_cfg.scheduler as megatron-core's OptimizerParamScheduler, stepped once per
    optimizer step; lr_decay_iters defaults to the run's optimizer steps."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    s, o = mc.scheduler, mc.optimizer
    decay = max(s.lr_decay_iters or total_steps, s.lr_warmup_iters + 1)
    try:
        return OptimizerParamScheduler(
            optimizer, init_lr=s.lr_warmup_init, max_lr=o.lr, min_lr=o.min_lr, lr_warmup_steps=s.lr_warmup_iters,
            lr_decay_steps=decay, lr_decay_style=s.lr_decay_style,
            start_wd=o.weight_decay if s.start_weight_decay is None else s.start_weight_decay,
            end_wd=o.weight_decay if s.end_weight_decay is None else s.end_weight_decay,
            wd_incr_steps=max(total_steps, 1), wd_incr_style=s.weight_decay_incr_style)
    except (AssertionError, ValueError, KeyError) as err:
        raise ConfigError(f"policy.megatron_cfg.scheduler: megatron-core refused it: {err}") from None


def _optimizer_state(optimizer) -> dict[str, Any]:
    """A megatron-core optimizer's state on this rank, as it is: the torch optimizer's state,
    the parameters it steps (fp32 master weights, this rank's shard of them when distributed)
    and the loss scaler. (megatron-core's own parameter-state formats assume fused Adam's
    state keys; this works for any torch optimizer, on the same layout.)"""
    inner = optimizer.optimizer
    scaler = getattr(optimizer, "grad_scaler", None)
    return {"optimizer": inner.state_dict(),
            "params": [p.detach().to("cpu", copy=True) for g in inner.param_groups for p in g["params"]],
            "grad_scaler": scaler.state_dict() if scaler is not None else None}


def _load_optimizer_state(optimizer, state: dict[str, Any]) -> None:
    inner = optimizer.optimizer
    inner.load_state_dict(state["optimizer"])
    for param, saved in zip([p for g in inner.param_groups for p in g["params"]], state["params"], strict=True):
        param.copy_(saved)
    if state["grad_scaler"] is not None:
        optimizer.grad_scaler.load_state_dict(state["grad_scaler"])
