"""The weight-transfer group: real processes over gloo, the tensors arrive bit for bit."""

import multiprocessing as mp
import socket

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
    ]


def peer(rank: int, world: int, port: int, results) -> None:
    # gloo even where there is a GPU: NCCL refuses two ranks of a group on one device
    bridge = weight_sync.WeightBridge("127.0.0.1", port, rank, world, device=torch.device("cpu"))
    for seed in (1, 2):  # two updates over the same group
        if rank == 0:
            results.put((rank, seed, bridge.send(weight_sync.bucketed(weights(seed), 2000))))
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
    assert got == [(0, 1, nbytes), (0, 2, nbytes), (1, 1, 5), (1, 2, 5), (2, 1, 5), (2, 2, 5)]


def test_buckets_keep_order_split_by_dtype_and_size():
    named = weights(0)
    assert [[n for n, _ in b] for b in weight_sync.bucketed(named)] == [
        ["embed.weight", "layers.0.proj", "lm_head.weight"], ["layers.0.scale"], ["step"]]
    assert [[n for n, _ in b] for b in weight_sync.bucketed(iter(named), 2000)] == [
        ["embed.weight", "layers.0.proj"], ["lm_head.weight"], ["layers.0.scale"], ["step"]]
