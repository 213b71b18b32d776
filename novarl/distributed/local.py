"""The in-process worker group: one rank on this machine, no Ray.

It still runs inside a real torch.distributed process group (world size 1,
gloo on CPU, NCCL on GPU) so that the DTensor backend's FSDP2 and DCP code
paths are the same ones the multi-rank workers run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def collective_device(group=None) -> torch.device:
    """Where a collective over `group` (the default group if None) takes its tensors: the
    current GPU under NCCL, else the CPU (gloo)."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
        else torch.device("cpu")


def whole(tensor: DTensor) -> torch.Tensor:
    """A DTensor made whole on every rank of its mesh (a collective), gathered on the mesh's devices: under CPU
    offload FSDP2's shards live on the host, and NCCL takes GPU tensors."""
    if tensor.device.type != tensor.device_mesh.device_type:
        tensor = cast("DTensor", tensor.to(tensor.device_mesh.device_type))
    return tensor.full_tensor()


def ensure_single_process_group() -> None:
    """Join a world-size-1 process group unless one exists already."""
    if dist.is_initialized():
        return
    from novarl.distributed.rank_actor import pin_collectives_to_loopback

    pin_collectives_to_loopback()  # gloo listens even in a group of one: on this machine only
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
