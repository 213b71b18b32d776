"""Weights from the trainer to a dedicated generator over a process group.

When generation runs on its own Ray actors, the policy's rank 0 and the
generator ranks form a process group of their own (NCCL on GPU, gloo on CPU),
apart from the training group, so the weights go process to process without a
copy through the driver or Ray's object store. Each update rank 0 broadcasts a
header (names, shapes, dtypes, bucket layout) as JSON, then the tensors packed
into flat buckets of one dtype each (at most `BUCKET_BYTES`, so a large model
never needs a second full copy in one buffer); receivers unpack views of the
buckets. A receiver checks the header before it allocates anything: a dtype
outside `DTYPES`, a shape that is not a list of non-negative ints, or bytes that
are not such JSON raise `MalformedHeader` -- what arrives is data, never code.

Built on `torch.distributed.TCPStore` and the process-group classes directly,
like vLLM's own stateless groups, because the default process group of each
process already belongs to its own role. The stores here (this group's and the
training group's, see ray_group) listen on one address, the one the peers
reach them at -- 127.0.0.1 in a local run -- not on every interface as a
TCPStore started by host and port would.
"""

from __future__ import annotations

import datetime
import json
import socket
from collections.abc import Iterable

import torch
import torch.distributed as dist

from novarl.errors import NotAvailableYet, RunFailed

BUCKET_BYTES = 512 * 2**20
TIMEOUT = datetime.timedelta(minutes=10)
MAX_HEADER_BYTES = 256 * 2**20
"""A header longer than this is refused before a buffer for it is made (a real one is about
100 bytes per tensor)."""
DTYPES = frozenset({
    "float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
    "float8_e5m2fnuz", "complex64", "complex128", "int64", "int32", "int16", "int8", "uint64", "uint32",
    "uint16", "uint8", "bool"})
"""The dtype names (torch attributes) a header may carry."""

Header = list[tuple[str, list[tuple[str, tuple[int, ...]]]]]
"""Buckets in sending order: (dtype name, [(tensor name, shape), ...])."""


class MalformedHeader(RunFailed):
    """What arrived over the weight bridge is not a header a WeightBridge sends."""


def listen_on(host: str, port: int = 0) -> socket.socket:
    """A TCP socket listening on `host` alone (port 0: any free port), to serve a store on."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=socket.SOMAXCONN)


def tcp_store(host: str, port: int, world_size: int, listener: socket.socket | None,
              timeout: datetime.timedelta = TIMEOUT) -> dist.TCPStore:
    """The store a group meets through: served on `listener` by the rank that holds it (rank 0,
    which then owns the socket), reached at host:port by every rank."""
    if listener is None:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    return dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout,
                         master_listen_fd=listener.detach())


class WeightBridge:
    """One end of the weight-transfer group; rank 0 sends, the other ranks receive.

    Rank 0 serves the group's store at host:port, on `listener` if given (a socket from
    `listen_on(host)`), else on a socket it opens there itself."""

    def __init__(self, host: str, port: int, rank: int, world_size: int,
                 listener: socket.socket | None = None) -> None:
        self.rank = rank
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
        if rank == 0 and listener is None:
            listener = listen_on(host, port)
        store = tcp_store(host, port, world_size, listener if rank == 0 else None)
        if self.device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = TIMEOUT
            self.group = dist.ProcessGroupNCCL(store, rank, world_size, options)
        else:
            self.group = dist.ProcessGroupGloo(store, rank, world_size, TIMEOUT)

    def send(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Broadcast the named tensors to the receivers; the number of bytes sent."""
        buckets = _buckets(list(weights))
        header: Header = [(_dtype_name(b), [(n, tuple(t.shape)) for n, t in b]) for b in buckets]
        self._broadcast_bytes(json.dumps(header).encode())
        sent = 0
        for bucket in buckets:
            flat = torch.cat([t.detach().reshape(-1) for _, t in bucket]).to(self.device)
            self._broadcast(flat)
            sent += flat.numel() * flat.element_size()
        return sent

    def receive(self) -> list[tuple[str, torch.Tensor]]:
        """The tensors rank 0 sent in this update, under their names (on this rank's device)."""
        header = decode_header(self._broadcast_bytes(None))
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

    def _broadcast_bytes(self, payload: bytes | None) -> bytes:
        """Rank 0's `payload` on every rank: its length, then the bytes."""
        size = torch.tensor([len(payload) if self.rank == 0 else 0], dtype=torch.int64, device=self.device)
        self._broadcast(size)
        length = int(size.item())
        if self.rank == 0:
            buffer = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
        elif 0 < length <= MAX_HEADER_BYTES:
            buffer = torch.empty(length, dtype=torch.uint8, device=self.device)
        else:
            raise MalformedHeader(f"The weight bridge's rank 0 announced a header of {length} bytes "
                                  f"(at most {MAX_HEADER_BYTES} are accepted).")
        self._broadcast(buffer)
        return payload if self.rank == 0 else buffer.cpu().numpy().tobytes()


def decode_header(data: bytes) -> Header:
    """The header in `data` (JSON), checked: dtype names from DTYPES, tensor names strings,
    shapes lists of non-negative ints. MalformedHeader if anything else arrived."""
    try:
        buckets = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as err:
        raise MalformedHeader(f"The weight bridge received a header that is not JSON ({err}).") from None
    if not isinstance(buckets, list):
        raise MalformedHeader(f"The weight bridge's header is a {type(buckets).__name__}, not a list of buckets.")
    return [_bucket(bucket) for bucket in buckets]


def _bucket(bucket: object) -> tuple[str, list[tuple[str, tuple[int, ...]]]]:
    if not (isinstance(bucket, list) and len(bucket) == 2 and isinstance(bucket[1], list)):
        raise MalformedHeader(f"A bucket of the weight bridge's header is {bucket!r:.200}, "
                              "not [dtype, [[name, shape], ...]].")
    dtype, entries = bucket
    if not (isinstance(dtype, str) and dtype in DTYPES):
        raise MalformedHeader(f"The weight bridge's header names dtype {dtype!r:.100}, not one of {sorted(DTYPES)}.")
    checked = []
    for entry in entries:
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)
                and isinstance(entry[1], list) and all(type(d) is int and d >= 0 for d in entry[1])):
            raise MalformedHeader(f"A tensor in the weight bridge's header is {entry!r:.200}, "
                                  "not [name, [non-negative ints]].")
        checked.append((entry[0], tuple(entry[1])))
    return dtype, checked


def _dtype_name(bucket: list[tuple[str, torch.Tensor]]) -> str:
    name, tensor = bucket[0]
    dtype = str(tensor.dtype).removeprefix("torch.")
    if dtype not in DTYPES:
        raise NotAvailableYet(f"The weight bridge does not carry {tensor.dtype} tensors ('{name}'); "
                              f"it carries {sorted(DTYPES)}.")
    return dtype


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
