"""A training role's device memory parked in host memory while colocated engines generate, and brought back
when the role next needs it.

Colocated, the engines (vLLM) generate on the training GPUs. vLLM's sleep mode frees the engine's memory while
the roles train; this is the other half: while the engines generate, the roles' optimizer states and weights
leave the device, so that the engine's share of the GPU (gpu_memory_utilization, 0.6 by default) is there for
it, and so that a model whose training states take most of a GPU can still generate beside them. NeMo RL does
the same around its refit (the optimizer's state offloaded before it, the weights after, both brought back for
training); the planner counts a colocated layout's peak as max(training, generation) for this reason
(plan/advisor.py).

Two groups, parked separately: "optimizer" (the optimizer's state and fp32 master weights) before a weight
sync, so that the engine's weights wake into its room, and "weights" (the parameters and buffers; the
gradients, none or zero between steps, freed without a copy and back zeroed) once the engines hold the new
ones. A role wakes a group when a method needs it (the `wakes` decorator): a pass needs the weights, an
optimizer step or a checkpoint both, so the optimizer's state stays on the host through the step's forward
and backward passes too (DeepSpeed's excepted: its gradient buckets are its optimizer's, so a pass wakes both).

Storages, not tensors: each distinct storage behind the given tensors (a DTensor's local shard; FSDP2's padded
shard, of which its parameter is a view; a tied weight once) is copied into a HostArena (page-locked where there
is a GPU, reused from one step to the next) and resized to 0 bytes; waking resizes it back and copies its bytes
in. Every tensor object, view, optimizer reference and compiled graph's guard stays what it was (megatron-core
frees its gradient buffers the same way: DistributedDataParallel.offload_grad_buffers). Storages already empty
(FSDP2's freed all-gather outputs), those on the host (FSDP2's CPU offload; every one on a CPU host, where
there is no device memory to free) and those no allocator made (a file's mapping, which a CPU model's loaded
weights may be) are left alone.
"""

from __future__ import annotations

import functools
import os
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Concatenate, ParamSpec, Protocol, TypeVar

import torch

from novarl.distributed.weight_sync import BUCKET_BYTES, HostArena

GROUPS = ("optimizer", "weights")
PARK_ON_CPU_VARIABLE = "NOVARL_PARK_ON_CPU"
"""1: colocated roles park on a CPU host too, host storages into host buffers (nothing is saved): how the tests
run the colocated flow with parking without a GPU."""


def parks_on_cpu() -> bool:
    return os.environ.get(PARK_ON_CPU_VARIABLE) == "1"


@dataclass
class _Parked:
    storage: torch.UntypedStorage
    nbytes: int
    copy: torch.Tensor | None
    """Its bytes in the host arena; None: freed without a copy (it comes back zeroed)."""


class Parking:
    """The parked storages of one role, by group."""

    def __init__(self) -> None:
        self.arenas: dict[str, HostArena] = {}
        self.parked: dict[str, list[_Parked]] = {}

    def park(self, group: str, keep: Iterable[torch.Tensor], drop: Iterable[torch.Tensor] = (),
             besides: Iterable[torch.Tensor] = (), *, host_too: bool = False) -> int:
        """Move `keep`'s storages to host memory and free `drop`'s (contents that need not survive) on the
        device, as group `group` (parked once: a second call before `wake` does nothing), except the storages
        behind `besides` (another group's: an optimizer that steps the weights themselves). host_too: host
        storages as well (a CPU host's test of the mechanism: PARK_ON_CPU_VARIABLE; nothing is freed there).
        Bytes freed."""
        if group in self.parked:
            return 0
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # no stream of the role's (a gradient reduction's) still at these storages
        other = _storages(besides, host_too)
        kept = {ptr: s for ptr, s in _storages(keep, host_too).items() if ptr not in other}
        dropped = [s for ptr, s in _storages(drop, host_too).items() if ptr not in kept and ptr not in other]
        arena = self.arenas.get(group)
        if arena is None:
            arena = self.arenas[group] = HostArena(
                pin=torch.cuda.is_available(), remedy="use dedicated generation "
                "(policy.generation.colocated.enabled=false)",
                holding="While colocated engines generate, the training states wait in page-locked host memory")
        held = arena.hold(_buckets(list(kept.values())))
        parked = [_Parked(storage, storage.nbytes(), copy)
                  for storage, (_, copy) in zip(kept.values(), (item for bucket in held for item in bucket),
                                                strict=True)]
        parked += [_Parked(storage, storage.nbytes(), None) for storage in dropped]
        for entry in parked:
            entry.storage.resize_(0)
        self.parked[group] = parked
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the freed blocks back to the driver, where the engine allocates
        return sum(entry.nbytes for entry in parked)

    def wake(self, *groups: str) -> None:
        """The groups' storages back on the device with their bytes (every group when none is named), the copies
        done before it returns: a library may read them on a stream of its own (ZeRO-3's all-gather stream does,
        without waiting for the current one). A storage that fails to come back (out of memory) stays recorded
        with those after it, for the next wake."""
        woke = False
        for group in groups or list(self.parked):
            entries, done = self.parked.get(group, []), 0
            try:
                for entry in entries:
                    entry.storage.resize_(entry.nbytes)
                    whole = _bytes_of(entry.storage)
                    if entry.copy is None:
                        whole.zero_()
                    else:
                        whole.copy_(entry.copy, non_blocking=True)
                    done += 1
            finally:
                del entries[:done]
                woke = woke or done > 0
            self.parked.pop(group, None)
        if woke and torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()

    def is_parked(self, group: str) -> bool:
        return group in self.parked


def _storages(tensors: Iterable[torch.Tensor], host_too: bool) -> dict[int, torch.UntypedStorage]:
    """The distinct non-empty storages behind `tensors` that parking moves (on a device, or anywhere with
    host_too), by address."""
    found: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        local = getattr(tensor, "_local_tensor", tensor)  # a DTensor: its shard holds the storage
        if local.is_meta or (local.device.type == "cpu" and not host_too):
            continue
        storage = local.untyped_storage()
        if storage.nbytes() > 0 and storage.resizable():
            found.setdefault(storage.data_ptr(), storage)
    return found


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A storage's whole bytes as a flat uint8 tensor."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _buckets(storages: list[torch.UntypedStorage]) -> list[list[tuple[str, torch.Tensor]]]:
    """The storages' bytes in buckets of about BUCKET_BYTES (a host buffer each), in order."""
    buckets: list[list[tuple[str, torch.Tensor]]] = []
    size = BUCKET_BYTES
    for storage in storages:
        if size + storage.nbytes() > BUCKET_BYTES:
            buckets.append([])
            size = 0
        buckets[-1].append(("", _bytes_of(storage)))
        size += storage.nbytes()
    return buckets


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors of an optimizer's state (Adam's moments; its step counts)."""
    return [value for state in optimizer.state.values() for value in state.values()
            if isinstance(value, torch.Tensor)]


def module_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """A module's parameters and buffers."""
    return [*module.parameters(), *module.buffers()]


def gradients(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in module.parameters() if p.grad is not None]


def held_tensors(*roots: object) -> list[torch.Tensor]:
    """Every tensor reachable from `roots` through attributes, lists, tuples, sets and dicts (keys and values):
    what an object of a library's own layout holds (DeepSpeed's ZeRO optimizers: flat buffers, partitions,
    gradient buckets). A module gives its parameters and buffers and is not entered further; Python modules,
    classes and functions are not entered."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()
    todo = list(roots)
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
        elif isinstance(obj, torch.nn.Module):
            found += module_tensors(obj)
        elif isinstance(obj, dict):
            todo += [*obj.keys(), *obj.values()]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo += list(obj)
        elif not isinstance(obj, _NOT_ENTERED):
            try:
                todo += list(vars(obj).values())
            except TypeError:  # no __dict__: a number, a string, a native object
                pass
    return found


_NOT_ENTERED = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
                functools.partial)


class HasParking(Protocol):
    parking: Parking


S = TypeVar("S", bound=HasParking)
P = ParamSpec("P")
R = TypeVar("R")


def wakes(*groups: str) -> Callable[[Callable[Concatenate[S, P], R]], Callable[Concatenate[S, P], R]]:
    """A role's method that needs these parked groups back on the device first."""

    def decorate(method: Callable[Concatenate[S, P], R]) -> Callable[Concatenate[S, P], R]:
        @functools.wraps(method)
        def woken(self: S, *args: P.args, **kwargs: P.kwargs) -> R:
            self.parking.wake(*groups)
            return method(self, *args, **kwargs)

        return woken

    return decorate

