"""Several environments in one run: each example's episode plays in the environment its data names.

NeMo RL names an example's environment with its dataset's `data.*.env_name`; ROLL's and novarl's
reward domains are named the same way (rewards/domains.py Routing: an example's `domain` column,
its `tag`, its dataset's env_name, else the default). A run whose env.<name> blocks name several
environment classes, or one beside reward domains, plays every example as an episode:
- an example routed to an environment plays its turns in it;
- an example routed to a reward domain answers once, and its answer is scored after the round
  by the run's scorer (batched, as in a single-turn run: its verifier sees the same completion).

Every environment's `stop_strings` end every turn (the engines' sampling is the round's), and the
chat template lists every environment's tools. Per step: each domain's reward mean, pass rate, turns
per episode and sample count (domain/<name>/...), each environment's own counts under its name.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from novarl.errors import UserError
from novarl.rewards.domains import Routing
from novarl.rollout.environment import Environment, EnvStep, MakesExamples, Message
from novarl.types import Completion

ROUTE = "novarl_environment"
"""The episode's environment, in the metadata carried from one step to the next."""
OWN = "novarl_metadata"
"""The environment's own metadata, beside ROUTE."""


class EnvironmentRaised(Exception):
    """An environment of a routed run raised: its name and its error."""


class RoutedEnvironments:
    """Implements Environment: each episode's steps go to its example's environment (`environments`,
    by env.<name>); an example of another domain ends after its first turn, scored by `finish`."""

    def __init__(self, environments: Mapping[str, Environment], routing: Routing, scorer) -> None:
        makes = [name for name, environment in environments.items() if isinstance(environment, MakesExamples)]
        if makes:
            raise UserError(f"env.{makes[0]} makes its own prompts (its examples()), so it plays a run alone for now: "
                            "beside other environments or reward domains, every example comes from the data "
                            "(data.*.env_name names its environment)")
        self.environments, self.routing, self.scorer = dict(environments), routing, scorer
        self.stop_strings = tuple(dict.fromkeys(s for e in self.environments.values()
                                                for s in getattr(e, "stop_strings", ()) or ()))
        tools = [t for e in self.environments.values() for t in getattr(e, "tool_schemas", None) or ()]
        self.tool_schemas = tools or None
        self._metrics: dict[str, list[float]] = {}
        self._lock = threading.Lock()

    def step(self, conversation: list[Message], metadata: Mapping[str, Any]) -> EnvStep:
        if ROUTE in metadata:
            name, own = metadata[ROUTE], metadata[OWN]
        else:  # the first turn: the data row's fields
            name, own = self.routing.domain_of(metadata), metadata
        environment = self.environments.get(name)
        if environment is None:  # a reward domain's: scored after the round
            return EnvStep(reward=0.0, done=True, metadata={ROUTE: name, OWN: own})
        try:
            step = environment.step(conversation, own)
        except Exception as err:
            raise EnvironmentRaised(f"env.{name} ({type(environment).__name__}) raised {type(err).__name__}: "
                                    f"{' '.join(str(err).split())[:300]}") from None
        if not isinstance(step, EnvStep):
            raise EnvironmentRaised(f"env.{name} ({type(environment).__name__}) returned {type(step).__name__}, "
                                    "not an EnvStep (novarl.rollout.environment.EnvStep)")
        return dataclasses.replace(step, metadata={ROUTE: name, OWN: step.metadata or own})

    def domain(self, completion: Completion) -> str:
        return self.routing.domain_of(completion.prompt.columns)

    def finish(self, completions: Sequence[Completion], rewards: list[float]) -> list[float]:
        """The round's rewards: the reward domains' one-turn episodes scored by the run's scorer; each
        domain's reward mean, pass rate, turns and samples counted (a failed episode not among them)."""
        domains = [self.domain(c) for c in completions]
        scored = [i for i, d in enumerate(domains) if d not in self.environments]
        if scored:
            for i, value in zip(scored, self.scorer.score([completions[i] for i in scored]), strict=True):
                rewards[i] = value
        by_domain: dict[str, list[tuple[float, int]]] = {}
        for domain, completion, reward in zip(domains, completions, rewards):
            if completion.failed is None:
                by_domain.setdefault(domain, []).append((reward, completion.turns))
        with self._lock:
            for domain, played in by_domain.items():
                add = self._metrics.setdefault
                add(f"domain/{domain}/reward_mean", []).extend(r for r, _ in played)
                add(f"domain/{domain}/pass_rate", []).extend(float(r > 0) for r, _ in played)
                add(f"domain/{domain}/episode_turns_mean", []).extend(float(t) for _, t in played)
                add(f"domain/{domain}/samples", []).append(float(len(played)))
        return rewards

    def take_metrics(self) -> dict[str, float]:
        """Since the last call: each domain's counts, and each environment's own (`take_metrics`)
        under domain/<name>/."""
        with self._lock:
            metrics, self._metrics = self._metrics, {}
        out = {k: sum(v) if k.endswith("/samples") else sum(v) / len(v) for k, v in metrics.items() if v}
        for name, environment in self.environments.items():
            take = getattr(environment, "take_metrics", None)
            if callable(take):
                out.update({f"domain/{name}/{k}": v for k, v in dict(take()).items()})
        return out
