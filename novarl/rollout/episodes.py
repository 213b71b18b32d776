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
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from novarl.backends.protocols import ContinuousEngine, GenerationBackend, StreamsRequests
from novarl.errors import RunFailed
from novarl.rollout.environment import Environment, EnvStep, Message
from novarl.rollout.routing import RoutedEnvironments
from novarl.types import Completion, Prompt, SamplingConfig

TURN_SEED_STRIDE = 7_919
"""Turn t of an episode samples with the step's seed + t x this (turn 0: the step's seed)."""


class ObservationTokens(Protocol):
    def __call__(self, message: Message | Sequence[Message], turn: Sequence[int]) -> list[int]:
        """The tokens an observation (a message, or several in a row) adds after a turn (the turn's
        sampled tokens: `turn`), rendered once."""
        ...


@dataclass(frozen=True)
class ContentTokens:
    """An observation as its content's tokens, no special tokens added (an environment that
    formats its own messages, and models without a chat template: the bundled ones)."""

    tokenizer: Any

    def __call__(self, message: Message | Sequence[Message], turn: Sequence[int] = ()) -> list[int]:
        messages = [message] if isinstance(message, Mapping) else message
        text = "".join(m.get("content") or "" for m in messages)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


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
    rendered: dict[str, str] = field(default_factory=dict, compare=False, repr=False)
    """The reference conversation's rendering, made once."""

    def _render(self, messages: list[Message], next_turn: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                                  add_generation_prompt=next_turn, **self.kwargs)

    def text(self, message: Message | Sequence[Message], ended_with: str | None) -> str:
        """The observation's text after a turn (one message, or several in a row); ended_with: the
        text of the special token the turn ended on (its end-of-turn or end-of-sequence token),
        None when it ended otherwise."""
        from novarl.errors import UserError

        messages = [dict(message)] if isinstance(message, Mapping) else [dict(m) for m in message]
        reference: list[Message] = [{"role": "user", "content": "."}, {"role": "assistant", "content": TURN_MARK}]
        try:
            if "before" not in self.rendered:
                self.rendered["before"] = self._render(reference, False)
            before, after = self.rendered["before"], self._render([*reference, *messages], True)
        except Exception as err:  # jinja2's errors, and those a template raises itself
            roles = ", ".join(repr(m.get("role")) for m in messages)
            raise UserError(f"the chat template cannot render a message of role {roles} after the "
                            f"model's turn ({type(err).__name__}: {err})") from None
        if not after.startswith(before) or TURN_MARK not in before:
            raise UserError("the chat template renders a conversation differently once a message follows it, so an "
                            "observation cannot be appended to the tokens sampled so far")
        closing = before[before.rindex(TURN_MARK) + len(TURN_MARK):]
        if ended_with and closing.startswith(ended_with):  # the sampled turn holds the template's end marker
            closing = closing[len(ended_with):]
        return closing + after[len(before):]

    def __call__(self, message: Message | Sequence[Message], turn: Sequence[int]) -> list[int]:
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
    last_tokens: list[int] = field(default_factory=list)
    """The last turn's sampled tokens."""
    done: bool = False
    failed: str | None = None
    last_turn: tuple[int, int] = (0, 0)
    """[start, end) of the last turn's sampled tokens in `tokens`."""
    flagged: list[tuple[int, int, str]] = field(default_factory=list)
    """Turns found wrong: their spans in `tokens` and what (Completion.flagged)."""

    def request(self) -> Prompt:
        """The next turn's prompt: the episode's tokens so far."""
        return dataclasses.replace(self.prompt, token_ids=[*self.prompt.token_ids, *self.tokens])

    def took(self, completion: Completion) -> None:
        self.last_turn = (len(self.tokens), len(self.tokens) + len(completion.token_ids))
        if malformed_thinking(completion.text):
            self.flagged.append((*self.last_turn, "malformed_thinking"))
        self.tokens += completion.token_ids
        self.logprobs += completion.logprobs
        self.turns += 1
        self.finish_reason = completion.finish_reason
        if self.turns == 1:  # its age: its first turn's weights (later turns' may be newer)
            self.policy_version = completion.policy_version
        self.last_text, self.last_tokens = completion.text, list(completion.token_ids)
        self.conversation.append({"role": "assistant", "content": completion.text})

    def answered(self, step: EnvStep, observation: list[int] | None) -> None:
        self.flagged += [(*self.last_turn, flag) for flag in sorted(step.flags)]
        self.reward += step.reward
        self.metadata = step.metadata or self.metadata
        if observation is None:
            self.done = True
            return
        assert step.observation is not None
        self.observe(observation, [step.observation])

    def observe(self, tokens: list[int], messages: Sequence[Message]) -> None:
        """Append an observation: its tokens (no loss) and its messages."""
        self.observed.append((len(self.tokens), len(self.tokens) + len(tokens)))
        self.tokens += tokens
        self.logprobs += [0.0] * len(tokens)
        self.conversation.extend(messages)

    def completion(self) -> Completion:
        return Completion(prompt=self.prompt, token_ids=self.tokens, logprobs=self.logprobs, text=self.last_text,
                          finish_reason="length" if self.finish_reason == "length" else "stop",
                          policy_version=self.policy_version, observed=tuple(self.observed), turns=self.turns,
                          failed=self.failed, flagged=tuple(self.flagged))


THINKING_TAGS = ("<think>", "</think>")


def malformed_thinking(text: str) -> bool:
    """A turn's <think> tags out of order (NeMo RL's malformed thinking, read from novarl's turn text,
    which holds the thinking and the answer): either tag more than once, or the closing one before the
    opening one. A turn that opens none (its template opened it) may close it once; one cut by the
    length limit may leave it open."""
    opening, closing = (text.count(tag) for tag in THINKING_TAGS)
    if opening > 1 or closing > 1:
        return True
    return opening == closing == 1 and text.index("</think>") < text.index("<think>")


def first_metadata(prompt: Prompt) -> dict[str, Any]:
    """What an environment's first step reads as metadata: the data row's fields, and its answer
    under "answer" (when the row has one)."""
    return {**prompt.columns, **({"answer": prompt.answer} if prompt.answer is not None else {})}


@dataclass
class Stopwatch:
    """Seconds summed over calls made on any thread (the environment's steps)."""

    seconds: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, seconds: float) -> None:
        with self.lock:
            self.seconds += seconds

    def take(self) -> float:
        """The seconds since the last take."""
        with self.lock:
            seconds, self.seconds = self.seconds, 0.0
        return seconds


def continuous_engine(generator: GenerationBackend) -> ContinuousEngine | None:
    """The generator's engines as one that takes requests while it generates (vLLM's, in this
    process or on Ray actors: backends/generation/streams.py), None where they take whole
    submissions only."""
    return generator.continuous() if isinstance(generator, StreamsRequests) else None


class PlaysEpisodes(Protocol):
    """How a run plays its episodes: an environment's (Episodes) or an agent's (agents.AgentEpisodes)."""

    @property
    def max_failed_fraction(self) -> float:
        """env.<name>.max_failed_fraction."""
        ...

    def play(self, generator: GenerationBackend, prompts: Sequence[Prompt], sampling: SamplingConfig
             ) -> tuple[list[Completion], list[float]]:
        """(each prompt's episode as one Completion, its reward), in order."""
        ...

    def take_metrics(self) -> dict[str, float]:
        """Counts since the last call (tool calls, the agents' requests, ...)."""
        ...


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
    workers: int = 1
    """env.<name>.num_workers: how many of the environment's steps run at once (threads)."""
    per_sample: bool = False
    """policy.generation.vllm_cfg.async_engine: each episode's turns on its own (play_each) where the
    engines take requests while they generate (vLLM's, wherever they run); turns in lockstep otherwise."""
    clock: Stopwatch = field(default_factory=Stopwatch, compare=False)
    """The environment's steps' seconds."""

    def continuous(self, generator: GenerationBackend) -> ContinuousEngine | None:
        """The engine that plays each episode on its own, None when the turns run in lockstep."""
        return continuous_engine(generator) if self.per_sample else None

    def play(self, generator: GenerationBackend, prompts: Sequence[Prompt], sampling: SamplingConfig
             ) -> tuple[list[Completion], list[float]]:
        engine = self.continuous(generator)
        if engine is not None:
            completions, rewards = play_each(engine, prompts, sampling, self.environment, self.observation_tokens,
                                             max_turns=self.max_turns, max_tokens=self.max_tokens,
                                             workers=self.workers, clock=self.clock)
        else:
            completions, rewards = play(generator, prompts, sampling, self.environment, self.observation_tokens,
                                        max_turns=self.max_turns, max_tokens=self.max_tokens, workers=self.workers,
                                        clock=self.clock)
        if isinstance(self.environment, RoutedEnvironments):  # the reward domains' answers scored
            rewards = self.environment.finish(completions, rewards)
        return completions, rewards

    def take_metrics(self) -> dict[str, float]:
        """Since the last call: the seconds the environment's steps took (summed over the episodes,
        environment_seconds), and its own counts (an environment with `take_metrics`: the tools'
        calls, errors and timeouts)."""
        take = getattr(self.environment, "take_metrics", None)
        return {"environment_seconds": self.clock.take(), **(dict(take()) if callable(take) else {})}


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


def turn_seed(sampling: SamplingConfig, episode: int, turn: int) -> int | None:
    """The random seed of an episode's turn: from the step's seed, the turn (turn t samples with
    seed + t x TURN_SEED_STRIDE) and the episode's position in the step, so the same whether
    the turns run in lockstep or each as its episode is ready, and whichever batch it joins."""
    from novarl.backends.generation.hf import sample_seed

    if sampling.seed is None:
        return None
    return sample_seed(sampling.seed + turn * TURN_SEED_STRIDE, sampling.seed_offset + episode)


def with_turn_seeds(sampling: SamplingConfig, episodes: Sequence[int], turns: Sequence[int]) -> SamplingConfig:
    """`sampling` for a submission of these episodes' turns (each prompt's own seed)."""
    if sampling.seed is None:
        return sampling
    return dataclasses.replace(sampling, seeds=tuple(turn_seed(sampling, e, t) for e, t in zip(episodes, turns)))


class Turns:
    """The bookkeeping shared by both ways of playing: the episodes, their sampling (the
    environment's stop strings added), and what follows a turn once the environment answered."""

    def __init__(self, prompts: Sequence[Prompt], sampling: SamplingConfig, environment: Environment,
                 observation_tokens: ObservationTokens, max_turns: int, max_tokens: int | None,
                 clock: Stopwatch | None = None) -> None:
        self.episodes = [Episode(p, [{"role": "user", "content": p.text}], first_metadata(p)) for p in prompts]
        own = tuple(getattr(environment, "stop_strings", ()) or ())  # the environment's turns end on these too
        self.sampling = dataclasses.replace(sampling, stop_strings=tuple(dict.fromkeys((*sampling.stop_strings,
                                                                                        *own))))
        self.environment, self.observation_tokens = environment, observation_tokens
        self.max_turns, self.max_tokens = max_turns, max_tokens
        self.clock = clock or Stopwatch()

    def answer(self, index: int) -> EnvStep | str:
        """The environment's answer to episode `index`'s last turn (safe to call from a worker thread)."""
        episode = self.episodes[index]
        start = time.perf_counter()
        try:
            return answer_of(self.environment, episode, episode.turns - 1)
        finally:
            self.clock.add(time.perf_counter() - start)

    def answered(self, index: int, step: EnvStep | str) -> bool:
        """Take the environment's answer to the episode's last turn: its observation's tokens are
        appended, unless the episode ends here. Whether it goes on."""
        episode = self.episodes[index]
        if isinstance(step, str):  # it failed: the episode ends here, without loss
            episode.failed, episode.done = step, True
            return False
        last = step.done or step.observation is None or episode.turns >= self.max_turns
        observation = None if last else self.observation_tokens(step.observation, episode.last_tokens)
        if observation is not None and self.max_tokens is not None and \
                len(episode.prompt.token_ids) + len(episode.tokens) + len(observation) >= self.max_tokens:
            observation = None  # no room for another turn
        episode.answered(step, observation)
        return not episode.done

    def request(self, index: int) -> tuple[Prompt, SamplingConfig]:
        """Episode `index`'s next turn: its tokens so far, and the turn's sampling (its own seed)."""
        episode = self.episodes[index]
        return episode.request(), with_turn_seeds(self.sampling, [index], [episode.turns])

    def results(self) -> tuple[list[Completion], list[float]]:
        return [e.completion() for e in self.episodes], [e.reward for e in self.episodes]


def play(generator: GenerationBackend, prompts: Sequence[Prompt], sampling: SamplingConfig,
         environment: Environment, observation_tokens: ObservationTokens, *, max_turns: int,
         max_tokens: int | None = None, workers: int = 1, clock: Stopwatch | None = None
         ) -> tuple[list[Completion], list[float]]:
    """Play one episode per prompt for at most max_turns turns (and, with max_tokens, until an
    episode's prompt and tokens would pass it), the turns in lockstep: every active episode's
    turn t in one submission, then the environment's answers (`workers` at once), then turn t + 1.
    (its Completion, its reward) per prompt, in order. A turn cut by max_new_tokens still goes to
    the environment, which decides whether the episode goes on."""
    from concurrent.futures import ThreadPoolExecutor

    turns = Turns(prompts, sampling, environment, observation_tokens, max_turns, max_tokens, clock)
    active = list(range(len(prompts)))
    with ThreadPoolExecutor(workers, thread_name_prefix="novarl-env") as pool:
        for turn in range(max_turns):
            if not active:
                break
            submitted = with_turn_seeds(turns.sampling, active, [turn] * len(active))
            completions = generator.submit([turns.episodes[i].request() for i in active], submitted).result()
            for i, completion in zip(active, completions):
                turns.episodes[i].took(completion)
            steps = list(pool.map(turns.answer, active))
            active = [i for i, step in zip(active, steps) if turns.answered(i, step)]
    return turns.results()


def play_each(engine: ContinuousEngine, prompts: Sequence[Prompt], sampling: SamplingConfig,
              environment: Environment, observation_tokens: ObservationTokens, *, max_turns: int,
              max_tokens: int | None = None, workers: int = 1, clock: Stopwatch | None = None
              ) -> tuple[list[Completion], list[float]]:
    """`play`, each episode on its own: a finished turn goes to the environment (`workers` answer
    at once) while the engine generates the others' turns, and its next turn joins the engine's
    running batch as soon as the answer comes -- no episode waits for another's turn. The same
    episodes as `play` for the same seed (each turn's seed is its episode's: turn_seed), up to
    the engine's numerics in batches of other shapes."""
    from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

    turns = Turns(prompts, sampling, environment, observation_tokens, max_turns, max_tokens, clock)
    for i in range(len(prompts)):
        engine.add(i, *turns.request(i))
    answering: dict[Any, int] = {}
    with ThreadPoolExecutor(workers, thread_name_prefix="novarl-env") as pool:
        while engine.unfinished() or answering:
            if engine.unfinished():
                for i, completion in engine.step():
                    turns.episodes[i].took(completion)
                    answering[pool.submit(turns.answer, i)] = i
                answered = [f for f in answering if f.done()]
            else:  # every episode waits for its environment
                answered = list(wait(answering, return_when=FIRST_COMPLETED).done)
            for future in answered:
                i = answering.pop(future)
                if turns.answered(i, future.result()):
                    engine.add(i, *turns.request(i))
    return turns.results()
