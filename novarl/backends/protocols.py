"""The interfaces between the driver and the roles, declared.

The driver (trainer/) uses these types, never `object` and `hasattr`; each
backend module implements them, and `backends/registry.py` maps a backend name
to its implementation. Optional abilities are protocols of their own
(`Offloadable`), checked with isinstance.

Two levels on the generation side:
- an `Engine` lives in one process (a policy rank's, an actor's of its own, or
  the driver's in a one-rank run) and generates a share of the prompts;
- a `GenerationBackend` is what the driver holds: all the engines of a run,
  wherever they are, behind `submit` (a step's prompts in, a future of their
  completions out) and `sync_weights`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from novarl.algorithms.losses import LossFn
from novarl.distributed.lifecycle import Offloadable, Parkable, Stoppable  # noqa: F401 (re-exported)
from novarl.models.scores import Head
from novarl.types import Completion, Prompt, SamplingConfig, TrainBatch

if TYPE_CHECKING:
    from novarl.config.schema import NovaRLConfig

Bucket = list[tuple[str, torch.Tensor]]
"""Full tensors under their Hugging Face names, of one dtype, at most a bucket's bytes."""


class ReferenceBackend(Protocol):
    """A model that scores tokens: the frozen reference policy (and every trainable role)."""

    def forward(self, batch: TrainBatch, head: Head) -> torch.Tensor:
        """Collective over the role's ranks: [N] float32 per-token scores under the head
        (models/scores.py: Logprobs(temperature) for a policy, Values() for a critic), 0 at each
        sequence's first token. A head the model cannot apply is refused (TypeError)."""
        ...


class TrainingBackend(ReferenceBackend, Protocol):
    """A trainable role (dtensor | deepspeed | megatron: the policy, or PPO's critic), in this
    process or on Ray ranks."""

    def forward_backward(self, batch: TrainBatch, loss: LossFn, head: Head) -> dict[str, float]:
        """Collective: accumulate the gradients of loss(the head's scores [n], micro-batch) over the
        batch; metrics summed over micro-batches and ranks (tokens_computed among them)."""
        ...

    def optim_step(self) -> dict[str, float]:
        """Clip, step the optimizer and the schedule, zero the gradients."""
        ...

    def gpu_stats(self) -> dict[str, float]:
        """Collective over the training ranks: GPU memory (GB: allocated, peak since the last
        call, reserved) and utilisation (%), the maximum over the ranks; {} without CUDA."""
        ...

    def save(self, path: Path) -> None: ...

    def load(self, path: Path) -> None: ...

    def save_hf(self, path: Path, tokenizer, fmt=None) -> None:
        """A Hugging Face folder of the full weights; `fmt` an ExportFormat (models/loading.py),
        None: fp32 safetensors."""


class WeightSender(Protocol):
    """The training side of the weight sync, on every training rank."""

    def weight_buckets(self, bucket_bytes: int, *, everywhere: bool, dtype: torch.dtype | None = None
                       ) -> Iterator[Bucket]:
        """Collective over the training ranks: the full weights bucket by bucket, gathered from
        the shards as each bucket's turn comes; on every rank (everywhere: each feeds its own
        engine) or on rank 0 alone (which sends them to dedicated engines). With LoRA: the
        merged weights, or the adapters alone under the training model's names
        (`...q_proj.lora_A.default.weight`) when policy.generation.lora_sync is 'adapter'."""
        ...


class WeightReceiver(Protocol):
    """The engine side of the weight sync."""

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load full tensors (Hugging Face names) as they come -- `weights` may be a stream that
        receives them bucket by bucket -- then serve `version`. An engine built for adapters
        (lora_sync 'adapter') takes the adapters alone and applies them over its base weights."""
        ...


class Engine(WeightReceiver, Protocol):
    """One generation engine (hf | vllm), in the process it runs in."""

    @staticmethod
    def engine_kwargs(cfg: NovaRLConfig, *, model_path: str, tokenizer, precision: str) -> dict:
        """The constructor's arguments for a run's config (the engine is built where it runs: in
        the driver, a policy rank or an actor of its own)."""
        ...

    def generate(self, prompts: Sequence[Prompt], sampling: SamplingConfig) -> list[Completion]:
        """One completion per prompt, in order (a GRPO group is the same prompt repeated)."""
        ...


@runtime_checkable
class ContinuousEngine(Protocol):
    """An engine that takes requests while it generates (continuous batching: vLLM's), so that an
    episode's next turn joins the running batch as soon as its environment answers, rather than
    waiting for every episode's turn to end (rollout/episodes.py play_each)."""

    def add(self, key: int, prompt: Prompt, sampling: SamplingConfig) -> None:
        """Start one completion of `prompt` (its seed: sampling.seeds[0] when given)."""
        ...

    def step(self) -> list[tuple[int, Completion]]:
        """Generate a little (one scheduling step): the completions finished, under their keys."""
        ...

    def unfinished(self) -> int:
        """How many added completions step has not returned yet."""
        ...


@runtime_checkable
class StreamsRequests(Protocol):
    """A GenerationBackend whose engines may take an episode's turns one by one (rollout/episodes.py
    play_each)."""

    def continuous(self) -> ContinuousEngine | None:
        """Its engines as one ContinuousEngine (a new one per caller), None where they generate
        only whole submissions."""
        ...


class Rollout(Protocol):
    """A step's completions on their way: the future `GenerationBackend.submit` returns."""

    def done(self) -> bool: ...

    def result(self) -> list[Completion]:
        """The completions in the order of the submitted prompts; waits for the engines."""
        ...


class GenerationBackend(Protocol):
    """All the engines of a run, as the driver holds them."""

    def submit(self, prompts: Sequence[Prompt], sampling: SamplingConfig) -> Rollout:
        """Start generating (shared among the engines, a group whole on one engine); returns at once
        where the engines run in other processes."""
        ...

    def sync_weights(self, version: int) -> dict[str, float]:
        """The policy's current weights into every engine; metrics (weight_sync_mb)."""
        ...

    def describe(self) -> str:
        """One line for the start-up log: how many engines, where, how big."""
        ...

    def shutdown(self) -> None: ...


@runtime_checkable
class QueuedWeights(Protocol):
    """What asynchronous GRPO needs of the engines: weights taken in order behind the rounds
    submitted before them, the trainer not waiting for those rounds."""

    def queue_weights(self, version: int) -> dict[str, float]:
        """The policy's current weights, to be taken after the rounds submitted so far and before any
        submitted later; returns once the trainer may go on (metrics: weight_sync_mb)."""
        ...

    def weights_taken(self) -> None:
        """Until the engines have taken the weights queued last (raising what they raised)."""
        ...

