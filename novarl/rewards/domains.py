"""Reward domains: examples of several kinds in one run, each scored by its own verifier -- ROLL's
reward workers routed by `tag_included`, NeMo RL's environments named by `data.*.env_name`.

An example's domain is, in order: its `domain` column (ROLL's rows carry one), the domain whose
`tags` hold its `tag` column (ROLL's tag_included), its dataset's env_name (stored in the
`domain` column when the data is read), else reward.default_domain. The default domain is scored
by reward.function, unless reward.domains has a domain of that name (ROLL: rows of no listed tag
go to math_rule).

Per step, each domain's reward mean, pass rate (the share of its samples with a reward above 0),
sample count and verifier seconds are logged as domain/<name>/..., with its functions' own
metrics under domain/<name>/reward/....

`DomainSampler` draws each step's prompts by domain (data.domain_interleave_probs, ROLL's rule):
domain d gets int(p_d x count) prompts, the last listed the rest, each from its own shuffled pool.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from novarl.errors import UserError
from novarl.types import Completion


@dataclass(frozen=True)
class Routing:
    default: str
    domains: tuple[str, ...]
    """Every domain's name, the default's first."""
    tags: Mapping[str, str] = field(default_factory=dict)
    """tag -> domain."""

    @classmethod
    def of(cls, reward, environments: Sequence[str] = ()) -> "Routing":
        """reward's domains, and `environments`: the env.<name> blocks that play episodes (named by
        data.*.env_name as the reward domains are). An example routed nowhere goes to the run's
        environment where it has one alone, else to reward.default_domain."""
        default = environments[0] if len(environments) == 1 else reward.default_domain
        names = tuple(dict.fromkeys((default, reward.default_domain, *reward.domains, *environments)))
        return cls(default, names, {t: d for d, block in reward.domains.items() for t in block.tags})

    def domain_of(self, columns: Mapping[str, Any]) -> str:
        named = columns.get("domain")
        if named is not None:
            if named not in self.domains:
                raise UserError(f"an example's domain column is {named!r}, not a reward domain or environment ("
                                f"{', '.join(self.domains)}): add reward.domains.{named}, or fix the data.")
            return str(named)
        return self.tags.get(columns.get("tag"), self.default)


class DomainScorer:
    """Scores each completion with its domain's RewardScorer (the scorer interface: score,
    take_metrics, name)."""

    def __init__(self, scorers: Mapping[str, Any], routing: Routing):
        self.scorers, self.routing = dict(scorers), routing
        self._metrics: dict[str, list[float]] = {}

    @property
    def loads_models(self) -> bool:
        return any(getattr(scorer, "loads_models", False) for scorer in self.scorers.values())

    @property
    def name(self) -> str:
        return "; ".join(f"{domain}: {scorer.name}" for domain, scorer in self.scorers.items())

    def score(self, completions: Sequence[Completion]) -> list[float]:
        rewards = [0.0] * len(completions)
        by_domain: dict[str, list[int]] = {}
        for i, c in enumerate(completions):
            by_domain.setdefault(self.routing.domain_of(c.prompt.columns), []).append(i)
        for domain, indices in by_domain.items():
            started = time.perf_counter()
            values = self.scorers[domain].score([completions[i] for i in indices])
            seconds = time.perf_counter() - started
            for i, value in zip(indices, values):
                rewards[i] = value
            self._add(f"domain/{domain}/reward_mean", values)
            self._add(f"domain/{domain}/pass_rate", [float(v > 0) for v in values])
            self._sum(f"domain/{domain}/samples", len(values))
            self._sum(f"domain/{domain}/verifier_seconds", seconds)
        return rewards

    def take_metrics(self) -> dict[str, float]:
        out = {k: (sum(v) / len(v) if not k.endswith(("/samples", "/verifier_seconds")) else sum(v))
               for k, v in self._metrics.items() if v}
        self._metrics.clear()
        for domain, scorer in self.scorers.items():
            out.update({f"domain/{domain}/{k}": v for k, v in scorer.take_metrics().items()})
        return out

    def _add(self, key: str, values: list[float]) -> None:
        self._metrics.setdefault(key, []).extend(values)

    def _sum(self, key: str, value: float) -> None:
        self._metrics.setdefault(key, []).append(value)


def domain_scorer(reward, make) -> Any:
    """reward.function's scorer when reward.domains is empty, else a DomainScorer over each domain's
    (`make(function, weights)` builds one)."""
    if not reward.domains:
        return make(reward.function, reward.weights)
    routing = Routing.of(reward)
    scorers = {name: make(reward.domains[name].function, reward.domains[name].weights) if name in reward.domains
               else make(reward.function, reward.weights) for name in routing.domains}
    return DomainScorer(scorers, routing)


@dataclass
class DomainSampler:
    """Prompts drawn by domain in fixed shares (the PromptSampler interface: next_batch,
    state_dict, load_state_dict)."""

    samplers: Mapping[str, Any]
    """Each domain's PromptSampler, in the order of data.domain_interleave_probs."""
    probs: Mapping[str, float]

    def counts(self, count: int) -> dict[str, int]:
        """ROLL's split: int(p x count) each, the last domain the rest."""
        domains = list(self.probs)
        shares = {d: int(self.probs[d] * count) for d in domains[:-1]}
        shares[domains[-1]] = count - sum(shares.values())
        if shares[domains[-1]] < 0:
            raise UserError(f"data.domain_interleave_probs={dict(self.probs)} gives more than {count} prompts to the "
                            f"domains before {domains[-1]}: their probabilities sum above 1.")
        return shares

    def next_batch(self, count: int) -> list:
        return [p for domain, n in self.counts(count).items() if n for p in self.samplers[domain].next_batch(n)]

    def state_dict(self) -> dict[str, Any]:
        return {domain: sampler.state_dict() for domain, sampler in self.samplers.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for domain, sampler in self.samplers.items():
            sampler.load_state_dict(state[domain])


def domain_sampler(prompts: Sequence[Any], probs: Mapping[str, float], routing: Routing, batch_size: int,
                   make) -> DomainSampler:
    """A DomainSampler over `prompts` split by domain (`make(prompts, batch_size)` builds each pool's
    sampler); a UserError when a domain's pool is smaller than its share of a step."""
    pools: dict[str, list] = {d: [] for d in probs}
    for prompt in prompts:
        domain = routing.domain_of(prompt.columns)
        if domain in pools:
            pools[domain].append(prompt)
    sampler = DomainSampler({}, probs)
    shares = sampler.counts(batch_size)
    small = [f"{d} ({len(pools[d])} example(s) for {n} a step)" for d, n in shares.items() if len(pools[d]) < n]
    if small:
        raise UserError(f"data.domain_interleave_probs: too few training examples in {', '.join(small)}.")
    sampler.samplers = {d: make(pools[d], max(shares[d], 1)) for d in probs if pools[d]}
    missing = [d for d in probs if not pools[d]]
    if missing and any(shares[d] for d in missing):
        raise UserError(f"data.domain_interleave_probs: no training example is in {', '.join(missing)}.")
    return sampler


def run_scorer(cfg, reward_fn=None) -> Any:
    """The run's scorer: the trainer's own reward function, reward.function, or a DomainScorer
    over reward.domains."""
    from novarl.rewards.scorer import RewardScorer

    def make(function, weights):
        return RewardScorer.from_spec(function, weights=weights, timeout_s=cfg.reward.timeout_s, settings=cfg.reward)

    if reward_fn is not None:
        return RewardScorer.from_spec(reward_fn, timeout_s=cfg.reward.timeout_s, settings=cfg.reward)
    return domain_scorer(cfg.reward, make)


def episode_names(cfg) -> list[str]:
    """The env.<name> blocks that play episodes (an environment class, or an agent)."""
    return [name for name, block in cfg.env.items() if block.plays_episodes]


def run_routing(cfg) -> Routing | None:
    """How the run's examples are routed, None where all go to one verifier or one environment: reward
    domains, several environments, an environment beside the data's env_name or data.domain_interleave_probs."""
    environments = episode_names(cfg)
    named = any(block.env_name for role in ("train", "validation") for block in getattr(cfg.data, role) or [])
    if not cfg.reward.domains and len(environments) <= 1 and not (environments and named) \
            and cfg.data.domain_interleave_probs is None:
        return None
    return Routing.of(cfg.reward, environments)


def run_sampler(cfg, prompts: Sequence[Any], notes: list[str]) -> Any:
    """The run's prompt sampler: one shuffled pool, or by domain (data.domain_interleave_probs). With
    reward domains, every example's domain is checked here, before the run starts."""
    from novarl.data.datasets import PromptSampler

    def make(pool, batch_size):
        return PromptSampler(list(pool), batch_size, seed=cfg.grpo.seed, shuffle=cfg.data.shuffle)

    probs, routing = cfg.data.domain_interleave_probs, run_routing(cfg)
    if routing is None:
        return make(prompts, cfg.grpo.num_prompts_per_step)
    counts: dict[str, int] = {}
    for prompt in prompts:
        domain = routing.domain_of(prompt.columns)
        counts[domain] = counts.get(domain, 0) + 1
    notes.append("training examples by domain: " + ", ".join(f"{d} {n}" for d, n in counts.items()))
    if probs is None:
        return make(prompts, cfg.grpo.num_prompts_per_step)
    left_out = {d: n for d, n in counts.items() if d not in probs}
    if left_out:
        notes.append("not drawn (no probability in data.domain_interleave_probs, as ROLL leaves them out): "
                     + ", ".join(f"{n} example(s) of {d}" for d, n in left_out.items()))
    return domain_sampler(prompts, probs, routing, cfg.grpo.num_prompts_per_step, make)
