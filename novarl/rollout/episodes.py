"""Episodes of several turns: the engine generates a turn, the environment answers it, its
observation's tokens are appended, and the engine generates the next turn from the whole token
sequence -- never from a re-tokenised conversation, whose tokens can differ from what was sampled.

Each episode becomes one Completion for training: its token_ids are every turn's sampled tokens
and every observation's tokens in order, `observed` marks the observations' spans (no loss, logprob
0), and `logprobs` are the engine's for the sampled ones. Turns run in lockstep here (every active
episode's turn t in one submission); episodes that end early leave the next submissions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from novarl.backends.protocols import GenerationBackend
from novarl.errors import RunFailed
from novarl.rollout.environment import Environment, EnvStep, Message
from novarl.types import Completion, Prompt, SamplingConfig

TURN_SEED_STRIDE = 7_919
"""Turn t of an episode samples with the step's seed + t x this (turn 0: the step's seed)."""


class ObservationTokens(Protocol):
    def __call__(self, message: Message, turn: Sequence[int]) -> list[int]:
        """The tokens an observation adds after a turn (the turn's sampled tokens: `turn`), rendered once."""
        ...


@dataclass(frozen=True)
class ContentTokens:
    """An observation as its content's tokens, no special tokens added (an environment that
    formats its own messages, and models without a chat template: the bundled ones)."""

    tokenizer: Any

    def __call__(self, message: Message, turn: Sequence[int] = ()) -> list[int]:
        return list(self.tokenizer(message["content"], add_special_tokens=False)["input_ids"])


TURN_MARK = "\u2063novarl-turn\u2063"
"""An assistant turn's text in the reference conversation a template renders (no template writes it)."""


@dataclass(frozen=True)
class TemplateTokens:
    """An observation as the chat template renders it after an assistant turn: what the template
    writes after the turn's text (its end-of-turn marker, less what the sampled turn already holds:
    a turn that ended on its end-of-turn token has it, one cut by a stop string has not), then the
    message, then the next assistant turn's header. Taken from the template's rendering of a
    reference conversation with and without the message, so it matches the template's own
    rendering of the whole conversation; the episode's earlier tokens are never rendered again."""

    tokenizer: Any
    template: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def _render(self, messages: list[Message], next_turn: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                                  add_generation_prompt=next_turn, **self.kwargs)

    def text(self, message: Message, ended_with: str | None) -> str:
        """The observation's text after a turn; ended_with: the text of the special token the turn
        ended on (its end-of-turn or end-of-sequence token), None when it ended otherwise."""
        from novarl.errors import UserError

        reference: list[Message] = [{"role": "user", "content": "."}, {"role": "assistant", "content": TURN_MARK}]
        try:
            before, after = self._render(reference, False), self._render([*reference, dict(message)], True)
        except Exception as err:  # jinja2's errors, and those a template raises itself
            raise UserError(f"the chat template cannot render a message of role {message.get('role')!r} after the "
                            f"model's turn ({type(err).__name__}: {err})") from None
        if not after.startswith(before) or TURN_MARK not in before:
            raise UserError("the chat template renders a conversation differently once a message follows it, so an "
                            "observation cannot be appended to the tokens sampled so far")
        closing = before[before.rindex(TURN_MARK) + len(TURN_MARK):]
        if ended_with and closing.startswith(ended_with):  # the sampled turn holds the template's end marker
            closing = closing[len(ended_with):]
        return closing + after[len(before):]

    def __call__(self, message: Message, turn: Sequence[int]) -> list[int]:
        special = set(getattr(self.tokenizer, "all_special_ids", ()) or ())
        ended_with = self.tokenizer.decode([turn[-1]], skip_special_tokens=False) \
            if turn and turn[-1] in special else None
        text = self.text(message, ended_with)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


@dataclass
class Episode:
    prompt: Prompt
    conversation: list[Message]
    metadata: Mapping[str, Any]
    tokens: list[int] = field(default_factory=list)
    """After the prompt: sampled and observed, in order."""
    logprobs: list[float] = field(default_factory=list)
    observed: list[tuple[int, int]] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    finish_reason: str = "stop"
    policy_version: int = 0
    last_text: str = ""
    done: bool = False
    failed: str | None = None

    def request(self) -> Prompt:
        """The next turn's prompt: the episode's tokens so far."""
        return dataclasses.replace(self.prompt, token_ids=[*self.prompt.token_ids, *self.tokens])

    def took(self, completion: Completion) -> None:
        self.tokens += completion.token_ids
        self.logprobs += completion.logprobs
        self.turns += 1
        self.finish_reason, self.policy_version = completion.finish_reason, completion.policy_version
        self.last_text = completion.text
        self.conversation.append({"role": "assistant", "content": completion.text})

    def answered(self, step: EnvStep, observation: list[int] | None) -> None:
        self.reward += step.reward
        self.metadata = step.metadata or self.metadata
        if observation is None:
            self.done = True
            return
        assert step.observation is not None
        self.observed.append((len(self.tokens), len(self.tokens) + len(observation)))
        self.tokens += observation
        self.logprobs += [0.0] * len(observation)
        self.conversation.append(step.observation)

    def completion(self) -> Completion:
        return Completion(prompt=self.prompt, token_ids=self.tokens, logprobs=self.logprobs, text=self.last_text,
                          finish_reason="length" if self.finish_reason == "length" else "stop",
                          policy_version=self.policy_version, observed=tuple(self.observed), turns=self.turns,
                          failed=self.failed)


def first_metadata(prompt: Prompt) -> dict[str, Any]:
    """What an environment's first step reads as metadata: the data row's fields, and its answer
    under "answer" (when the row has one)."""
    return {**prompt.columns, **({"answer": prompt.answer} if prompt.answer is not None else {})}


@dataclass(frozen=True)
class Episodes:
    """How a run plays its episodes: its environment, how an observation becomes tokens, and the
    bounds (grpo.max_rollout_turns, policy.max_seq_length)."""

    environment: Environment
    observation_tokens: ObservationTokens
    max_turns: int
    max_tokens: int | None = None
    max_failed_fraction: float = 0.0
    """env.<name>.max_failed_fraction: above it a step's failed episodes stop the run."""

    def play(self, generator: GenerationBackend, prompts: Sequence[Prompt], sampling: SamplingConfig
             ) -> tuple[list[Completion], list[float]]:
        return play(generator, prompts, sampling, self.environment, self.observation_tokens,
                    max_turns=self.max_turns, max_tokens=self.max_tokens)

    def take_metrics(self) -> dict[str, float]:
        """The environment's own counts since the last call (an environment with `take_metrics`:
        the tools' calls, errors and timeouts), {} otherwise."""
        take = getattr(self.environment, "take_metrics", None)
        return dict(take()) if callable(take) else {}


class EnvironmentFailed(RunFailed):
    """More of a step's episodes failed than the environment's bound allows."""


def answer_of(environment: Environment, episode: Episode, turn: int) -> EnvStep | str:
    """The environment's step for the episode's last turn, or why it failed (it raised, or answered
    with something that is not an EnvStep), naming the environment, the example and the turn."""
    where = f"{type(environment).__name__}.step at turn {turn + 1} of example {episode.prompt.index}"
    try:
        step = environment.step(list(episode.conversation), episode.metadata)
    except Exception as err:
        return (f"{where} raised {type(err).__name__}: {' '.join(str(err).split())[:300]} "
                f"(the model's turn: {episode.last_text[:120]!r})")
    if not isinstance(step, EnvStep):
        return f"{where} returned {type(step).__name__}, not an EnvStep (novarl.rollout.environment.EnvStep)"
    return step


def neutral_rewards(completions: Sequence[Completion], rewards: Sequence[float], group_size: int) -> list[float]:
    """The rewards, a failed episode's replaced by the mean of its group's others (0 when all of the
    group failed): it then moves neither the group's baseline nor, getting no loss, the update."""
    out = list(rewards)
    for start in range(0, len(out), group_size):
        members = range(start, min(start + group_size, len(out)))
        fine = [out[i] for i in members if completions[i].failed is None]
        for i in members:
            if completions[i].failed is not None:
                out[i] = sum(fine) / len(fine) if fine else 0.0
    return out


def check_failures(completions: Sequence[Completion], bound: float, where: str) -> dict[str, float]:
    """The failed episodes' fraction (a metric); above `bound` the run stops with the first one's cause."""
    failed = [c.failed for c in completions if c.failed is not None]
    fraction = len(failed) / max(len(completions), 1)
    if failed and fraction > bound:
        raise EnvironmentFailed(f"{len(failed)} of {len(completions)} episodes failed {where}, more than "
                                f"env.<name>.max_failed_fraction={bound:g} allows; the first: {failed[0]}")
    return {"episodes_failed_fraction": fraction}


def play(generator: GenerationBackend, prompts: Sequence[Prompt], sampling: SamplingConfig,
         environment: Environment, observation_tokens: ObservationTokens, *, max_turns: int,
         max_tokens: int | None = None) -> tuple[list[Completion], list[float]]:
    """Play one episode per prompt for at most max_turns turns (and, with max_tokens, until an
    episode's prompt and tokens would pass it): (its Completion, its reward) per prompt, in order.
    A turn cut by max_new_tokens still goes to the environment, which decides whether the episode
    goes on."""
    episodes = [Episode(p, [{"role": "user", "content": p.text}], first_metadata(p)) for p in prompts]
    own = tuple(getattr(environment, "stop_strings", ()) or ())  # the environment's turns end on these too
    sampling = dataclasses.replace(sampling, stop_strings=tuple(dict.fromkeys((*sampling.stop_strings, *own))))
    active = list(range(len(episodes)))
    for turn in range(max_turns):
        if not active:
            break
        seed = None if sampling.seed is None else sampling.seed + turn * TURN_SEED_STRIDE
        completions = generator.submit([episodes[i].request() for i in active],
                                       dataclasses.replace(sampling, seed=seed)).result()
        for i, completion in zip(active, completions):
            episode = episodes[i]
            episode.took(completion)
            step = answer_of(environment, episode, turn)
            if isinstance(step, str):  # it failed: the episode ends here, without loss
                episode.failed, episode.done = step, True
                continue
            last = step.done or step.observation is None or turn == max_turns - 1
            observation = None if last else observation_tokens(step.observation, completion.token_ids)
            if observation is not None and max_tokens is not None and \
                    len(episode.prompt.token_ids) + len(episode.tokens) + len(observation) >= max_tokens:
                observation = None  # no room for another turn
            episode.answered(step, observation)
        active = [i for i in active if not episodes[i].done]
    return [e.completion() for e in episodes], [e.reward for e in episodes]
