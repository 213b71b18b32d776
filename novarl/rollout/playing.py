"""How a run plays its episodes, built from its config: its environment (or several, routed:
rollout/routing.py; or an agent), the examples an environment makes, and how observations and the
turns are played (rollout/episodes.py, rollout/agents.py)."""

from __future__ import annotations

from typing import Any

from novarl.backends.contract.resolve import BackendChoice
from novarl.backends.registry import generation_spec
from novarl.config.schema import NovaRLConfig
from novarl.data.arithmetic import Example
from novarl.rewards.domains import episode_names
from novarl.rollout.agents import AgentEpisodes, AgentFunction
from novarl.rollout.environment import MakesExamples, environment_examples
from novarl.rollout.episodes import ContentTokens, Episodes, PlaysEpisodes, TemplateTokens
from novarl.rollout.routing import RoutedEnvironments

ENV_WORKERS = 8
"""An environment class's steps at once when env.<name>.num_workers is not set (NeMo RL's count)."""
MADE_EXAMPLES = 4096
"""At most this many training examples an environment makes (a run cycles through them)."""


def run_environment(cfg, scorer) -> Any:
    """What plays the run's episodes: its one environment (or agent), as env.<name> builds it, or, where
    examples are routed (rewards/domains.py run_routing), a RoutedEnvironments over every environment
    of the run and the run's scorer."""
    from novarl.rewards.domains import run_routing
    from novarl.rollout.environment import episode_environment, load_environment

    routing = run_routing(cfg)
    if routing is None:
        played = episode_environment(cfg)
        assert played is not None, "a run without an environment plays no episodes"
        return load_environment(*played)
    return RoutedEnvironments({name: load_environment(name, cfg.env[name]) for name in episode_names(cfg)},
                              routing, scorer)


def describe_episodes(cfg, scorer) -> str:
    """The start-up line's: where the episodes play."""
    from novarl.rewards.domains import run_routing

    played = ", ".join(f"env.{name} ({cfg.env[name].actor_class_fqn or 'agent ' + str(cfg.env[name].agent)})"
                       for name in episode_names(cfg))
    routed = f"; examples of other domains answer once, scored by {scorer.name}" \
        if run_routing(cfg) is not None and scorer is not None else ""
    return f"episodes of up to {cfg.grpo.max_rollout_turns} turn(s) in {played}{routed}"


def run_episodes(cfg: NovaRLConfig, played, environment, tokenizer) -> PlaysEpisodes | None:
    """How the run plays its episodes (its environment's), None without one: observations rendered
    by the chat template the prompts are (its content's tokens when there is none)."""
    from novarl.data.datasets import chat_template_for

    if environment is None or not played:
        return None
    template = chat_template_for(tokenizer, cfg.policy.tokenizer.chat_template)
    kwargs = with_tools(cfg.policy.tokenizer.chat_template_kwargs, getattr(environment, "tool_schemas", None))
    observations = ContentTokens(tokenizer) if template is None else TemplateTokens(tokenizer, template, kwargs or {})
    if isinstance(environment, AgentFunction):
        from novarl.rollout.endpoint import RenderPrompt

        return AgentEpisodes(environment, tokenizer, observations, RenderPrompt(tokenizer, template, kwargs or {}),
                             model=cfg.policy.model_name, max_turns=cfg.grpo.max_rollout_turns,
                             max_tokens=cfg.policy.max_seq_length, max_failed_fraction=played[1].max_failed_fraction,
                             workers=played[1].num_workers,
                             per_sample=cfg.policy.generation.vllm_cfg.async_engine)
    blocks = [cfg.env[name] for name in episode_names(cfg)]  # several where examples are routed
    return Episodes(environment, observations, cfg.grpo.max_rollout_turns, cfg.policy.max_seq_length,
                    max_failed_fraction=min(b.max_failed_fraction for b in blocks),
                    workers=max(b.num_workers or ENV_WORKERS for b in blocks),
                    per_sample=cfg.policy.generation.vllm_cfg.async_engine)


def lockstep_warning(cfg: NovaRLConfig, episodes: PlaysEpisodes | None, choice: BackendChoice) -> list[str]:
    """vllm_cfg.async_engine asks for episodes each on its own, which this run's engines cannot play: said once."""
    if not isinstance(episodes, (Episodes, AgentEpisodes)) or not episodes.per_sample or \
            generation_spec(choice.generation).continuous_batching:
        return []
    return [f"'policy.generation.vllm_cfg.async_engine' = True: this run plays each step's turns in lockstep; "
            f"episodes play their turns each on its own with vLLM engines, not {choice.generation}'s"]


def made_examples(cfg: NovaRLConfig, played, environment, attempt, notes: list[str]
                  ) -> tuple[list[Example] | None, list[Example] | None]:
    """(train, held-out) examples of an environment that makes its own (a game's puzzles), else (None, None)."""
    if not isinstance(environment, MakesExamples):
        return None, None
    name = played[0]
    train = attempt(environment_examples, name, environment, "train",
                    min(cfg.grpo.num_prompts_per_step * cfg.grpo.max_num_steps, MADE_EXAMPLES), cfg.grpo.seed)
    val = attempt(environment_examples, name, environment, "validation", cfg.grpo.max_val_samples, cfg.grpo.seed)
    notes.append(f"env.{name} makes the prompts (its own train and held-out examples): the data section's datasets "
                 "are not read")
    return train, val


def with_tools(kwargs: dict | None, tools: list[dict] | None) -> dict | None:
    """policy.tokenizer.chat_template_kwargs, with an environment's tool schemas as `tools`."""
    return {**(kwargs or {}), "tools": tools} if tools else kwargs
