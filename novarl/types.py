"""Data passed between roles (driver, generator, trainer, reward).

Shapes use B = sequences in the batch and L = padded sequence length.
Token-aligned tensors are indexed by position: entry t belongs to token t of
the sequence, so `logprobs[b, t] = log p(input_ids[b, t] | input_ids[b, :t])`
and position 0 (which has no prediction) holds 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

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


@dataclass(frozen=True)
class SamplingConfig:
    max_new_tokens: int
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    """The step's seed; None: unseeded."""
    seed_offset: int = 0
    """Position in the step of the first prompt given to an engine: each sample's random
    stream is seeded by (seed, its position), so a step samples the same whatever the
    number of engines and how the prompts are shared among them."""


@dataclass
class TrainBatch:
    """One GRPO step's samples, padded on the right to a common length."""

    input_ids: torch.Tensor
    """[B, L] int64 prompt + completion tokens, right-padded with pad_token_id."""
    attention_mask: torch.Tensor
    """[B, L] bool, True on real (prompt or completion) tokens."""
    loss_mask: torch.Tensor
    """[B, L] bool, True on generated tokens that are trained on."""
    advantages: torch.Tensor
    """[B] float32, one advantage per sequence, broadcast over its tokens."""
    generator_logprobs: torch.Tensor
    """[B, L] float32, the generator's logprobs on generated tokens, 0 elsewhere."""
    old_logprobs: torch.Tensor | None = None
    """[B, L] float32, the policy's logprobs before this step's update."""
    reference_logprobs: torch.Tensor | None = None
    """[B, L] float32, the frozen reference policy's logprobs (KL penalty), or None."""
    global_valid_tokens: int = 0
    """Loss-mask tokens in the whole step (all micro-batches, all ranks): the loss divides by it."""
    global_valid_sequences: int = 0
    """Sequences with at least one loss token in the whole step."""
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def slice(self, start: int, stop: int) -> "TrainBatch":
        """Rows [start, stop) with the global counts kept, for micro-batching."""

        def cut(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[start:stop]

        return TrainBatch(
            input_ids=self.input_ids[start:stop],
            attention_mask=self.attention_mask[start:stop],
            loss_mask=self.loss_mask[start:stop],
            advantages=self.advantages[start:stop],
            generator_logprobs=self.generator_logprobs[start:stop],
            old_logprobs=cut(self.old_logprobs),
            reference_logprobs=cut(self.reference_logprobs),
            global_valid_tokens=self.global_valid_tokens,
            global_valid_sequences=self.global_valid_sequences,
            extras={k: v[start:stop] for k, v in self.extras.items()},
        )
