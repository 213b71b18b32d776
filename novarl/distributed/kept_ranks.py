"""Rank processes kept between runs of one driver process (NOVARL_REUSE_RANKS): the pool that
`RayWorkerGroup.shutdown` puts a group's placement and actors in and the next group of the same
shape takes them from (distributed/ray_group.py). Ray is imported here only when used."""

from __future__ import annotations

import os
from typing import Any

REUSE_RANKS_VARIABLE = "NOVARL_REUSE_RANKS"
"""Set to 1: when a run ends, its worker groups' rank processes stay up for the next run of this
process that asks for a group of the same shape (ranks, CPUs and GPUs each, process group or not),
which then skips starting them: about 6 s of imports a rank on 2 CPU cores. For sweeps and notebooks
that call `novarl.train` again and again, and the test suite. Only ranks whose roles all declare
`process_reusable` (they leave nothing behind in the process, or clear it in `leave_process`:
DTensor's, DeepSpeed's and Megatron's roles, Hugging Face engines) are kept; vLLM's engines end with
their process. A run with another shape stops the kept ones first (their resources
go to it)."""

_KEPT: dict[tuple, tuple[Any, list[Any], str]] = {}
"""(ranks, CPUs, GPUs a rank, process group, flavour) -> (placement group, actors, Ray session) kept by
`RayWorkerGroup.shutdown` under NOVARL_REUSE_RANKS, for the next group of that shape. The flavour is
what the group's role class says of the processes it changes for good (`process_flavour(kwargs)`:
Megatron's CPU emulation): only a group of the same flavour takes them."""


def reusing_ranks() -> bool:
    """NOVARL_REUSE_RANKS is set (not 0)."""
    return os.environ.get(REUSE_RANKS_VARIABLE, "0") not in ("", "0")


def _ray_session() -> str:
    """This driver's Ray instance and job (a new local instance numbers its jobs from 1 again)."""
    import ray

    context = ray.get_runtime_context()
    return f"{context.get_node_id()}/{context.get_job_id()}"


def keep(shape: tuple, placement: Any, actors: list[Any]) -> None:
    drop_kept_ranks(shape)  # one kept group of a shape
    _KEPT[shape] = (placement, actors, _ray_session())


def take_kept(shape: tuple) -> tuple[Any, list[Any]] | None:
    """The kept group of `shape` if there is one and its actors still answer; else None, with the kept
    groups of other shapes stopped (their resources go to the new group)."""
    import ray

    session = _ray_session()
    for key in [key for key, (_, _, of) in _KEPT.items() if of != session]:
        del _KEPT[key]  # kept under another Ray instance: they ended with it
    kept = _KEPT.pop(shape, None)
    if kept is None:
        drop_kept_ranks()
        return None
    placement, actors, _ = kept
    try:
        ray.get([a.pid.remote() for a in actors], timeout=30)
    except Exception:  # gone meanwhile
        kill(placement, actors)
        drop_kept_ranks()
        return None
    return placement, actors


def drop_kept_ranks(shape: tuple | None = None) -> None:
    """Stop the kept rank processes (of `shape` only, if given)."""
    import ray

    for key in [k for k in _KEPT if shape is None or k == shape]:
        placement, actors, session = _KEPT.pop(key)
        if ray.is_initialized() and session == _ray_session():
            kill(placement, actors)


def kill(placement: Any, actors: list[Any]) -> None:
    import ray
    from ray.util.placement_group import remove_placement_group

    for actor in actors:
        ray.kill(actor, no_restart=True)
    if actors:
        remove_placement_group(placement)
