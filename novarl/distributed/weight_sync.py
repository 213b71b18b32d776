"""Weights from the training ranks to the generation engines, in buckets.

The training side yields full tensors (Hugging Face names) bucket by bucket
(`bucketed`): each bucket is gathered from the shards when it is due and
dropped once it is loaded, so a rank holds at most one bucket beyond its own
shards (`policy.generation.weight_sync_bucket_mb`, see `bucket_bytes`).

- Colocated, the engine lives in the rank's own process: each rank gathers the
  buckets and its engine loads them as they come (RankActor.sync_generator).
- Dedicated, the engines are actors of their own: the policy's rank 0 and the
  engines form a process group of their own (NCCL on GPU, gloo on CPU) apart
  from the training group, and rank 0 broadcasts each bucket as the training
  ranks gather it (`WeightBridge`). Nothing passes through the driver or Ray's
  object store.

Each bucket goes over a group as a header (JSON: its dtype, and the names and
shapes of its tensors), then its tensors end to end as one flat tensor of bytes
(torch's NCCL process group takes no uint16/32/64); an empty header ends the
update. A receiver checks the header before it allocates anything: a dtype
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

import abc
import datetime
import json
import mmap
import socket
import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import cast

import torch
import torch.distributed as dist

from novarl.distributed.local import collective_device, default_device, whole
from novarl.errors import NotAvailableYet, RunFailed

BUCKET_BYTES = 512 * 2**20
"""The default bound on one bucket (policy.generation.weight_sync_bucket_mb = 512)."""
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


class Channel(abc.ABC):
    """Buckets of named tensors broadcast from rank 0 of a group to its other ranks."""

    rank: int
    device: torch.device

    @abc.abstractmethod
    def _broadcast(self, tensor: torch.Tensor) -> None:
        """Rank 0's `tensor` into every rank's `tensor` (in place)."""

    def send(self, buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> int:
        """Broadcast each bucket (one dtype each, see `bucketed`) as it comes; bytes sent."""
        sent = 0
        for bucket in buckets:
            if not bucket:
                continue
            header: Header = [(_dtype_name(bucket), [(n, tuple(t.shape)) for n, t in bucket])]
            self._broadcast_bytes(json.dumps(header).encode())
            flat = flat_on(bucket, self.device)
            self._broadcast(flat.view(torch.uint8))
            sent += flat.numel() * flat.element_size()
        self._broadcast_bytes(b"[]")
        return sent

    def receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors rank 0 sends in this update, under their names (on this rank's device),
        one bucket at a time: consume it to the end (see `drain`), or the sender waits."""
        while True:
            header = decode_header(self._broadcast_bytes(None))
            if not header:
                return
            for dtype, entries in header:
                kind = getattr(torch, dtype)
                raw = torch.empty(sum(_numel(shape) for _, shape in entries) * kind.itemsize, dtype=torch.uint8,
                                  device=self.device)
                self._broadcast(raw)
                flat = raw.view(kind)
                offset = 0
                for name, shape in entries:
                    yield name, flat[offset:offset + _numel(shape)].view(shape)
                    offset += _numel(shape)

    def _broadcast_bytes(self, payload: bytes | None) -> bytes:
        """Rank 0's `payload` on every rank: its length, then the bytes (the others pass None)."""
        size = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64, device=self.device)
        self._broadcast(size)
        length = int(size.item())
        if payload is not None:
            buffer = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
        elif 0 < length <= MAX_HEADER_BYTES:
            buffer = torch.empty(length, dtype=torch.uint8, device=self.device)
        else:
            raise MalformedHeader(f"The weight bridge's rank 0 announced a header of {length} bytes "
                                  f"(at most {MAX_HEADER_BYTES} are accepted).")
        self._broadcast(buffer)
        return payload if payload is not None else buffer.cpu().numpy().tobytes()


class WeightBridge(Channel):
    """The weight-transfer group of dedicated generation: the policy's rank 0 sends, the
    engines (ranks 1..n) receive.

    Rank 0 serves the group's store at host:port, on `listener` if given (a socket from
    `listen_on(host)`), else on a socket it opens there itself. The group is NCCL on `device`'s
    GPU (default: this process's GPU where there is one; each rank its own GPU, as NCCL needs),
    else gloo (a CPU `device`)."""

    def __init__(self, host: str, port: int, rank: int, world_size: int,
                 listener: socket.socket | None = None, device: torch.device | None = None) -> None:
        self.rank = rank
        self.device = device or default_device()
        if rank == 0 and listener is None:
            listener = listen_on(host, port)
        store = tcp_store(host, port, world_size, listener if rank == 0 else None)
        self.engines = world_size - 1
        self.signals = dist.PrefixStore("novarl-ready/", store)
        """Where the engines say they are ready for a queued update (mark_ready / wait_ready)."""
        self.group: dist.ProcessGroupNCCL | dist.ProcessGroupGloo
        if self.device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = TIMEOUT
            self.group = dist.ProcessGroupNCCL(store, rank, world_size, options)
            # connected now, while every member joins, not at the first update: under asynchronous GRPO that is
            # a thread of rank 0's while its training collectives run, and a network fault would surface mid-run
            self.group.eager_connect_single_device(self.device)
        else:
            self.group = dist.ProcessGroupGloo(store, rank, world_size, TIMEOUT)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.group.broadcast([tensor], options).wait()  # type: ignore[union-attr]  # torch's stubs lack it

    def mark_ready(self, version: int) -> None:
        """An engine is about to receive queued update `version` (see wait_ready)."""
        self.signals.set(f"{version}/{self.rank}", "1")

    def wait_ready(self, version: int, stop: threading.Event) -> bool:
        """Rank 0, before it sends queued update `version`: until every engine has come to receive
        it (which may take rounds of generation: no collective waits meanwhile, so no collective
        timeout applies). False if `stop` was set first."""
        keys = [f"{version}/{rank}" for rank in range(1, self.engines + 1)]
        while not self.signals.check(keys):
            if stop.wait(0.02):
                return False
        for key in keys:
            self.signals.delete_key(key)
        return True


class GroupChannel(Channel):
    """Rank 0 of this process's default (training) group to its other ranks: for a training
    backend that gathers full weights on rank 0 alone (Megatron), when every rank's engine
    needs them."""

    def __init__(self) -> None:
        self.rank = dist.get_rank()
        self.device = collective_device()

    def _broadcast(self, tensor: torch.Tensor) -> None:
        dist.broadcast(tensor, src=0)


def bucketed(weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = BUCKET_BYTES
             ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive tensors of one dtype, up to bucket_bytes each (a larger tensor goes alone),
    yielded as soon as each bucket is full: a lazy `weights` is never held whole."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in weights:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and (bucket[0][1].dtype != tensor.dtype or size + nbytes > bucket_bytes):
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def flatten(buckets: Iterable[list[tuple[str, torch.Tensor]]], counter: list[int] | None = None
            ) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of `buckets` one by one; their bytes added to counter[0] if given."""
    for bucket in buckets:
        for name, tensor in bucket:
            if counter is not None:
                counter[0] += tensor.numel() * tensor.element_size()
            yield name, tensor


def drain(stream: Iterator) -> None:
    """Run a weight stream to its end (its collectives must all happen on every rank)."""
    for _ in stream:
        pass


def full_weights(state: Iterable[tuple[str, torch.Tensor]], keep: bool, dtype: torch.dtype | None = None
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """Full tensors from a (possibly sharded) state dict: DTensors are gathered one at a time
    (a collective: every rank of the training group iterates), plain tensors pass as they
    are. keep=False: gathered and dropped (a rank that only takes part in the gathers).
    Floating tensors are cast to dtype when it is given (the engines' precision)."""
    from torch.distributed.tensor import DTensor

    for name, tensor in state:
        if isinstance(tensor, DTensor):  # cast first: the shards, not the gathered whole (half the bytes for bf16)
            tensor = whole(cast(DTensor, in_dtype(tensor.detach(), dtype)))
        if keep:
            yield name, in_dtype(tensor.detach(), dtype)


def flat_on(bucket: list[tuple[str, torch.Tensor]], device: torch.device) -> torch.Tensor:
    """A bucket's tensors (one dtype) end to end in one tensor on `device`: allocated once, each tensor copied
    into its place (asynchronously from pinned host memory), never a device copy of each and then their
    concatenation (twice the bucket on the device)."""
    tensors = [tensor.detach().reshape(-1) for _, tensor in bucket]
    if all(tensor.device == device for tensor in tensors):
        return torch.cat(tensors)
    flat = torch.empty(sum(tensor.numel() for tensor in tensors), dtype=tensors[0].dtype, device=device)
    offset = 0
    for tensor in tensors:
        flat[offset:offset + tensor.numel()].copy_(tensor, non_blocking=True)
        offset += tensor.numel()
    return flat


class HostArena:
    """Host memory that holds queued weights (asynchronous GRPO's) while training changes the originals, kept
    from one update to the next: a buffer per bucket of exactly its bytes, page-locked once where there is a GPU
    (cudaHostRegister), the tensors views into it. (torch's pinned allocator rounds each allocation up to a power
    of two and keeps it cached: pinned tensor by tensor, a 7B model's bf16 weights held ~1.9x their bytes on
    rank 0's host for the rest of the run.) `release` unpins and drops the buffers."""

    def __init__(self, pin: bool | None = None, *,
                 holding: str = "Asynchronous GRPO holds the queued weights in page-locked host memory on the policy's "
                                "rank 0", remedy: str = "run synchronous GRPO") -> None:
        """holding, remedy: what a failure to page-lock says the memory was for, and what the user can do."""
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.holding, self.remedy = holding, remedy
        self.buffers: list[torch.Tensor] = []
        self.pinned: set[int] = set()
        """data_ptr of the buffers cudaHostRegister took."""
        # an arena dropped without release (its role's process reused) unpins its buffers before their memory goes;
        # not at the process's exit, where CUDA may be gone first and the memory goes with the process
        weakref.finalize(self, _unpin_all, self.buffers, self.pinned).atexit = False

    def hold(self, buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> list[list[tuple[str, torch.Tensor]]]:
        """Copies of `buckets`' tensors (as they come, each bucket gathered when its turn comes) in the arena,
        in buckets as they came."""
        held = []
        for index, bucket in enumerate(buckets):
            buffer = self._buffer(index, sum(tensor.numel() * tensor.element_size() for _, tensor in bucket))
            copies, offset = [], 0
            for name, tensor in bucket:
                nbytes = tensor.numel() * tensor.element_size()
                copy = buffer[offset:offset + nbytes].view(tensor.dtype).view(tensor.shape)
                copy.copy_(tensor.detach())
                copies.append((name, copy))
                offset += nbytes
            held.append(copies)
        for buffer in self.buffers[len(held):]:
            self._unpin(buffer)
        del self.buffers[len(held):]
        return held

    def _buffer(self, index: int, nbytes: int) -> torch.Tensor:
        if index < len(self.buffers) and self.buffers[index].numel() == nbytes:
            return self.buffers[index]
        # page-aligned (an anonymous mapping), as cudaHostRegister pins whole pages
        buffer = (torch.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE), dtype=torch.uint8) if nbytes
                  else torch.empty(0, dtype=torch.uint8))
        if self.pin and nbytes:
            # (a failure stays the CUDA runtime's last error, which a later kernel launch check would raise:
            # stopped here, naming it, as torch's own pinning does)
            status = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, 0))
            if status != 0:
                raise RunFailed(f"{self.holding}, and CUDA refused to page-lock {nbytes / 2**20:.0f} MiB more "
                                f"(cudaHostRegister error {status}): free host memory, or {self.remedy}.")
            self.pinned.add(buffer.data_ptr())
        if index < len(self.buffers):
            self._unpin(self.buffers[index])
            self.buffers[index] = buffer
        else:
            self.buffers.append(buffer)
        return buffer

    def _unpin(self, buffer: torch.Tensor) -> None:
        if buffer.data_ptr() in self.pinned:
            self.pinned.discard(buffer.data_ptr())
            torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())

    def release(self) -> None:
        _unpin_all(self.buffers, self.pinned)


def _unpin_all(buffers: list[torch.Tensor], pinned: set[int]) -> None:
    """Unregister the pinned ones among `buffers` and drop them all (in place: the arena's own list and set)."""
    for buffer in buffers:
        if buffer.data_ptr() in pinned:
            pinned.discard(buffer.data_ptr())
            torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())
    buffers.clear()


def in_dtype(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor


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


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count
