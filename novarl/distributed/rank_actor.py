"""The process behind one rank of a Ray worker group (distributed/ray_group.py): `RankActor` joins
the group's torch.distributed process group, hosts a role (and the roles that share its ranks),
runs the driver's calls on it, and serves the weight bridge to dedicated generation engines;
`pin_collectives_to_loopback` keeps gloo and NCCL on the loopback interface in a local run."""

from __future__ import annotations

import functools
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any


class RankActor:
    """The process behind one rank: joins the process group, then hosts a role (and, beside
    it, others that share its ranks: the frozen reference beside the policy)."""

    def __init__(self, rank: int, world_size: int, cpus: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.role: Any = None
        self.others: dict[str, Any] = {}
        self.bridge: Any = None
        self.listener: socket.socket | None = None
        self.sender: Any = None
        """Rank 0's thread sending queued weights over the bridge (queue_weights)."""
        self.arena: Any = None
        """Rank 0's host memory for the queued weights (weight_sync.HostArena), kept from one update to the next."""
        self.free_since: float | None = None
        """When this rank's engine finished its last work (generate_share, receive_weights)."""
        self.streams: dict[str | None, Any] = {}
        """Each engine's EngineStreams (continue_requests), by role."""
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": "0"})
        import ray

        own = own_visible_devices(ray.get_gpu_ids(), os.environ.get("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"))
        if own is not None:  # before CUDA starts in this process
            os.environ["CUDA_VISIBLE_DEVICES"] = own
        import torch

        from novarl.logging.quiet import filter_library_warnings

        filter_library_warnings()  # what a library warns about here reaches the driver's terminal

        self.host = ray.util.get_node_ip_address()
        if _is_loopback(self.host):
            pin_collectives_to_loopback()
        torch.set_num_threads(max(cpus, 1))
        self.environment = dict(os.environ)
        """This process's environment before any role: a released rank goes back to it."""

    def address(self) -> tuple[str, int]:
        """(host, port) of a store this rank will serve in the next join or join_weight_bridge
        it takes part in as rank 0: a socket listening on this node's address alone, open from
        now on so that nothing else takes the port meanwhile."""
        from novarl.distributed.weight_sync import listen_on

        if self.listener is not None:
            self.listener.close()
        self.listener = listen_on(self.host)
        return self.host, self.listener.getsockname()[1]

    def join(self, host: str, port: int) -> int:
        """Join the training group, whose store rank 0 serves at host:port (from its address())."""
        import datetime

        import torch
        import torch.distributed as dist

        from novarl.distributed.weight_sync import tcp_store

        timeout = datetime.timedelta(minutes=10)
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(0)  # Ray shows each actor only its own GPU (own_visible_devices under NOSET)
        store = tcp_store(host, port, self.world_size, self._take_listener() if self.rank == 0 else None, timeout)
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world_size, timeout=timeout)
        return self.rank

    def _take_listener(self) -> socket.socket:
        listener, self.listener = self.listener, None
        if listener is None:
            raise RuntimeError("rank 0 serves a store only on the socket its address() opened")
        return listener

    def pid(self) -> int:
        return os.getpid()

    def node(self) -> str:
        """The address of the node this rank runs on."""
        return self.host

    def setup(self, factory: Callable[..., Any], kwargs: dict[str, Any]) -> None:
        from novarl.distributed.memory import current_rss_bytes

        self.rss_before_role = current_rss_bytes()
        self.role = factory(**kwargs)

    def reset_memory_peak(self) -> None:
        """Measure the peak from now on (after loading, whose full-model transient would mask it)."""
        import torch

        from novarl.distributed.memory import memory_report, reset_peak

        self.memory_at_reset = memory_report()
        reset_peak()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    def memory(self) -> dict[str, float]:
        """This rank's memory in bytes (see distributed/memory.py): live tensors now, and at
        the last reset_memory_peak with the peak resident set since then (rss_peak_since)."""
        from novarl.distributed.memory import memory_report, peak_rss_bytes

        at_reset = getattr(self, "memory_at_reset", None) or {"rss": float(self.rss_before_role), "tensors": 0.0}
        return {**memory_report(), "tensors_at_reset": at_reset["tensors"],
                "rss_peak_since_reset": float(peak_rss_bytes()) - at_reset["rss"]}

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.role, method)(*args, **kwargs)

    def add_role(self, name: str, factory: Callable[..., Any], kwargs: dict[str, Any]) -> None:
        """Build another role in this process, on the same ranks and process group."""
        self.others[name] = factory(**kwargs)

    def call_role(self, name: str, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.others[name], method)(*args, **kwargs)

    def bridge_ranks(self) -> int:
        """The weight bridge's ranks this process's role takes: an engine's worker processes' where they receive
        the weights themselves (a dedicated vLLM engine of several devices), else this process's one."""
        return getattr(self.role, "bridge_ranks", 1)

    def join_weight_bridge(self, host: str, port: int, rank: int, world_size: int) -> None:
        """Join the weight-transfer group (policy rank 0 + the dedicated engines): as `rank`, or through the
        role's workers as ranks rank .. rank + bridge_ranks() - 1."""
        from novarl.distributed.weight_sync import WeightBridge

        if rank > 0 and self.bridge_ranks() > 1:
            self.role.join_bridge(host, port, rank, world_size)
            return
        self.bridge = WeightBridge(host, port, rank, world_size, self._take_listener() if rank == 0 else None)

    def generate_share(self, role: str | None, prompts: list, sampling) -> dict[str, Any]:
        """This process's engine (the role, or the added role `role`) on its share of a step: the
        completions, the seconds it took (busy_s) and those the engine sat idle before (idle_s)."""
        engine = self.others[role] if role else self.role
        start = time.perf_counter()
        idle = start - self.free_since if self.free_since is not None else 0.0
        completions = engine.generate(prompts, sampling)
        self.free_since = time.perf_counter()
        return {"completions": completions, "busy_s": self.free_since - start, "idle_s": idle}

    def streams_requests(self, role: str | None) -> bool:
        """Whether this process's engine takes requests while it generates (ContinuousEngine)."""
        from novarl.distributed.engine_streams import takes_requests

        return takes_requests(self.others[role] if role else self.role)

    def continue_requests(self, role: str | None, stream: str, requests: list, max_steps: int) -> list:
        """Episodes' turns on this process's engine, as they come (backends/generation/streams.py):
        add `stream`'s requests, step until one of its turns is finished (max_steps steps at most);
        its finished turns, (key, Completion) each."""
        from novarl.distributed.engine_streams import EngineStreams

        streams = self.streams.get(role)
        if streams is None:
            streams = self.streams[role] = EngineStreams(self.others[role] if role else self.role)
        finished = streams.run(stream, requests, max_steps)
        self.free_since = time.perf_counter()
        return finished

    def sync_generator(self, version: int, bucket_bytes: int, dtype) -> int:
        """Collective over the policy ranks: gather the full weights bucket by bucket from the
        shards and load each into this rank's own engine as it comes. Bytes loaded."""
        from novarl.distributed.weight_sync import drain, flatten

        loaded = [0]
        stream = flatten(self.role.weight_buckets(bucket_bytes, everywhere=True, dtype=dtype), loaded)
        self.others["generator"].update_weights(stream, version)
        drain(stream)  # an engine that skipped a tensor still takes part in every gather
        return loaded[0]

    def park_role(self, role: str | None, group: str, host_too: bool = False) -> int:
        """Park `group` of this process's role (or of the added role `role`) where it parks (Parkable); bytes
        freed on this rank's device."""
        from novarl.distributed.lifecycle import Parkable

        target = self.others[role] if role else self.role
        return target.park(group, host_too) if isinstance(target, Parkable) else 0

    def offload_role(self, role: str) -> None:
        from novarl.distributed.lifecycle import Offloadable

        if isinstance(self.others[role], Offloadable):
            self.others[role].offload()

    def send_weights(self, bucket_bytes: int, dtype) -> int:
        """Collective over the policy ranks: gather the full weights bucket by bucket; rank 0
        broadcasts each over the bridge as it comes. Bytes sent (0 on other ranks)."""
        from novarl.distributed.weight_sync import drain

        self.wait_weights_taken()
        buckets = self.role.weight_buckets(bucket_bytes, everywhere=False, dtype=dtype)
        if self.bridge is None:
            drain(buckets)
            return 0
        return self.bridge.send(buckets)

    def queue_weights(self, bucket_bytes: int, dtype, version: int) -> int:
        """Collective over the policy ranks: gather the full weights bucket by bucket; rank 0 keeps
        a host copy, which a thread of its own broadcasts over the bridge once every engine has
        come to receive it (their receive_weights(version, queued=True), behind the rounds they
        have), while this rank trains on. The driver waits for the engines to take the previous
        copy before it calls this (DedicatedEngines.queue_weights). Bytes queued (0 on other ranks)."""
        from novarl.distributed.weight_sync import HostArena, drain

        self.wait_weights_taken()
        buckets = self.role.weight_buckets(bucket_bytes, everywhere=False, dtype=dtype)
        if self.bridge is None:
            drain(buckets)
            return 0
        self.arena = self.arena or HostArena()
        held = self.arena.hold(buckets)
        self.sender = _Sender(self.bridge, held, version)
        return sum(t.numel() * t.element_size() for bucket in held for _, t in bucket)

    def wait_weights_taken(self) -> None:
        """Until the thread sending the weights queued last is done (raising what it raised)."""
        if self.sender is not None:
            sender, self.sender = self.sender, None
            sender.wait()

    def receive_weights(self, version: int, queued: bool = False) -> None:
        """Take weights `version` from the bridge (queued: sent by rank 0's thread once this engine
        says it is here)."""
        from novarl.distributed.weight_sync import drain

        if self.bridge is None:  # the role's workers are on the bridge
            self.role.receive_weights(version, queued)
        else:
            if queued:
                self.bridge.mark_ready(version)
            stream = self.bridge.receive()
            self.role.update_weights(stream, version)
            drain(stream)
        self.free_since = time.perf_counter()

    def shutdown(self) -> None:
        import torch.distributed as dist

        if self.sender is not None:  # weights queued for engines that will not take them now
            self.sender.stop()

        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()

    def release(self) -> bool:
        """After shutdown: drop the roles and what they hold, as if this process had just started.
        True when every role it hosted is `process_reusable`, so that another group may take it."""
        import gc

        roles = [role for role in (self.role, *self.others.values()) if role is not None]
        reusable = all(getattr(type(role), "process_reusable", False) for role in roles)
        for role in roles:  # a role's process-wide state (Megatron's parallel groups, ...) cleared
            leave = getattr(role, "leave_process", None)
            if leave is not None:
                leave()
        os.environ.clear()
        os.environ.update(self.environment)
        if self.listener is not None:
            self.listener.close()
        if self.arena is not None:
            self.arena.release()
        self.role, self.others, self.bridge, self.listener, self.sender, self.arena = None, {}, None, None, None, None
        self.free_since, self.streams = None, {}
        self.__dict__.pop("memory_at_reset", None)
        try:  # DTensor's random-number tracker belongs to the destroyed process group's meshes
            import torch.distributed.tensor._random as dtensor_random

            dtensor_random._rng_tracker = None
        except (ImportError, AttributeError):
            pass
        gc.collect()
        import torch

        if torch.cuda.is_available():  # the dropped roles' cached blocks back to the device
            torch.cuda.empty_cache()
        return reusable


class _Sender:
    """A thread that broadcasts queued weights over a weight bridge once the engines are ready for
    them (on a CUDA stream of its own, so that the training's kernels do not queue behind the
    transfer); wait() joins it and raises its error, stop() ends a wait for the engines."""

    def __init__(self, bridge, buckets: list, version: int) -> None:
        self.error: BaseException | None = None
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(bridge, buckets, version), name="novarl-weights",
                                       daemon=True)
        self.thread.start()

    def _run(self, bridge, buckets: list, version: int) -> None:
        import contextlib

        import torch

        try:
            if not bridge.wait_ready(version, self.stopped):
                return
            on_gpu = bridge.device.type == "cuda"
            with torch.cuda.stream(_side_stream(bridge.device)) if on_gpu else contextlib.nullcontext():
                bridge.send(buckets)
        except BaseException as err:  # raised in the caller's thread by wait()
            self.error = err

    def wait(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=5)


def own_visible_devices(gpu_ids: list, noset: str | None) -> str | None:
    """CUDA_VISIBLE_DEVICES for a rank that Ray left seeing every GPU (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES
    true, `noset`): the GPUs Ray assigned it (ray.get_gpu_ids(), as the node's list names them), so that device 0
    is its own for every library in the process (torch's current device, DeepSpeed's LOCAL_RANK, vLLM's engine).
    None where Ray set the list to them already (its default) or assigned none."""
    if (noset or "").strip().lower() not in ("1", "true") or not gpu_ids:
        return None
    return ",".join(str(device).strip() for device in gpu_ids)


@functools.cache
def _side_stream(device):
    """The CUDA stream queued weights go out on, one a process: the caching allocator reuses a block only on the
    stream that freed it, so a new stream each update would strand each one's bucket-sized blocks."""
    import torch

    return torch.cuda.Stream(device)


def pin_collectives_to_loopback() -> None:
    """Make gloo and NCCL listen on the loopback interface (unless GLOO_SOCKET_IFNAME /
    NCCL_SOCKET_IFNAME say otherwise): by default gloo listens on the address the host name
    resolves to and NCCL on the first non-loopback interface, though every rank of a local run
    is on this machine. Before the process's first process group."""
    interface = _loopback_interface()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
    os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)


def _loopback_interface() -> str:
    import psutil  # Ray ships it

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family in (socket.AF_INET, socket.AF_INET6) and _is_loopback(a.address) for a in addresses):
            return name
    return "lo"


def _is_loopback(host: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:  # a host name
        return host == "localhost"
