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
from collections.abc import Callable, Mapping
from typing import Any

from novarl.distributed.kept_ranks import keep, kill, reusing_ranks, take_kept
from novarl.distributed.rank_actor import RankActor
from novarl.errors import OUT_OF_MEMORY_ADVICE, RunFailed, UserError, is_out_of_memory


RELEASE_WAIT_S = 10.0
"""How long a new group waits for resources that a group shut down just before still holds."""

class WorkerDied(RunFailed):
    """A rank's actor died (killed, out of memory, crashed) during a call."""

    out_of_memory = False
    """Its rank ran out of GPU memory (errors.is_out_of_memory reads it: the rank's error is not kept)."""


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


TORCH_HINTS = ("Set TORCHDYNAMO_VERBOSE", "For more details about this graph break", "Hint:",
               "Developer debug context")
"""Lines torch.compile's errors end with that say nothing of what failed."""


def what_failed(error: BaseException, limit: int = 400) -> str:
    """The line of an error's message that says what failed: its last line, but for torch.compile's errors
    (whose last line is a hint to set TORCHDYNAMO_VERBOSE) the explanation or the error the compiler raised;
    a long one cut in its middle."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    explained = [line for line in lines if line.startswith("Explanation:")]
    told = [line for line in lines if not line.startswith(TORCH_HINTS)]
    line = (explained or told[-1:] or lines[-1:] or [""])[0]
    return line if len(line) <= limit else f"{line[:limit // 3]} ... {line[-(2 * limit) // 3:]}"


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
        advice = f" To fit: {OUT_OF_MEMORY_ADVICE}." if is_out_of_memory(cause) else ""
        failed = WorkerDied(f"{self.name} rank {first_rank + refs.index(first)} failed: {type(cause).__name__}: "
                            f"{what_failed(cause)}{advice}")
        failed.out_of_memory = bool(advice)
        return failed

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
