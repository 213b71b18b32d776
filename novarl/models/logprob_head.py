"""The output head that computes the chosen tokens' logprobs without the full logits.

A training forward needs one number per token, log p(token | prefix), but a Hugging Face
causal LM returns logits for every position and every vocabulary entry: for a micro-batch
of 8,192 tokens of a 151,936-entry vocabulary that is 2.5 GB in bf16, 5 GB more in float32
for the softmax, and as much again for their gradient. `PickingHead` is the model's
`lm_head` (a plain `nn.Linear`, same weight, same names in the state dict) that, while a
`picking` request is set, takes the rows of the final hidden states whose next token is
scored and returns their logprobs [n] instead of logits: `chunked_logprobs` computes the
logits chunk by chunk of rows (at most CHUNK_BYTES of float32 logits at a time) and keeps
only each row's logsumexp, and the logits in the weight's dtype where they are small enough
(SAVE_LOGITS_BYTES) for the backward, which otherwise recomputes each chunk's. No float32
copy of the logits is kept, nor their gradient.

It runs inside the model's forward, where FSDP2 has the head's weight gathered and DeepSpeed
ZeRO-3 has it in place, so their hooks see an ordinary forward and backward. Without a
request the head is the plain linear layer (generation, the critic's head). Installed for
architectures whose logits are the head's output as is (architectures.plain_head: no final soft-capping)
and where the weight is a whole tensor on each rank, or split over the vocabulary by novarl's own
tensor-parallel plan (models/vocab_parallel.py: each tensor-parallel rank scores its rows and the
ranks combine each row's logsumexp); under the DTensor backend's context parallelism each rank picks
its own positions' following tokens. Not where a custom plan splits the head (its weight a DTensor).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from novarl.models.architectures import HEAD_CHUNK_BYTES, HEAD_SAVE_LOGITS_BYTES, plain_head
from novarl.models.scores import scaled_logits
from novarl.models.vocab_parallel import VocabParallel, gather_columns, sum_gradient_over

CHUNK_BYTES = HEAD_CHUNK_BYTES
"""The float32 logits computed at once (architectures.py: the planner reads it there)."""


def chunk_rows(vocab_size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Rows of float32 logits over the vocabulary that fit in chunk_bytes (at least 1)."""
    return max(1, chunk_bytes // (4 * vocab_size))


SAVE_LOGITS_BYTES = HEAD_SAVE_LOGITS_BYTES
"""A call's logits (in the weight's dtype) are kept for the backward when they take at most this
(architectures.py); the backward then reads them instead of recomputing each chunk's matmul."""


class ChunkedLogprobs(torch.autograd.Function):
    """hidden [n, H], weight [V, H], targets [n] -> [n] float32 log softmax(hidden @ weight.T / T)[target].

    vocab (group, first): the vocabulary is split over the group's ranks (Megatron's vocabulary-parallel
    output layer) and weight holds its rows first .. first + V - 1 (none where this rank's part is all
    padding). Each rank's rows give its part of every row's logsumexp and the targets it holds, combined
    over the group: every rank returns the same logprobs. The gradient in hidden is this rank's part (the
    caller's tensor-parallel region sums it over the group, as megatron-core's output layer's does)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                rows: int, fused: bool, vocab: tuple[dist.ProcessGroup, int] | None = None) -> torch.Tensor:
        steps = _fused() if fused else (_chunk_forward, _chunk_grad_logits)
        keep = any(ctx.needs_input_grad[:2]) and len(hidden) * len(weight) * weight.element_size() <= SAVE_LOGITS_BYTES
        held = None
        if vocab is not None:  # the targets in this rank's rows, as its row numbers
            targets = targets - vocab[1]
            held = (targets >= 0) & (targets < len(weight))
            targets = targets.clamp(0, max(len(weight) - 1, 0))
        picked = torch.zeros(len(hidden), dtype=torch.float32, device=hidden.device)
        lse = torch.full_like(picked, float("-inf"))
        kept = []
        for start in range(0, len(hidden) if len(weight) else 0, rows):
            end = start + rows
            lse[start:end], picked[start:end], logits = steps[0](hidden[start:end], weight, targets[start:end],
                                                                 temperature)
            if keep:
                kept.append(logits)
        if vocab is not None:
            picked = picked * held
            dist.all_reduce(picked, group=vocab[0])
            lse = _logsumexp_over(lse, vocab[0])
        ctx.save_for_backward(hidden, weight, targets, lse, held, *kept)
        ctx.temperature, ctx.rows, ctx.steps = temperature, rows, steps
        return picked - lse

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        hidden, weight, targets, lse, held, *kept = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        # (zeros only where this rank holds no rows: every chunk writes its own otherwise)
        grad_hidden = (torch.empty_like if len(weight) else torch.zeros_like)(hidden) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        picked_grad = grad if held is None else grad * held  # a target's own logit: on the rank that holds it
        for index, start in enumerate(range(0, len(hidden) if len(weight) else 0, ctx.rows)):
            end = start + ctx.rows
            chunk = hidden[start:end]
            logits = kept[index] if kept else torch.nn.functional.linear(chunk, weight)  # recomputed
            d_logits = ctx.steps[1](logits, targets[start:end], lse[start:end], grad[start:end],
                                    picked_grad[start:end], ctx.temperature)
            if want_hidden:
                grad_hidden[start:end] = d_logits @ weight
            if want_weight:
                grad_weight.add_(d_logits.t() @ chunk)  # summed in float32, with no float32 copy of each term
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None, None, None,
                None)


def _logsumexp_over(lse: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[n] logsumexp over the group's ranks of each rank's [n] (-inf where a rank holds no column)."""
    top = lse.clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    total = (lse - top).exp()
    dist.all_reduce(total, group=group)
    return top + total.log()


def _chunk_forward(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                   temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A chunk's float32 (logsumexp, target's logit) and its logits as the head computes them (in
    the weight's dtype, unscaled)."""
    logits = torch.nn.functional.linear(hidden, weight)
    scaled = scaled_logits(logits, temperature)
    return torch.logsumexp(scaled, dim=-1), scaled.gather(-1, targets[:, None]).squeeze(-1), logits


def _chunk_grad_logits(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor,
                       picked_grad: torch.Tensor, temperature: float) -> torch.Tensor:
    """A chunk's gradient of the loss in its logits (from the head's logits, unscaled; computed in
    float32, returned in the logits' dtype): d logprob[target] / d logits = onehot(target) - softmax,
    times the upstream's (picked_grad at the target: 0 where another rank holds it)."""
    g = grad.float()
    d_logits = (scaled_logits(logits, temperature) - lse[:, None]).exp_().mul_(-g[:, None])
    d_logits.scatter_add_(-1, targets[:, None], picked_grad.float()[:, None])
    if temperature != 1.0:
        d_logits.div_(temperature)
    return d_logits.to(logits.dtype)


@functools.cache
def _fused():
    """The two chunk steps compiled (torch.compile, inductor): a chunk's float32 upcast, logsumexp
    and softmax gradient become one kernel over the matmul's output, with no float32 copy of the
    chunk's logits in memory (the eager steps write and read one several times). Compiled on first
    use; a chunk of another length (the last one) compiles once more, with dynamic shapes."""
    return CompiledOrEager(_chunk_forward), CompiledOrEager(_chunk_grad_logits)


class CompiledOrEager:
    """`fn` compiled, or, where it cannot compile (no Triton, a GPU too old for it), `fn` itself from
    the first failure on, said once: the same numbers, only slower."""

    def __init__(self, fn) -> None:
        from novarl.models.compile_limits import allow_recompiles

        allow_recompiles()
        self.fn = fn
        self.compiled = torch.compile(fn, dynamic=None)

    def __call__(self, *args):
        if self.compiled is not None:
            try:
                return self.compiled(*args)
            except Exception as error:  # noqa: BLE001 (any compiler failure: the eager function computes the same)
                from novarl.logging.console import info

                self.compiled = None
                info(f"warning: {self.fn.__name__} could not be compiled ({type(error).__name__}: "
                     f"{str(error).splitlines()[0][:200] if str(error) else ''}); it runs eagerly")
        return self.fn(*args)


def chunked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                     rows: int | None = None, fused: bool = False,
                     vocab: tuple[dist.ProcessGroup, int] | None = None) -> torch.Tensor:
    """[n] float32 logprobs of targets [n] under the logits hidden [n, H] @ weight [V, H].T / temperature,
    computed `rows` rows at a time (default: chunk_rows of the vocabulary); differentiable in
    hidden and weight (the backward reads the logits kept where they take at most SAVE_LOGITS_BYTES,
    else recomputes each chunk's). fused: each chunk's steps compiled (_fused): the same numbers
    within float rounding, fewer passes over memory. vocab (group, first): weight is this rank's part
    of a vocabulary split over the group, from row `first` (ChunkedLogprobs)."""
    return ChunkedLogprobs.apply(hidden, weight, targets, temperature, rows or chunk_rows(max(len(weight), 1)), fused,
                                 vocab)


class PickingHead(torch.nn.Linear):
    """A causal LM's output head that, inside `picking(...)`, returns logprobs of chosen tokens."""

    _request: tuple[torch.Tensor | None, torch.Tensor, float] | None = None
    rows: int | None = None
    """Rows of logits computed at once (policy.logprob_chunk_size); None: chunk_rows of the vocabulary."""
    fused: bool = False
    """Each chunk's steps compiled (chunked_logprobs' fused): on DTensor where the decoder layers are
    compiled, on DeepSpeed on CUDA."""

    vocab: VocabParallel | None = None
    """Where the weight is split over the vocabulary across tensor-parallel ranks (vocab_parallel.py): its
    group and this rank's rows. The logits it returns are then gathered from every rank's columns."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weight, vocab = self.weight, self.vocab
        if vocab is not None:  # this rank's rows; the hidden states' gradient summed over the ranks' rows
            weight, hidden = weight.to_local(), sum_gradient_over(hidden, vocab.group)
        if self._request is None:
            logits = torch.nn.functional.linear(hidden, weight)
            return logits if vocab is None else gather_columns(logits, vocab.group, vocab.sizes)
        previous, targets, temperature = self._request
        rows = hidden.reshape(-1, hidden.shape[-1])
        if previous is not None:
            rows = rows.index_select(0, previous.clamp(min=0))
        return chunked_logprobs(rows, weight, targets, temperature, self.rows, self.fused,
                                None if vocab is None else (vocab.group, vocab.first))

    @contextmanager
    def picking(self, previous: torch.Tensor | None, targets: torch.Tensor, temperature: float) -> Iterator[None]:
        """While inside: the head returns [n] logprobs of targets [n], token i's read from the
        hidden state at flat position previous[i] of the [R, W] input (clamped at 0: a sequence's
        first token, which the caller masks); previous None: at flat position i (one target a position)."""
        self._request = (previous, targets, temperature)
        try:
            yield
        finally:
            self._request = None


def use_picking_head(model: torch.nn.Module, rows: int | None = None, fused: bool = False) -> bool:
    """Make a loaded Hugging Face causal LM's output head a PickingHead (computing `rows` rows of
    logits at once, its chunk steps compiled if `fused`) where its logits are the head's output as
    is (an unbiased linear layer of a plain_head architecture) and its weight a whole tensor (after
    tensor parallelism, before FSDP2 or ZeRO shard it). True if the head now picks."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, PickingHead):  # else split over the vocabulary already (vocab_parallel.py)
        if not can_pick(model):
            return False
        head.__class__ = PickingHead
    head.rows, head.fused = rows, fused
    return True


def can_pick(model: torch.nn.Module) -> bool:
    """Whether the model's head can pick: an unbiased nn.Linear, its weight a whole tensor (not split over
    the vocabulary by a custom tensor-parallel plan), of an architecture whose logits are the head's output
    as is (no final soft-capping)."""
    from torch.distributed.tensor import DTensor

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    config = model.config
    return (type(head) is torch.nn.Linear and head.bias is None and not isinstance(head.weight, DTensor)
            and plain_head(config.model_type, getattr(config, "final_logit_softcapping", None)))


def picking_head(model) -> PickingHead | None:
    """The model's PickingHead (through a DeepSpeed engine's `module`), or None."""
    module = getattr(model, "module", model)
    head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
    return head if isinstance(head, PickingHead) else None
