"""Data passed between roles (driver, generator, trainer, reward).

A training batch is token-level: its S sequences are laid end to end, N tokens
in all, and every per-token tensor has shape [N]. Sequence s is tokens
`cu_seqlens[s]:cu_seqlens[s+1]`. Token-aligned tensors are indexed by token:
`logprobs[i] = log p(input_ids[i] | the tokens before i in its sequence)`, and
the first token of each sequence (which has no prediction) holds 0. How the
sequences are laid out for a forward (packed by token budget, padded in rows of
similar length, or padded in fixed rows) is the training backend's business
(backends/training/batching.py); losses see per-token tensors only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch


@dataclass(frozen=True)
class Prompt:
    text: str
    """The prompt as the model sees it (template already applied)."""
    token_ids: list[int]
    """[P] prompt tokens, BOS included if the tokenizer adds one."""
    answer: str | None = None
    """Reference answer the reward function compares against, if any."""
    index: int = -1
    """Position of the example in its dataset (for logs and resume)."""
    columns: Mapping[str, Any] = field(default_factory=dict, compare=False)
    """The data row's other fields, offered to the reward function by name."""
    source: Any = field(default=None, compare=False)
    """The example's own prompt (its text or chat messages), before the prompt file and the chat
    template: what an agent is given (rollout/agents.py)."""


@dataclass(frozen=True)
class Completion:
    prompt: Prompt
    token_ids: list[int]
    """[C] generated tokens, the stop token included when there is one."""
    logprobs: list[float]
    """[C] generator's log-probability of each generated token at the sampling temperature."""
    text: str
    """Decoded completion, special tokens removed."""
    finish_reason: Literal["stop", "length"]
    """'stop': ended with EOS or a stop string; 'length': hit max_new_tokens."""
    policy_version: int
    """Training step whose weights generated it (0: the initial model)."""
    observed: tuple[tuple[int, int], ...] = ()
    """A multi-turn episode's: the spans [start, end) of token_ids that its environment put between
    the turns (observations, tool results, rendered once, never re-tokenised): not sampled, so they
    get no loss, and their logprobs are 0. Empty for one turn."""
    turns: int = 1
    """How many times the engine generated for it (novarl/rollout/episodes.py)."""
    flagged: tuple[tuple[int, int, str], ...] = ()
    """An episode's turns found wrong: (start, end) of their tokens in token_ids and what was wrong
    ("invalid_tool_call": EnvStep.flags; "malformed_thinking": rollout/episodes.py malformed_thinking)."""
    failed: str | None = None
    """Why its episode failed (its environment raised, or answered with something else than an
    EnvStep): it gets no loss, and its group's advantages are computed without it."""
    segments: tuple["Completion", ...] = ()
    """An agent's episode whose history the agent rewrote (rollout/endpoint.py): its earlier
    segments, in order -- each with its own prompt (the rendering the agent's request made) and the
    tokens sampled after it; this completion is the last. Each is trained as a sequence of its own
    with the episode's advantage (rollout/batch.py with_segments)."""


@dataclass(frozen=True)
class SamplingConfig:
    max_new_tokens: int
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    """A completion ends with the token that completes the first of these in its text (kept: the
    text and the tokens include it)."""
    seed: int | None = None
    """The step's seed; None: unseeded."""
    seed_offset: int = 0
    """Position in the step of the first prompt given to an engine: each sample's random
    stream is seeded by (seed, its position), so a step samples the same whatever the
    number of engines and how the prompts are shared among them."""
    seeds: tuple[int, ...] | None = None
    """Each prompt's own random seed, in order, instead of (seed, its position): an episode's turn
    samples from (the step's seed, the turn, the episode) wherever and with whichever others it
    runs (rollout/episodes.py turn_seed)."""


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without the host waiting for the device: on CUDA through pinned memory
    and a non-blocking copy (a blocking copy, or one from pageable memory, can wait for every kernel
    queued before it, and the GPU then idles while the host queues the next ones); elsewhere `.to`."""
    if on_device(tensor, device):
        return tensor
    if device.type == "cuda" and tensor.device.type == "cpu":
        return pinned(tensor).to(device, non_blocking=True)
    return tensor.to(device)


def pinned(tensor: torch.Tensor) -> torch.Tensor:
    """A host tensor's copy in pinned memory, dense: torch pins a copy with the source's strides, which for an
    expanded tensor (a stride of 0: lay_out's positions) overlaps itself, and the copy into it raises."""
    return tensor.contiguous().pin_memory()


def on_device(tensor: torch.Tensor, device: torch.device) -> bool:
    """Whether `tensor` is on `device`, a CUDA device given without an index being the current one (a tensor's
    device always has one: torch.device("cuda") != torch.device("cuda", 0))."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return tensor.device == device


@dataclass
class TrainBatch:
    """One step's samples, token-level: S sequences of N tokens in all, end to end."""

    input_ids: torch.Tensor
    """[N] int64 prompt + completion tokens of every sequence, one after the other."""
    cu_seqlens: torch.Tensor
    """[S + 1] int64 sequence boundaries: sequence s is tokens cu_seqlens[s]:cu_seqlens[s + 1]."""
    position_ids: torch.Tensor
    """[N] int64 each token's position in its own sequence (0 at every sequence's first token)."""
    loss_mask: torch.Tensor
    """[N] bool, True on generated tokens that are trained on."""
    advantages: torch.Tensor
    """[N] float32 per-token advantages (a per-sequence advantage is repeated over its tokens)."""
    generator_logprobs: torch.Tensor
    """[N] float32, the generator's logprobs on generated tokens, 0 elsewhere."""
    old_logprobs: torch.Tensor | None = None
    """[N] float32, the policy's logprobs before this step's update; None: take them from the
    training forward itself, detached (the policy has not changed since generation)."""
    reference_logprobs: torch.Tensor | None = None
    """[N] float32, the frozen reference policy's logprobs (KL penalty), or None."""
    prompt_lengths: torch.Tensor | None = None
    """[S] int64 tokens of each sequence's prompt (None: not known)."""
    group_ids: torch.Tensor | None = None
    """[S] int64: sequences with the same id share their first prompt_lengths tokens (a GRPO
    group's samples), so a packed row may compute that prompt once (None: not known)."""
    global_valid_tokens: int = 0
    """Loss-mask tokens in the whole step (all micro-batches, all ranks): the loss divides by it."""
    global_valid_sequences: int = 0
    """Sequences with at least one loss token in the whole step."""
    positive: torch.Tensor | None = None
    """[S] bool: the samples VAPO's NLL term trains on (reward > 0; loss_fn.positive_example_nll_weight),
    or None (no such term)."""
    global_positive_tokens: int = 0
    """Loss-mask tokens of the `positive` sequences in the whole step: the NLL term divides by it."""
    returns: torch.Tensor | None = None
    """[N] float32 PPO's GAE returns, the critic's regression targets (None: no critic)."""
    old_values: torch.Tensor | None = None
    """[N] float32 the critic's values before this step's update, which its clipped loss holds it near."""
    host: TrainBatch | None = field(default=None, repr=False, compare=False)
    """On a device: the CPU batch it was moved from, whose sequence layout (input_ids, cu_seqlens,
    position_ids, prompt_lengths, group_ids: fixed once a batch is made) micro-batching and
    layouts read without waiting for the device."""

    def __len__(self) -> int:
        """S, the number of sequences."""
        return int(self.cu_seqlens.numel()) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def lengths(self) -> torch.Tensor:
        """[S] int64 tokens of each sequence."""
        return self.cu_seqlens.diff()

    @property
    def sequence_index(self) -> torch.Tensor:
        """[N] int64 the sequence each token belongs to."""
        # output_size: the token count is known (input_ids' shape), so a device batch's copy never waits
        # for the device to add up the lengths (a host synchronisation in each micro-batch's loss)
        return torch.repeat_interleave(torch.arange(len(self), device=self.cu_seqlens.device), self.lengths,
                                       output_size=self.num_tokens)

    def sequence_sum(self, values: torch.Tensor) -> torch.Tensor:
        """[S] the sum of per-token `values` [N] over each sequence's tokens."""
        out = torch.zeros(len(self), dtype=values.dtype, device=values.device)
        return out.index_add(0, self.sequence_index.to(values.device), values)

    def token_index(self, sequences: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """[n] int64 positions in this batch of the tokens of `sequences`, in that order."""
        sequences = torch.as_tensor(sequences, dtype=torch.long)
        if sequences.numel() == 0:
            return torch.zeros(0, dtype=torch.long)
        cu = self.cu_seqlens.cpu()
        starts, lengths = cu[sequences], cu[sequences + 1] - cu[sequences]
        offsets = torch.repeat_interleave(starts - torch.cumsum(lengths, 0) + lengths, lengths)
        return offsets + torch.arange(int(lengths.sum()))

    def select(self, sequences: Sequence[int] | torch.Tensor) -> "TrainBatch":
        """The batch of `sequences` (indices, in that order), the global counts kept: a
        micro-batch, or a data-parallel rank's share."""
        sequences = torch.as_tensor(sequences, dtype=torch.long)
        if self.host is not None:  # the layout from the host copy: no wait for the device
            host = self.host.select(sequences)
            index = to_device(self.host.token_index(sequences), self.input_ids.device)
            lengths = host.lengths
        else:
            host = None
            index = to_device(self.token_index(sequences), self.input_ids.device)
            lengths = self.lengths.cpu()[sequences]
        cu = to_device(torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)), self.cu_seqlens.device)

        def cut(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[index]

        def per_sequence(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[to_device(sequences, t.device)]

        return TrainBatch(
            input_ids=self.input_ids[index], cu_seqlens=cu, position_ids=self.position_ids[index],
            loss_mask=self.loss_mask[index], advantages=self.advantages[index],
            generator_logprobs=self.generator_logprobs[index], old_logprobs=cut(self.old_logprobs),
            reference_logprobs=cut(self.reference_logprobs), prompt_lengths=per_sequence(self.prompt_lengths),
            group_ids=per_sequence(self.group_ids), global_valid_tokens=self.global_valid_tokens,
            global_valid_sequences=self.global_valid_sequences, positive=per_sequence(self.positive),
            global_positive_tokens=self.global_positive_tokens,
            returns=cut(self.returns), old_values=cut(self.old_values), host=host,
        )

    def slice(self, start: int, stop: int) -> "TrainBatch":
        """Sequences [start, stop), the global counts kept."""
        return self.select(range(start, min(stop, len(self))))

    def to(self, device: torch.device) -> "TrainBatch":
        if on_device(self.input_ids, device):  # (moved again it would lose its host copy)
            return self
        moved = {k: to_device(v, device) if isinstance(v, torch.Tensor) else v for k, v in vars(self).items()}
        moved["host"] = self if self.input_ids.device.type == "cpu" else None
        return TrainBatch(**moved)

    @classmethod
    def from_rows(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor,
                  advantages: torch.Tensor, generator_logprobs: torch.Tensor | None = None) -> "TrainBatch":
        """From right-padded rows: input_ids, attention_mask, loss_mask [S, L]; advantages [S]
        (per sequence) or [S, L]; generator_logprobs [S, L] or None (zeros). Global counts are
        this batch's own."""
        keep = attention_mask.bool()
        lengths = keep.sum(1)
        if not bool((keep == (torch.arange(keep.shape[1]) < lengths[:, None])).all()):
            raise ValueError("rows must be right-padded: attention_mask True on a prefix of each row")
        if advantages.dim() == 1:
            advantages = advantages[:, None].expand_as(input_ids)
        if generator_logprobs is None:
            generator_logprobs = torch.zeros(input_ids.shape, dtype=torch.float32)
        positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
        batch = cls(input_ids=input_ids[keep].long(),
                    cu_seqlens=torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)),
                    position_ids=positions[keep], loss_mask=loss_mask.bool()[keep],
                    advantages=advantages[keep].float(), generator_logprobs=generator_logprobs[keep].float())
        return batch.with_own_counts()

    def to_rows(self, values: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """[S, max length] right-padded rows of per-token `values` [N] (for reading and tests)."""
        rows = torch.full((len(self), int(self.lengths.max()) if len(self) else 0), fill, dtype=values.dtype)
        rows[self.sequence_index.cpu(), self.position_ids.cpu()] = values.cpu()
        return rows

    def with_own_counts(self) -> "TrainBatch":
        """Set the token/sequence counts the loss divides by to this batch's own totals."""
        self.global_valid_tokens = int(self.loss_mask.sum())
        per_sequence = self.sequence_sum(self.loss_mask.long())
        self.global_valid_sequences = int((per_sequence > 0).sum())
        if self.positive is not None:
            self.global_positive_tokens = int(per_sequence[self.positive.to(per_sequence.device)].sum())
        return self

    def positive_mask(self) -> torch.Tensor:
        """[N] bool: the loss tokens of the `positive` sequences (all False without them)."""
        if self.positive is None:
            return torch.zeros_like(self.loss_mask)
        return self.loss_mask & self.positive.to(self.loss_mask.device)[self.sequence_index.to(self.loss_mask.device)]
