"""Generation as a worker group: the engines of a run behind one GenerationBackend.

- `LocalGeneration`: one engine in the driver's process beside a one-rank policy
  (a laptop run). Weights go by reference, bucket by bucket.
- `ColocatedEngines`: engines in the policy ranks' processes (Ray), so every
  training device generates: one per rank, or one per tp consecutive ranks, each
  rank holding one tensor-parallel shard of it (vLLM's external launcher; the
  ranks of an engine are given the same share and generate it in lockstep). Each
  rank gathers the full weights bucket by bucket from the training shards and
  loads them into its own engine (its shard of them): nothing goes through rank 0.
- `DedicatedEngines`: engine actors on devices of their own
  (`colocated.resources`). The policy's rank 0 broadcasts each bucket, as the
  training ranks gather it, to every engine over a process group of their own
  (weight_sync.WeightBridge). Asynchronous GRPO queues the weights instead
  (`queue_weights`): rank 0 keeps a host copy and sends it from a thread of its
  own when the engines come to it, after the rounds submitted before, so that
  neither side waits for the other.

The driver sends prompts and receives completions; it never holds a weight.
A step's prompts are shared among the engines with each GRPO group whole on one
engine (so vLLM's prefix cache and its n-samples request serve it) and the shares
balanced by prompt count; each engine is told where its share starts in the step,
so that seeded sampling gives the same samples whatever the number of engines.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Any

import torch

from novarl.backends.protocols import (ContinuousEngine, Engine, GenerationBackend, Offloadable, QueuedWeights,
                                       Rollout, Stoppable, StreamsRequests, WeightSender)
from novarl.distributed.weight_sync import BUCKET_BYTES, flatten
from novarl.errors import RunFailed, UserError
from novarl.backends.generation.layout import GenerationLayout
from novarl.types import Completion, Prompt, SamplingConfig


def share_groups(prompts: Sequence[Prompt], engines: int) -> list[tuple[int, int]]:
    """[start, stop) of each engine's share: consecutive runs of one prompt (a GRPO group) are
    never split, and each share ends at the group boundary nearest an even split of the
    prompts (an engine may get none when there are fewer groups than engines)."""
    total = len(prompts)
    cuts = [i for i in range(1, total) if prompts[i] is not prompts[i - 1]] + [total]
    bounds, taken = [], 0
    for engine in range(engines):
        target = total * (engine + 1) / engines
        stop = total if engine == engines - 1 else min((c for c in cuts if c >= taken), key=lambda c: abs(c - target))
        bounds.append((taken, stop))
        taken = stop
    return bounds


class Ready(Rollout):
    """A Rollout already complete (an engine in this process generates at submit)."""

    def __init__(self, completions: list[Completion], seconds: float = 0.0) -> None:
        self.completions, self.seconds = completions, seconds

    def times(self) -> dict[str, float]:
        return {"time_generation": self.seconds}

    def done(self) -> bool:
        return True

    def result(self) -> list[Completion]:
        return self.completions


class RayRollout(Rollout):
    """Completions of engines on Ray actors: shares in flight, joined in prompt order (each share
    comes with its engine's busy and idle seconds, see RankActor.generate_share)."""

    def __init__(self, group, refs: list, ranks_per_engine: int = 1) -> None:
        """refs: one per rank; an engine spanning several ranks answers from each of them (the same
        completions), and its first rank's answer is kept."""
        self.group, self.refs, self.ranks_per_engine = group, refs, ranks_per_engine
        self.completions: list[Completion] | None = None
        self.shares: list[dict[str, Any]] = []

    def done(self) -> bool:
        import ray

        ready, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        return len(ready) == len(self.refs)

    def result(self) -> list[Completion]:
        if self.completions is None:
            answers = self.group.collect(self.refs)
            self.shares = answers[::self.ranks_per_engine]
            check_lockstep(answers, self.ranks_per_engine)
            self.completions = [c for share in self.shares for c in share["completions"]]
        return self.completions

    def times(self) -> dict[str, float]:
        """time_generation: the slowest engine's seconds on its share; time_generator_idle: the
        longest an engine sat idle before it started (waiting for prompts or weights)."""
        self.result()
        return {"time_generation": max(s["busy_s"] for s in self.shares),
                "time_generator_idle": max(s["idle_s"] for s in self.shares)}


def check_lockstep(answers: list[dict[str, Any]], ranks_per_engine: int) -> None:
    """The ranks of an engine spanning several (one shard each, each with its own scheduler) must
    have sampled the same tokens; if they ever diverge, training on one rank's samples would hide
    it until a collective hangs, so it stops the run here."""
    for first in range(0, len(answers), ranks_per_engine):
        tokens = [[c.token_ids for c in a["completions"]] for a in answers[first:first + ranks_per_engine]]
        if any(t != tokens[0] for t in tokens[1:]):
            raise RunFailed(f"generation engine {first // ranks_per_engine} (policy ranks {first}-"
                            f"{first + ranks_per_engine - 1}, one tensor-parallel shard each) sampled different "
                            "tokens on its ranks: its schedulers left lockstep. Use "
                            "policy.generation.vllm_cfg.tensor_parallel_size=1, or dedicated generation.")


def rank_work(per_engine: list[tuple], ranks_per_engine: int) -> list[tuple]:
    """Each rank's work: engine e's to ranks e*k .. e*k+k-1, the ranks vLLM makes its tensor-parallel
    group of (consecutive ranks, k = ranks_per_engine)."""
    return [work for work in per_engine for _ in range(ranks_per_engine)]


def check_engine_nodes(nodes: list[str], ranks_per_engine: int) -> None:
    """Refuse engines whose ranks Ray placed on different nodes (their shards would all-reduce
    across the network every layer)."""
    for first in range(0, len(nodes), ranks_per_engine):
        spread = sorted(set(nodes[first:first + ranks_per_engine]))
        if len(spread) > 1:
            raise UserError(f"The colocated generation engine over policy ranks {first}-{first + ranks_per_engine - 1} "
                            f"(policy.generation.vllm_cfg.tensor_parallel_size={ranks_per_engine}) was placed across "
                            f"nodes {', '.join(spread)}: Ray did not keep each engine's ranks on one node. Use a "
                            "smaller tensor_parallel_size, or dedicated generation "
                            "(policy.generation.colocated.enabled=false).")


def shares(prompts: Sequence[Prompt], sampling: SamplingConfig, engines: int
           ) -> list[tuple[list[Prompt], SamplingConfig]]:
    """Each engine's prompts and sampling (seed_offset: where its share starts in the step; the
    prompts' own seeds, when given, cut to its share)."""
    return [(list(prompts[start:stop]), dataclasses.replace(
        sampling, seed_offset=sampling.seed_offset + start,
        seeds=None if sampling.seeds is None else sampling.seeds[start:stop]))
            for start, stop in share_groups(prompts, engines)]


class LocalGeneration(GenerationBackend, QueuedWeights, Offloadable, StreamsRequests):
    """Implements GenerationBackend: one engine in this process, beside an in-process policy."""

    def __init__(self, engine: Engine, policy: WeightSender | None = None, layout: GenerationLayout | None = None, *,
                 bucket_bytes: int = BUCKET_BYTES, dtype: torch.dtype | None = None) -> None:
        """policy None: an engine that evaluates fixed weights (`novarl eval`)."""
        self.engine, self.policy, self.layout = engine, policy, layout
        self.bucket_bytes, self.dtype = bucket_bytes, dtype

    def submit(self, prompts: Sequence[Prompt], sampling: SamplingConfig) -> Ready:
        start = time.perf_counter()
        completions = self.engine.generate(prompts, sampling)
        return Ready(completions, time.perf_counter() - start)

    def continuous(self) -> ContinuousEngine | None:
        """The engine itself, when it takes requests while it generates (vLLM)."""
        return self.engine if isinstance(self.engine, ContinuousEngine) else None

    def sync_weights(self, version: int) -> dict[str, float]:
        assert self.policy is not None, "an engine of fixed weights (novarl eval) takes none"
        loaded = [0]
        buckets = self.policy.weight_buckets(self.bucket_bytes, everywhere=True, dtype=self.dtype)
        self.engine.update_weights(flatten(buckets, loaded), version)
        return {"weight_sync_mb": loaded[0] / 1e6}

    def queue_weights(self, version: int) -> dict[str, float]:
        """Asynchronous GRPO's weight update: at once (the engine generated every round submitted
        so far at its submit, so these weights come after them, as queued weights do)."""
        return self.sync_weights(version)

    def weights_taken(self) -> None:
        """Nothing to wait for: queue_weights loads them at once."""

    def offload(self) -> None:
        if isinstance(self.engine, Offloadable):
            self.engine.offload()

    def onload(self) -> None:
        if isinstance(self.engine, Offloadable):
            self.engine.onload()

    def describe(self) -> str:
        return self.layout.describe() if self.layout else "generation: 1 engine in this process"

    def shutdown(self) -> None:
        if isinstance(self.engine, Stoppable):
            self.engine.shutdown()


class ColocatedEngines(GenerationBackend, Offloadable, StreamsRequests):
    """Implements GenerationBackend: engines in the policy ranks' processes (role "generator" of
    the policy's RayWorkerGroup), one per rank or one spanning each layout.ranks_per_engine ranks."""

    ROLE = "generator"

    def __init__(self, policy_group, factory: type, kwargs: dict[str, Any], layout: GenerationLayout, *,
                 bucket_bytes: int, dtype: torch.dtype | None) -> None:
        self.group, self.layout = policy_group, layout
        self.bucket_bytes, self.dtype = bucket_bytes, dtype
        self.loaded: list[int] = []
        """Bytes each rank's engine took at the last sync, from its own rank's gather."""
        if layout.ranks_per_engine > 1:
            check_engine_nodes(policy_group.call_all_actors("node"), layout.ranks_per_engine)
        policy_group.add_role(self.ROLE, factory, kwargs)

    def submit(self, prompts: Sequence[Prompt], sampling: SamplingConfig) -> RayRollout:
        """Each engine's share to every rank it spans (ranks r*k .. r*k+k-1 hold engine r's shards)."""
        work = rank_work([(self.ROLE, *w) for w in shares(prompts, sampling, self.layout.engines)],
                         self.layout.ranks_per_engine)
        return RayRollout(self.group, self.group.submit_each("generate_share", work), self.layout.ranks_per_engine)

    def continuous(self) -> ContinuousEngine | None:
        from novarl.backends.generation.streams import RemoteContinuous

        return RemoteContinuous(self.group, self.ROLE, self.layout.engines, self.layout.ranks_per_engine) \
            if self._takes_requests else None

    @functools.cached_property
    def _takes_requests(self) -> bool:
        """Whether the engines take requests while they generate (asked once)."""
        return all(self.group.call_all_actors("streams_requests", self.ROLE))

    def sync_weights(self, version: int) -> dict[str, float]:
        """Every rank loads its own gather into its engine (or its shard of one); weight_sync_mb is
        what one rank's engine took."""
        self.loaded = self.group.call_all_actors("sync_generator", version, self.bucket_bytes, self.dtype)
        return {"weight_sync_mb": self.loaded[0] / 1e6}

    def offload(self) -> None:
        self.group.call_all_actors("offload_role", self.ROLE)

    def onload(self) -> None:
        """Nothing to do: an engine wakes when it next generates or takes weights."""

    def describe(self) -> str:
        return self.layout.describe()

    def shutdown(self) -> None:
        """The policy's group stops the processes."""


class DedicatedEngines(GenerationBackend, QueuedWeights, StreamsRequests):
    """Implements GenerationBackend: engine actors of their own, fed by the policy's rank 0 over
    a weight-transfer group (see weight_sync.WeightBridge)."""

    def __init__(self, engine_group, policy_group, layout: GenerationLayout, *, bucket_bytes: int,
                 dtype: torch.dtype | None) -> None:
        from novarl.distributed.ray_group import wait_groups

        self.group, self.policy_group, self.layout = engine_group, policy_group, layout
        self.bucket_bytes, self.dtype = bucket_bytes, dtype
        sender = policy_group.actors[0]  # it hosts the group's rendezvous
        host, port = policy_group.collect([sender.address.remote()])[0]
        sizes = engine_group.call_all_actors("bridge_ranks")  # an engine's workers may each take a rank
        firsts = [1 + sum(sizes[:i]) for i in range(len(sizes))]
        world = 1 + sum(sizes)
        wait_groups([(policy_group, [sender.join_weight_bridge.remote(host, port, 0, world)]),
                     (engine_group, [a.join_weight_bridge.remote(host, port, first, world)
                                     for first, a in zip(firsts, engine_group.actors, strict=True)])])
        self.receiving: list = []
        """The engines' queued weight update (queue_weights), until weights_taken."""

    def submit(self, prompts: Sequence[Prompt], sampling: SamplingConfig) -> RayRollout:
        work = shares(prompts, sampling, self.layout.engines)
        return RayRollout(self.group, self.group.submit_each("generate_share", [(None, *w) for w in work]))

    def continuous(self) -> ContinuousEngine | None:
        from novarl.backends.generation.streams import RemoteContinuous

        return RemoteContinuous(self.group, None, self.layout.engines) if self._takes_requests else None

    @functools.cached_property
    def _takes_requests(self) -> bool:
        """Whether the engines take requests while they generate (asked once)."""
        return all(self.group.call_all_actors("streams_requests", None))

    def sync_weights(self, version: int) -> dict[str, float]:
        from novarl.distributed.ray_group import wait_groups

        sent, _ = wait_groups([
            (self.policy_group, [a.send_weights.remote(self.bucket_bytes, self.dtype)
                                 for a in self.policy_group.actors]),
            (self.group, [a.receive_weights.remote(version) for a in self.group.actors])])
        return {"weight_sync_mb": sent[0] / 1e6}

    def queue_weights(self, version: int) -> dict[str, float]:
        """The policy's weights to the engines behind the rounds already submitted to them, without
        waiting for those: the training ranks gather them and rank 0 keeps a host copy, which a
        thread of its own sends when every engine has come to take it (a round submitted after
        this call is generated with these weights or newer). The engines must have taken the
        previous copy first (weights_taken: at most one copy is held)."""
        self.weights_taken()
        sent = self.policy_group.call_all_actors("queue_weights", self.bucket_bytes, self.dtype, version)
        self.receiving = [a.receive_weights.remote(version, True) for a in self.group.actors]
        return {"weight_sync_mb": sent[0] / 1e6}

    def weights_taken(self) -> None:
        """Until the engines have taken the weights queued last (after the rounds submitted before
        them), raising what they raised."""
        receiving, self.receiving = self.receiving, []
        self.group.collect(receiving)

    def describe(self) -> str:
        device = "GPU" if self.layout.devices_per_node and torch.cuda.is_available() else "CPU rank"
        return self.layout.describe(device)

    def shutdown(self) -> None:
        self.group.shutdown()
