"""Weights from the trainer to a dedicated generator over a process group.

When generation runs on its own Ray actors, the policy's rank 0 and the
generator ranks form a process group of their own (NCCL on GPU, gloo on CPU),
apart from the training group, so the weights go process to process without a
copy through the driver or Ray's object store. Each update rank 0 broadcasts a
header (names, shapes, dtypes, bucket layout), then the tensors packed into
flat buckets of one dtype each (at most `BUCKET_BYTES`, so a large model never
needs a second full copy in one buffer); receivers unpack views of the buckets.

Built on `torch.distributed.TCPStore` and the process-group classes directly,
like vLLM's own stateless groups, because the default process group of each
process already belongs to its own role.
"""

from __future__ import annotations

import datetime
import pickle
from collections.abc import Iterable

import torch
import torch.distributed as dist

BUCKET_BYTES = 512 * 2**20
TIMEOUT = datetime.timedelta(minutes=10)

Header = list[tuple[str, list[tuple[str, tuple[int, ...]]]]]
"""Buckets in sending order: (dtype name, [(tensor name, shape), ...])."""


class WeightBridge:
    """One end of the weight-transfer group; rank 0 sends, the other ranks receive."""

    def __init__(self, host: str, port: int, rank: int, world_size: int) -> None:
        self.rank = rank
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
        store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=TIMEOUT)
        if self.device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = TIMEOUT
            self.group = dist.ProcessGroupNCCL(store, rank, world_size, options)
        else:
            self.group = dist.ProcessGroupGloo(store, rank, world_size, TIMEOUT)

    def send(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Broadcast the named tensors to the receivers; the number of bytes sent."""
        buckets = _buckets(list(weights))
        header: Header = [(str(b[0][1].dtype).removeprefix("torch."), [(n, tuple(t.shape)) for n, t in b])
                          for b in buckets]
        self._broadcast_object(header)
        sent = 0
        for bucket in buckets:
            flat = torch.cat([t.detach().reshape(-1) for _, t in bucket]).to(self.device)
            self._broadcast(flat)
            sent += flat.numel() * flat.element_size()
        return sent

    def receive(self) -> list[tuple[str, torch.Tensor]]:
        """The tensors rank 0 sent in this update, under their names (on this rank's device)."""
        header: Header = self._broadcast_object(None)
        received = []
        for dtype, entries in header:
            flat = torch.empty(sum(_numel(shape) for _, shape in entries), dtype=getattr(torch, dtype),
                               device=self.device)
            self._broadcast(flat)
            offset = 0
            for name, shape in entries:
                received.append((name, flat[offset:offset + _numel(shape)].view(shape)))
                offset += _numel(shape)
        return received

    def _broadcast(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.group.broadcast([tensor], options).wait()

    def _broadcast_object(self, obj):
        if self.rank == 0:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size = torch.tensor([payload.numel()], dtype=torch.int64, device=self.device)
        else:
            size = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._broadcast(size)
        if self.rank != 0:
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
        payload = payload.to(self.device)
        self._broadcast(payload)
        return obj if self.rank == 0 else pickle.loads(payload.cpu().numpy().tobytes())


def _buckets(weights: list[tuple[str, torch.Tensor]]) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive tensors of one dtype, up to BUCKET_BYTES each (a larger tensor goes alone)."""
    buckets: list[list[tuple[str, torch.Tensor]]] = []
    size = 0
    for name, tensor in weights:
        nbytes = tensor.numel() * tensor.element_size()
        if not buckets or buckets[-1][0][1].dtype != tensor.dtype or size + nbytes > BUCKET_BYTES:
            buckets.append([])
            size = 0
        buckets[-1].append((name, tensor))
        size += nbytes
    return buckets


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count
