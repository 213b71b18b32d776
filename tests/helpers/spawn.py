"""Tests that run ranks as spawned processes joined by gloo (no Ray): `spawned` starts them and
collects what each `send`s back."""

from __future__ import annotations

import io
import multiprocessing as mp
import queue
import socket
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
    """target(rank, world, port, results, *args) on `world` spawned processes (target joins the
    gloo group at 127.0.0.1:port and ends with `send`); their results by rank."""
    ctx = mp.get_context("spawn")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world, port, results, *args)) for r in range(world)]
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
