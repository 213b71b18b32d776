"""Ray worker groups: one actor per rank, joined in a torch.distributed process group.

The driver builds a role on every rank with `RayWorkerGroup(factory, kwargs, ...)`
and calls its methods with `group.call(name, *args)`, which runs the method on
all ranks at once (they are collective) and returns rank 0's result. Ranks are
placed with a Ray placement group: one bundle per rank, a GPU each on GPU hosts,
CPUs on a host without GPUs. Ray is imported here only, never by `import novarl`.

A rank that dies stops the call with `WorkerDied` naming it; the group then
kills its other actors and frees the placement group so nothing hangs.

What listens on the network. Without RAY_ADDRESS novarl starts its own Ray instance
with the node address 127.0.0.1, from which Ray binds its GCS, raylet (node manager and
object manager), the workers' gRPC servers, its agents and the autoscaler's metrics port
to loopback; it also requires a token that lives only in the environment of the driver
and the processes Ray starts (see `start_local_ray`). The ranks' rendezvous store and the
weight bridge's store listen on the node address alone (see weight_sync.tcp_store), and
on a loopback node gloo and NCCL listen on the loopback interface. Nothing else of a run
listens (tests/test_network_safety.py lists them during a run).

On a cluster (RAY_ADDRESS) Ray's binding and authentication are the cluster's: novarl
changes neither, and its stores listen on each node's Ray address. Start that cluster on a
private network (`ray start --node-ip-address=<private address>`), with
`RAY_AUTH_MODE=token` and the same `RAY_AUTH_TOKEN` on every node and on the driver, or
anyone who reaches a node's ports can run code on it.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from novarl.distributed.kept_ranks import keep, kill, reusing_ranks, take_kept
from novarl.errors import RunFailed, UserError


RELEASE_WAIT_S = 10.0
"""How long a new group waits for resources that a group shut down just before still holds."""

class WorkerDied(RunFailed):
    """A rank's actor died (killed, out of memory, crashed) during a call."""


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
        self.free_since: float | None = None
        """When this rank's engine finished its last work (generate_share, receive_weights)."""
        self.streams: dict[str | None, Any] = {}
        """Each engine's EngineStreams (continue_requests), by role."""
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": "0"})
        import ray
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
            torch.cuda.set_device(0)  # Ray shows each actor only its own GPU
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

    def join_weight_bridge(self, host: str, port: int, rank: int, world_size: int) -> None:
        """Join the weight-transfer group (policy rank 0 + the dedicated engines)."""
        from novarl.distributed.weight_sync import WeightBridge

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
        from novarl.distributed.weight_sync import drain, host_copy

        self.wait_weights_taken()
        buckets = self.role.weight_buckets(bucket_bytes, everywhere=False, dtype=dtype)
        if self.bridge is None:
            drain(buckets)
            return 0
        held = [host_copy(bucket) for bucket in buckets]
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
        self.role, self.others, self.bridge, self.listener, self.sender = None, {}, None, None, None
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
            stream = torch.cuda.stream(torch.cuda.Stream()) if bridge.device.type == "cuda" else contextlib.nullcontext()
            with stream:
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


def require_capacity(needs: dict[str, float], what: str) -> None:
    """Refuse, before any worker starts, a run whose roles together need more than the Ray
    cluster has in all (`needs`: resource -> amount; `what` says how it adds up)."""
    import ray

    ensure_ray()
    have = ray.cluster_resources()
    for resource, amount in needs.items():
        if have.get(resource, 0) < amount:
            raise UserError(f"This run needs {amount:g} {resource} ({what}), but the Ray cluster has "
                            f"{have.get(resource, 0):g} in all.")


def ensure_ray(num_cpus: int | None = None) -> None:
    """Connect to the Ray cluster in RAY_ADDRESS as it is, or start novarl's own local instance."""
    import ray

    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True)
    else:
        start_local_ray(num_cpus)


FORWARDED_PREFIXES = ("NOVARL_", "NRL_", "VLLM_")
FORWARDED_NAMES = ("HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
"""The driver's settings its ranks read (novarl's, the seeds' NRL_*, vLLM's, where models are and
whether to go online). No credentials: the nodes of a cluster hold their own."""


def forwarded_env() -> dict[str, Any]:
    """Options for an actor this driver starts (`.options(**forwarded_env())`): on a Ray cluster that
    novarl joined (RAY_ADDRESS), whose processes were started elsewhere and do not inherit this one's
    environment, the FORWARDED settings set here as the actor's runtime environment. {} for novarl's
    own instance, started from this process (its actors inherit them; a runtime environment would
    cost each actor ~0.5 s more to start)."""
    if not os.environ.get("RAY_ADDRESS"):
        return {}
    env = {name: value for name, value in os.environ.items()
           if name.startswith(FORWARDED_PREFIXES) or name in FORWARDED_NAMES}
    return {"runtime_env": {"env_vars": env}} if env else {}


def start_local_ray(num_cpus: int | None = None) -> None:
    """A Ray instance for this run alone: every server it starts listens on 127.0.0.1, and
    every request must carry a token.

    The token is RAY_AUTH_TOKEN (a random one unless set) in the environment of this process,
    which the processes Ray starts inherit; nothing is written to ~/.ray, so RAY_AUTH_MODE=disabled,
    set to keep Ray from writing a token file there, is overridden. A Ray without token
    authentication gets loopback alone. No dashboard: novarl does not use it.
    """
    import secrets

    import ray
    import ray._private.ray_constants as ray_constants

    try:
        from ray._private.authentication.authentication_token_setup import _enable_token_auth
    except ImportError:
        _enable_token_auth = None
    if _enable_token_auth is not None:
        os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
        _enable_token_auth()  # RAY_AUTH_MODE=token, and refreshes the config an earlier instance cached
    # On Linux ray.init swaps a loopback node address for the host's external one
    # (services.resolve_ip_for_localhost) unless it takes multi-node clusters to be off.
    cluster_default, ray_constants.ENABLE_RAY_CLUSTER = ray_constants.ENABLE_RAY_CLUSTER, False
    try:
        ray.init(num_cpus=num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=True)
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = cluster_default


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


class RayWorkerGroup:
    def __init__(self, factory: Callable[..., Any], kwargs: dict[str, Any], *, world_size: int,
                 gpus_per_rank: int = 0, cpus_per_rank: int = 1, name: str = "policy",
                 process_group: bool = True) -> None:
        """`world_size` actors, each building `factory(**kwargs)`; joined in a torch.distributed
        process group unless process_group=False (engines that share no collective)."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ensure_ray()
        self.name, self.world_size = name, world_size
        flavour = getattr(factory, "process_flavour", None)
        self.shape = (world_size, cpus_per_rank, gpus_per_rank, process_group, flavour(kwargs) if flavour else "")
        bundle = {"CPU": cpus_per_rank, **({"GPU": gpus_per_rank} if gpus_per_rank else {})}
        kept = take_kept(self.shape)
        if kept is not None:
            self.placement, self.actors = kept
        else:
            self._check_resources(bundle, world_size)
            self.placement = placement_group([dict(bundle) for _ in range(world_size)], strategy="PACK")
            self.actors = []
            try:
                ray.get(self.placement.ready(), timeout=300)
            except ray.exceptions.GetTimeoutError:
                remove_placement_group(self.placement)
                raise UserError(f"The {self.name} worker group's {world_size} x {bundle} could not be placed "
                                f"within 5 minutes; the Ray cluster has {ray.available_resources()} free.") from None
            remote = ray.remote(RankActor)
            self.actors = [
                remote.options(num_cpus=cpus_per_rank, num_gpus=gpus_per_rank,
                               scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement, i),
                               **forwarded_env()).remote(*((i, world_size) if process_group else (0, 1)), cpus_per_rank)
                for i in range(world_size)]
        if process_group:
            host, port = self._get([self.actors[0].address.remote()])[0]
            self._get([a.join.remote(host, port) for a in self.actors])
        self._get([a.setup.remote(factory, kwargs) for a in self.actors])

    def _check_resources(self, bundle: Mapping[str, float], world_size: int) -> None:
        import time

        import ray

        def short() -> list[str]:
            have = ray.available_resources()  # what the roles started before this one left free
            return [r for r, amount in bundle.items() if have.get(r, 0) < amount * world_size]

        deadline = time.monotonic() + RELEASE_WAIT_S  # Ray frees a shut-down group's bundles asynchronously
        while short() and time.monotonic() < deadline:
            time.sleep(0.2)
        have = ray.available_resources()
        for resource, amount in bundle.items():
            if have.get(resource, 0) < amount * world_size:
                raise UserError(
                    f"The {self.name} worker group needs {world_size} ranks x {amount:g} {resource} = "
                    f"{amount * world_size:g} {resource}, but the Ray cluster has {have.get(resource, 0):g} free "
                    "(cluster.gpus_per_node x cluster.num_nodes sets the run's devices; dedicated generation "
                    "takes colocated.resources of them).")

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run `method` on every rank; rank 0's result."""
        return self.call_all(method, *args, **kwargs)[0]

    def call_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        import ray

        args = tuple(ray.put(a) for a in args)  # one copy in the object store, not one per rank
        return self._get([a.call.remote(method, *args, **kwargs) for a in self.actors])

    def add_role(self, name: str, factory: Callable[..., Any], kwargs: dict[str, Any]) -> None:
        """Build `factory(**kwargs)` on every rank beside the group's role (same processes,
        devices and process group); reach it with call_role."""
        self._get([a.add_role.remote(name, factory, kwargs) for a in self.actors])

    def call_role(self, name: str, method: str, *args: Any) -> Any:
        """Run `method` of the added role `name` on every rank; rank 0's result."""
        import ray

        args = tuple(ray.put(a) for a in args)
        return self._get([a.call_role.remote(name, method, *args) for a in self.actors])[0]

    def call_all_actors(self, method: str, *args: Any) -> list[Any]:
        """Run a RankActor method (memory, reset_memory_peak) on every rank; rank order."""
        return self._get([getattr(a, method).remote(*args) for a in self.actors])

    def submit_each(self, method: str, per_rank: list[tuple]) -> list:
        """Start RankActor `method` on rank i with the arguments per_rank[i] (one tuple per
        rank); the refs, to pass to `collect` (nothing waits here)."""
        return [getattr(actor, method).remote(*args) for actor, args in zip(self.actors, per_rank, strict=True)]

    def collect(self, refs: list, first_rank: int = 0) -> list[Any]:
        """Results of refs started on this group, in order (on ranks first_rank, first_rank + 1, ...);
        a rank that died stops it (WorkerDied)."""
        return wait_groups([(self, refs)], first_rank)[0]

    def _get(self, refs: list) -> list[Any]:
        return wait_groups([(self, refs)])[0]

    def _failure(self, refs: list, first: Any, err: Exception, first_rank: int = 0) -> WorkerDied:
        """Name the rank that died, not a peer whose collective broke because of it: a rank
        that errored first is blamed only if no other rank turns out dead within a few seconds."""
        import ray
        from ray.exceptions import RayActorError

        others = [r for r in refs if r is not first]
        done, _ = ray.wait(others, num_returns=len(others), timeout=5) if others else ([], [])
        dead = [refs.index(r) for r in done if _raises(r, RayActorError)]
        self.kill()
        if isinstance(err, RayActorError) or dead:
            rank = refs.index(first) if isinstance(err, RayActorError) else dead[0]
            return WorkerDied(f"{self.name} rank {first_rank + rank} died; the worker group was shut down.")
        cause = getattr(err, "cause", None) or err
        last_line = (str(cause).strip().splitlines() or [""])[-1]
        return WorkerDied(f"{self.name} rank {first_rank + refs.index(first)} failed: {type(cause).__name__}: "
                          f"{last_line}")

    def shutdown(self) -> None:
        """Stop every rank: their processes end, or with NOVARL_REUSE_RANKS are kept for the next group
        of this shape where every rank's roles allow it."""
        import ray

        try:
            ray.get([a.shutdown.remote() for a in self.actors], timeout=60)
            if reusing_ranks() and self.actors and all(ray.get([a.release.remote() for a in self.actors],
                                                               timeout=60)):
                keep(self.shape, self.placement, self.actors)
                self.actors = []
                return
        except Exception:  # a rank already gone: the rest are killed below
            pass
        self.kill()

    def kill(self) -> None:
        kill(self.placement, self.actors)
        self.actors = []


def wait_groups(calls: list[tuple[RayWorkerGroup, list]], first_rank: int = 0) -> list[list[Any]]:
    """Results of calls made on one or more groups at once (the two ends of a weight
    transfer, say), per group in rank order. Waits on whichever finishes first, so a rank
    that dies while the others block in a collective is seen at once; a failure shuts
    down every group taking part, since their peers would wait on it forever. first_rank: the
    rank of each group's first ref (the one a failure names is counted from it)."""
    import ray
    from ray.exceptions import RayTaskError

    owner = {ref: (group, refs) for group, refs in calls for ref in refs}
    pending = list(owner)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        try:
            ray.get(ready[0])
        except Exception as err:
            group, refs = owner[ready[0]]
            for other, _ in calls:
                if other is not group:
                    other.kill()
            if isinstance(err, RayTaskError) and isinstance(err.cause, UserError):
                group.kill()
                raise err.cause from None
            # otherwise a RayTaskError, or RayActorError: the process behind the rank is gone
            raise group._failure(refs, ready[0], err, first_rank) from None
    return [ray.get(refs) for _, refs in calls]


def _raises(ref: Any, kind: type[Exception]) -> bool:
    import ray

    try:
        ray.get(ref, timeout=0)
    except kind:
        return True
    except Exception:  # another failure, or not finished
        return False
    return False
