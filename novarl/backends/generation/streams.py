"""Continuous batching across processes: episodes' turns sent one by one to engines on Ray actors.

An episode played on its own (rollout/episodes.py play_each, the agents' endpoint) hands each
turn to a ContinuousEngine as soon as its environment answered. In the driver's process that
engine is vLLM's own (`add` / `step`). Engines elsewhere -- dedicated actors, or colocated in the
policy ranks -- are driven through `RemoteContinuous`: each call, `RankActor.continue_requests`, adds
the turns queued for its engine since the last call and steps the engine until one of this caller's
turns finishes (or STEPS_PER_CALL steps); the next call waits behind it on the actor
(CALLS_IN_FLIGHT), so the engine does not idle while the driver answers; the driver waits on
whichever engine answers first. An example's turns all go to one engine (its GRPO group and its
later turns reuse the engine's prefix cache), examples to the engine with the fewest turns open.

Several callers may drive the same engines at once (asynchronous GRPO plays its rounds in flight,
and an evaluation, each on a thread of its own): each is a stream, and EngineStreams
(distributed/engine_streams.py) on the actor keeps each stream's finished turns for its own next
call. An engine spanning several ranks (tensor parallelism, colocated) gets the same calls on each
of them in the same order -- one stream at a time drives it (a synchronous run) -- and steps them
the same number of times, so its shards stay in lockstep; their answers are compared.
"""

from __future__ import annotations

import itertools
import os
from collections import deque

from novarl.backends.protocols import ContinuousEngine
from novarl.errors import RunFailed
from novarl.types import Completion, Prompt, SamplingConfig

STEPS_PER_CALL = 8
"""The most engine steps one continue_requests call takes before it answers without a finished
turn (the turns queued meanwhile wait at most that long to join the running batch)."""
CALLS_IN_FLIGHT = 2
"""Calls an engine has at once: one running, the next queued behind it with the turns sent meanwhile."""
WAIT_S = 0.02
"""How long RemoteContinuous.step waits for an engine's answer before it returns none."""

_STREAMS = itertools.count()


class RemoteContinuous(ContinuousEngine):
    """Implements ContinuousEngine over the engines of a Ray worker group: `engines` engines, engine e
    on ranks e*k .. e*k+k-1 (k = ranks_per_engine), reached through RankActor.continue_requests
    (`role`: the added role that hosts the engine, None: the group's own)."""

    def __init__(self, group, role: str | None, engines: int, ranks_per_engine: int = 1, *,
                 max_steps: int = STEPS_PER_CALL, wait_s: float = WAIT_S) -> None:
        self.group, self.role, self.ranks_per_engine = group, role, ranks_per_engine
        self.max_steps, self.wait_s = max_steps, wait_s
        self.stream = f"{os.getpid()}-{next(_STREAMS)}"
        self.queued: list[list[tuple[int, Prompt, SamplingConfig]]] = [[] for _ in range(engines)]
        self.open = [0] * engines
        """Turns added to each engine and not yet returned."""
        self.calls: dict[int, deque[list]] = {e: deque() for e in range(engines)}
        """Each engine's calls in flight, oldest first (CALLS_IN_FLIGHT at most): one ref per rank it spans."""
        self.home: dict[int, int] = {}
        """Each example's engine (Prompt.index), where its first turn went."""

    def add(self, key: int, prompt: Prompt, sampling: SamplingConfig) -> None:
        engine = self.home.get(prompt.index)
        if engine is None:
            engine = self.home[prompt.index] = min(range(len(self.open)), key=self.open.__getitem__)
        self.queued[engine].append((key, prompt, sampling))
        self.open[engine] += 1

    def step(self) -> list[tuple[int, Completion]]:
        """Keep CALLS_IN_FLIGHT calls on every engine with turns open (the next one queued behind the
        running one, so the engine does not wait for the driver between them), then wait (WAIT_S at
        most) for one to answer: the turns finished by the calls that answered."""
        import ray

        for engine, count in enumerate(self.open):
            if count and len(self.calls[engine]) < CALLS_IN_FLIGHT:
                requests, self.queued[engine] = self.queued[engine], []
                first = engine * self.ranks_per_engine
                self.calls[engine].append([
                    actor.continue_requests.remote(self.role, self.stream, requests, self.max_steps)
                    for actor in self.group.actors[first:first + self.ranks_per_engine]])
        heads = [refs for calls in self.calls.values() if calls for refs in calls[0]]
        if not heads:
            return []
        ray.wait(heads, num_returns=1, timeout=self.wait_s)
        finished: list[tuple[int, Completion]] = []
        for engine, calls in self.calls.items():  # an engine answers its calls in order
            while calls and len(ray.wait(calls[0], num_returns=len(calls[0]), timeout=0)[0]) == len(calls[0]):
                answers = self.group.collect(calls.popleft(), first_rank=engine * self.ranks_per_engine)
                check_same_turns(answers, engine)
                self.open[engine] -= len(answers[0])
                finished += answers[0]
        return finished

    def unfinished(self) -> int:
        return sum(self.open)


def check_same_turns(answers: list[list[tuple[int, Completion]]], engine: int) -> None:
    """The ranks of an engine spanning several must have finished the same turns with the same
    tokens (their schedulers in lockstep); training on one rank's would hide a divergence until a
    collective hangs."""
    tokens = [[(key, c.token_ids) for key, c in answer] for answer in answers]
    if any(t != tokens[0] for t in tokens[1:]):
        raise RunFailed(f"generation engine {engine} (one tensor-parallel shard on each of {len(answers)} ranks) "
                        "finished different turns on its ranks: its schedulers left lockstep. Use "
                        "policy.generation.vllm_cfg.tensor_parallel_size=1, or vllm_cfg.async_engine=false.")
