"""Agents of the user's as episodes: `env.<name>.agent: 'module:function'` names a function
`agent(client, example) -> reward` that plays one episode through `client`, an `openai.OpenAI`
client bound to a session of the run's chat endpoint (rollout/endpoint.py), and returns the
episode's reward. `example` is the data row: its prompt ("prompt": the example's own text or chat
messages, before any template), "answer" and its other fields; "tools" are the agent's own, sent
with its requests as the OpenAI API has them. Any framework that takes an OpenAI base URL and key
works: client.base_url and client.api_key.

Each episode trains on exactly the tokens the engines sampled for it (the endpoint records them,
with the engines' logprobs) and the tokens of the messages the agent added between turns, as the
chat template renders them. An agent that raises, returns no number or makes no request fails its
episode: counted, no loss (rollout/episodes.py check_failures). The agents of a round run each on
a thread, all at once (up to MAX_AGENTS) or `env.<name>.num_workers` at a time when it is set (a
run's saved config keeps it unset, so a resumed run runs them alike);
their requests are batched for the engines.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from novarl.backends.protocols import GenerationBackend
from novarl.rollout.episodes import ObservationTokens, continuous_engine
from novarl.types import Completion, Prompt, SamplingConfig

MAX_AGENTS = 1024
"""How many agents of a round run at once when env.<name>.num_workers is not set."""

AGENT_TIMEOUT_S = 600.0
"""How long the client an agent gets waits for one completion (seconds)."""


@dataclass(frozen=True)
class AgentFunction:
    """env.<name>.agent, imported: what load_environment gives for an agent's block."""

    name: str
    spec: str
    function: Callable[[Any, dict[str, Any]], float]


def load_agent(name: str, spec: str) -> AgentFunction:
    from novarl.errors import UserError
    from novarl.rewards.registry import import_attribute

    function, where = import_attribute(spec, f"env.{name}.agent", what="function")
    if not callable(function):
        raise UserError(f"env.{name}.agent='{spec}': it names a {type(function).__name__} in {where}, not a function "
                        "agent(client, example) -> reward.")
    return AgentFunction(name, spec, function)


def agent_example(prompt: Prompt) -> dict[str, Any]:
    """What the agent is given of its example."""
    return {**prompt.columns, "prompt": prompt.source if prompt.source is not None else prompt.text,
            "answer": prompt.answer, "index": prompt.index}


class AgentEpisodes:
    """How a run plays agents' episodes (the Episodes of rollout/episodes.py for an agent): the
    endpoint starts with the first round and serves the run's engines until `shutdown`."""

    def __init__(self, agent: AgentFunction, tokenizer, observations: ObservationTokens,
                 render: Callable[[list, list | None], list[int]], *, model: str, max_turns: int,
                 max_tokens: int | None, max_failed_fraction: float, workers: int | None,
                 per_sample: bool = False) -> None:
        """per_sample: policy.generation.vllm_cfg.async_engine -- each request joins the engine's running
        batch as it comes (an engine that takes requests while it generates), not a batch of its own."""
        self.agent, self.tokenizer, self.observations, self.render = agent, tokenizer, observations, render
        self.model, self.max_turns, self.max_tokens = model, max_turns, max_tokens
        self.max_failed_fraction, self.workers, self.per_sample = max_failed_fraction, workers, per_sample
        self.endpoint = None
        self.generator: GenerationBackend | None = None
        self.http = None

    def serving(self, generator: GenerationBackend):
        """The endpoint over `generator` (started for it, the one before shut down)."""
        from novarl.rollout.endpoint import ChatEndpoint

        import os

        import httpx

        # the endpoint tokenises on many threads at once: the tokenizers' own thread pool on top of them
        # takes the cores from the engines (measured: a round's generation 3x slower on 2 cores)
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        if self.endpoint is None or self.generator is not generator:
            self.shutdown()
            engine = continuous_engine(generator) if self.per_sample else None
            self.endpoint = ChatEndpoint(generator, self.tokenizer, self.observations, render=self.render,
                                         model=self.model, max_turns=self.max_turns, max_tokens=self.max_tokens,
                                         continuous=engine)
            self.generator = generator
            # one connection pool for every agent's client (a client's own costs ~35 ms of CPU to make)
            self.http = httpx.Client(timeout=AGENT_TIMEOUT_S, limits=httpx.Limits(max_connections=None))
        return self.endpoint

    def play(self, generator: GenerationBackend, prompts: Sequence[Prompt], sampling: SamplingConfig
             ) -> tuple[list[Completion], list[float]]:
        """One agent call per prompt (`workers` at once): (its episode's Completion, its reward) per
        prompt, in order."""
        import openai  # once: importing it on each agent's thread would queue them on the import lock

        endpoint = self.serving(generator)
        workers = min(self.workers or MAX_AGENTS, len(prompts)) or 1
        with ThreadPoolExecutor(workers, thread_name_prefix="novarl-agent") as pool:
            played = list(pool.map(lambda job: self._episode(openai, endpoint, *job, sampling), enumerate(prompts)))
        newest = max((c.policy_version for c, _ in played), default=0)  # an episode without a turn: not stale
        return [replace(c, policy_version=newest) if c.policy_version < 0 else c for c, _ in played], \
            [r for _, r in played]

    def _episode(self, openai, endpoint, index: int, prompt: Prompt, sampling: SamplingConfig
                 ) -> tuple[Completion, float]:
        session = endpoint.open(index, prompt, sampling)
        where = f"the agent {self.agent.spec} on example {prompt.index}"
        client = openai.OpenAI(base_url=endpoint.base_url(session), api_key=endpoint.token, max_retries=0,
                               timeout=AGENT_TIMEOUT_S, http_client=self.http)
        failed, reward = None, 0.0
        try:
            value = self.agent.function(client, agent_example(prompt))
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                failed = f"{where} returned {value!r}, not a finite number (its reward)"
            else:
                reward = float(value)
        except Exception as err:  # its own error, or the endpoint's answer to a bad request
            failed = f"{where} raised {type(err).__name__}: {' '.join(str(err).split())[:300]}"
        finally:
            played = endpoint.close(session)
        completion = played.completion()
        if completion is None:
            failed = failed or f"{where} made no request to the endpoint"
            completion = Completion(prompt=prompt, token_ids=[], logprobs=[], text="", finish_reason="stop",
                                    policy_version=-1, turns=0)  # its version: play's
        return replace(completion, failed=failed), reward

    def take_metrics(self) -> dict[str, float]:
        return self.endpoint.take_metrics() if self.endpoint is not None else {}

    def shutdown(self) -> None:
        if self.endpoint is not None:
            self.endpoint.shutdown()
            self.http.close()
            self.endpoint = self.http = None
