"""The weight-transfer group: real processes over gloo, the tensors arrive bit for bit."""

import multiprocessing as mp
import socket

import pytest
import torch

from novarl.distributed import weight_sync


def weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        ("embed.weight", torch.randn(50, 8, generator=gen)),  # 1600 bytes
        ("layers.0.proj", torch.randn(8, 8, generator=gen)),  # 256
        ("lm_head.weight", torch.randn(50, 8, generator=gen)),  # 1600
        ("layers.0.scale", torch.randn(8, generator=gen).to(torch.bfloat16)),
        ("step", torch.tensor(seed, dtype=torch.int64)),  # a 0-d tensor
        # dtypes NCCL (and gloo) have no collective for go as their bytes
        ("ids", torch.randint(0, 2**16, (5,), generator=gen).to(torch.uint16)),
        ("mask", torch.rand(3, generator=gen) > 0.5),
        ("phase", torch.randn(2, generator=gen, dtype=torch.complex64)),
    ]


def peer(rank: int, world: int, port: int, results) -> None:
    # gloo even where there is a GPU: NCCL refuses two ranks of a group on one device
    bridge = weight_sync.WeightBridge("127.0.0.1", port, rank, world, device=torch.device("cpu"))
    arena = weight_sync.HostArena(pin=False)
    for seed in (1, 2):  # two updates over the same group, the second held in host memory first (async GRPO's)
        if rank == 0:
            buckets = weight_sync.bucketed(weights(seed), 2000)
            results.put((rank, seed, bridge.send(arena.hold(buckets) if seed == 2 else buckets)))
        else:
            got = list(bridge.receive())  # several buckets per dtype (2000 bytes at most)
            same = [name for (name, t), (n, want) in zip(got, weights(seed), strict=True)
                    if name == n and t.dtype == want.dtype and torch.equal(t, want)]
            results.put((rank, seed, len(same)))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_one_sender_two_receivers_get_every_tensor_exactly():
    ctx = mp.get_context("spawn")
    results, port, world = ctx.Queue(), free_port(), 3
    procs = [ctx.Process(target=peer, args=(rank, world, port, results)) for rank in range(world)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=120)
    assert [proc.exitcode for proc in procs] == [0, 0, 0]
    got = sorted(results.get(timeout=5) for _ in range(2 * world))
    nbytes = sum(t.numel() * t.element_size() for _, t in weights(0))
    count = len(weights(0))
    assert got == [(0, 1, nbytes), (0, 2, nbytes), (1, 1, count), (1, 2, count), (2, 1, count), (2, 2, count)]


def test_buckets_keep_order_split_by_dtype_and_size():
    named = weights(0)
    assert [[n for n, _ in b] for b in weight_sync.bucketed(named)] == [
        ["embed.weight", "layers.0.proj", "lm_head.weight"], ["layers.0.scale"], ["step"], ["ids"], ["mask"],
        ["phase"]]
    assert [[n for n, _ in b] for b in weight_sync.bucketed(iter(named), 2000)] == [
        ["embed.weight", "layers.0.proj"], ["lm_head.weight"], ["layers.0.scale"], ["step"], ["ids"], ["mask"],
        ["phase"]]


def test_the_host_arena_holds_each_update_in_the_same_buffers():
    """Queued weights are copied into one buffer per bucket of exactly its bytes, kept from one update to the next
    (pinned once on a GPU host, not tensor by tensor: torch's pinned allocator rounds each to a power of two)."""
    arena = weight_sync.HostArena(pin=False)
    first = arena.hold(weight_sync.bucketed(weights(1), 2000))
    pointers = [buffer.data_ptr() for buffer in arena.buffers]
    assert [buffer.numel() for buffer in arena.buffers] == [
        sum(t.numel() * t.element_size() for _, t in bucket) for bucket in weight_sync.bucketed(weights(1), 2000)]
    second = arena.hold(weight_sync.bucketed(weights(2), 2000))
    assert [buffer.data_ptr() for buffer in arena.buffers] == pointers
    flat = [pair for bucket in second for pair in bucket]
    assert [(n, t.dtype, t.shape) for n, t in flat] == [(n, t.dtype, t.shape) for n, t in weights(2)]
    assert all(torch.equal(t, want) for (_, t), (_, want) in zip(flat, weights(2), strict=True))
    assert torch.equal(first[0][0][1], weights(2)[0][1])  # the first update's copies were overwritten in place
    fewer = arena.hold(weight_sync.bucketed(weights(3)[:2], 2000))  # another layout: buffers made to fit it
    assert len(arena.buffers) == 1 and torch.equal(fewer[0][1][1], weights(3)[1][1])
    arena.release()
    assert arena.buffers == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_host_arena_pins_its_buffers_on_a_gpu_host():
    arena = weight_sync.HostArena()
    held = arena.hold(weight_sync.bucketed([(n, t.cuda()) for n, t in weights(1)], 2000))
    assert arena.pin and len(arena.pinned) == len(arena.buffers) and all(t.is_pinned() for b in held for _, t in b)
    flat = weight_sync.flat_on(held[0], torch.device("cuda"))  # asynchronous copies from the pinned buffer
    first = next(weight_sync.bucketed(weights(1), 2000))
    assert torch.equal(flat.cpu(), torch.cat([t.reshape(-1) for _, t in first]))
    arena.release()
    assert not arena.pinned
    # one dropped without release (its role's process reused) unpins its buffers as it goes
    dropped = weight_sync.HostArena()
    pinned, buffers = dropped.pinned, dropped.buffers
    dropped.hold(weight_sync.bucketed([(n, t.cuda()) for n, t in weights(1)], 2000))
    assert pinned and buffers
    del dropped
    import gc

    gc.collect()
    assert not pinned and not buffers
