"""Tests that run ranks as spawned processes joined by gloo (no Ray): `spawned` starts them and
collects what each `send`s back."""

from __future__ import annotations

import io
import multiprocessing as mp
import queue
import tempfile
import time

import torch


def send(results, rank: int, value) -> None:
    """A spawned rank's result, as bytes (tensors through a queue would need this process alive),
    then the group's end."""
    import torch.distributed as dist

    buffer = io.BytesIO()
    torch.save(value, buffer)
    results.put((rank, buffer.getvalue()))
    dist.barrier()
    dist.destroy_process_group()


def spawned(target, world: int, *args, timeout: float = 300) -> list:
    """target(rank, world, rendezvous, results, *args) on `world` spawned processes (target joins
    its process group with init_method=rendezvous and ends with `send`); their results by rank.
    The rendezvous is a file of its own (a FileStore), not a port picked free beforehand: another
    test's process could take such a port before rank 0 listens on it (EADDRINUSE)."""
    ctx = mp.get_context("spawn")
    rendezvous = f"file://{tempfile.mkdtemp(prefix='novarl-spawn-')}/store"
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world, rendezvous, results, *args)) for r in range(world)]
    for proc in procs:
        proc.start()
    got, deadline = [], time.monotonic() + timeout
    try:
        while len(got) < world:  # a rank that dies before sending fails the test at once
            try:
                got.append(results.get(timeout=1))
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                assert not dead and time.monotonic() < deadline, f"spawned ranks ended with {dead or 'a timeout'}"
        for proc in procs:
            proc.join(timeout=60)
    finally:  # no rank outlives the test (a hung one would hold its ports)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
    assert [p.exitcode for p in procs] == [0] * world
    return [torch.load(io.BytesIO(data), weights_only=True) for _, data in sorted(got, key=lambda g: g[0])]


def checked_rank(rank: int, world: int, rendezvous: str, results, backend: str, check, *args) -> None:
    """A spawned rank that joins its group over `backend`, runs check(*args) and sends back None, or the
    traceback of what it raised."""
    import traceback

    import torch.distributed as dist

    dist.init_process_group(backend, init_method=rendezvous, rank=rank, world_size=world)
    try:
        check(*args)
        outcome = None
    except Exception:  # noqa: BLE001 (the test in the parent process shows it)
        outcome = traceback.format_exc()
    send(results, rank, outcome)


def in_a_fresh_process(check, *args, backend: str = "gloo") -> None:
    """check(*args) (a module-level function) on one spawned rank: for code that keeps process-wide state an
    earlier test in the same worker may have left behind (dynamo's caches; a torch.distributed world made again),
    failing with its traceback."""
    (outcome,) = spawned(checked_rank, 1, backend, check, *args)
    assert outcome is None, outcome
