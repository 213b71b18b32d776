"""What an environment is to novarl: after each of the model's turns it reads the conversation and
says what comes next -- an observation (the next message the model sees), a reward, whether the
episode is over -- as NeMo RL's `EnvironmentInterface.step` does, per episode rather than per batch
(episodes move on their own: a finished turn goes to its environment while others still generate).

A single-turn task is an environment that scores the one answer and ends (`ScoredOnce`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from novarl.data.arithmetic import Example

if TYPE_CHECKING:
    from novarl.rollout.agents import AgentFunction

Message = dict[str, str]
"""An OpenAI-style chat message: {"role": ..., "content": ...}."""


@dataclass(frozen=True)
class EnvStep:
    """An environment's answer to one turn."""

    reward: float
    """This turn's reward (an episode's reward is the sum of its turns')."""
    done: bool
    """The episode is over: no observation follows."""
    observation: Message | None = None
    """The next message the model sees (role "user", "tool" or "environment"); None when done."""
    metadata: Mapping[str, Any] = field(default_factory=dict)
    """The episode's state for the next step (NeMo RL's metadata), the environment's own."""
    flags: frozenset[str] = frozenset()
    """What was wrong with the turn it answers: "invalid_tool_call" (a call that cannot be run: malformed,
    or of a tool that does not exist), whose turn grpo.invalid_tool_call_advantage gives that advantage."""


@runtime_checkable
class MakesExamples(Protocol):
    """An environment that makes its own prompts (a game: its puzzles); the data section is then not read."""

    def examples(self, split: str, count: int, seed: int) -> list[Example]:
        """`count` examples of `split` ("train" or "validation"), the same for the same seed; each
        row's fields are its episode's first metadata."""
        ...


@runtime_checkable
class Environment(Protocol):
    def step(self, conversation: list[Message], metadata: Mapping[str, Any]) -> EnvStep:
        """The conversation so far (the prompt's messages, then the turns: the model's as
        "assistant" messages, the observations between them) and the episode's metadata (the
        data row's fields and its answer, under "answer", at the first turn; then what the last
        step returned). An environment may also name `stop_strings` (a tuple): every turn ends on
        them besides policy.generation.stop_strings."""
        ...


@dataclass(frozen=True)
class ScoredOnce:
    """A single-turn task as an environment: the answer (the last assistant message) scored by a
    function of (answer text, metadata) -> reward, and the episode over."""

    score: Callable[[str, Mapping[str, Any]], float]

    def step(self, conversation: list[Message], metadata: Mapping[str, Any]) -> EnvStep:
        return EnvStep(reward=float(self.score(conversation[-1]["content"], metadata)), done=True)


def episode_environment(cfg) -> tuple[str, Any] | None:
    """(name, block) of the env.<name> block that plays the run's episodes (it names a class:
    actor_class_fqn, or an agent), or None: completions are scored by reward.function."""
    return next(((name, block) for name, block in cfg.env.items() if block.plays_episodes), None)


def environment_examples(name: str, environment: MakesExamples, split: str, count: int, seed: int) -> list[Example]:
    """The environment's own examples; a UserError naming env.<name> when it fails or makes none."""
    from novarl.errors import UserError

    try:
        made = list(environment.examples(split, count, seed))
    except Exception as err:
        raise UserError(f"env.{name}: making its {split} examples failed: {type(err).__name__}: "
                        f"{' '.join(str(err).split())}.") from None
    if not made or not all(isinstance(e, Example) for e in made):
        raise UserError(f"env.{name}: examples({split!r}, {count}, {seed}) gave {len(made)} item(s), not a list of "
                        "novarl.data.arithmetic.Example")
    return made


def load_environment(name: str, block) -> Environment | AgentFunction:
    """env.<name>'s class, built with its cfg (or its agent function: rollout/agents.py
    AgentFunction); a UserError naming the block for anything wrong."""
    from novarl.errors import UserError
    from novarl.rewards.registry import import_attribute

    if block.agent is not None:
        from novarl.rollout.agents import load_agent

        return load_agent(name, block.agent)
    key = f"env.{name}.actor_class_fqn"
    cls, where = import_attribute(block.actor_class_fqn, key, what="class")
    if not callable(cls):
        raise UserError(f"{key}='{block.actor_class_fqn}': it names a {type(cls).__name__} in {where}, not a class.")
    try:
        environment = cls(dict(block.cfg))
    except Exception as err:
        raise UserError(f"env.{name}: building {block.actor_class_fqn}(cfg) failed: {type(err).__name__}: "
                        f"{' '.join(str(err).split())} (cfg: {dict(block.cfg)!r}).") from None
    if not callable(getattr(environment, "step", None)):
        raise UserError(f"env.{name}: {block.actor_class_fqn} has no step(conversation, metadata) method "
                        "(novarl/rollout/environment.py says what it answers).")
    return environment
