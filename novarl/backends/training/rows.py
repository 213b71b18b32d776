"""What every training backend on Hugging Face models does the same way with a batch.

Each data-parallel rank computes its share of the sequences, in the micro-batches
of the plan every rank computes alike (batching.py: packed, dynamically batched or
fixed); ranks that split one model (tensor parallel) see the same micro-batches.
Logprobs are gathered from all data-parallel ranks, so every rank returns the whole
batch's.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
import torch.distributed as dist

from novarl.algorithms.losses import LossFn
from novarl.backends.training.batching import (
    MicroBatching,
    gather_sequences,
    lay_out,
    micro_batch,
    picked_logprobs,
    plan_for,
)
from novarl.distributed.local import collective_device
from novarl.models.attention import VARLEN, say_attention_path
from novarl.models.logprob_head import picking_head
from novarl.models.scores import Head, Values, check_head, token_scores
from novarl.errors import UserError
from novarl.types import TrainBatch


class DataParallelRows:
    """Mixin: needs self.model (callable like a Hugging Face causal LM), self.device,
    self.dp_group, self.dp_rank, self.dp_size, self.logprob_batching (a MicroBatching),
    self.attention (the model's attention implementation when it takes a packed row's sequence
    boundaries, else None: models/attention.py) and self.value_head (a critic's scalar head in the
    place of the vocabulary one: the head it applies is Values())."""

    model: Any
    device: torch.device
    dp_group: dist.ProcessGroup | None
    dp_rank: int
    dp_size: int
    logprob_batching: MicroBatching
    attention: str | None
    value_head: bool = False
    context_group: dist.ProcessGroup | None = None
    """The context-parallel group this rank splits each sequence with (None: no context parallelism)."""

    def forward_scores(self, mb: TrainBatch, batching: MicroBatching, head: Head) -> tuple[torch.Tensor, int]:
        """[n] the head's score of each of the micro-batch's tokens (with grad when enabled), and
        the tokens the model computed for them (padding included)."""
        if isinstance(head, Values):
            with warnings.catch_warnings():
                # a one-wide head's output is a view; nothing writes to it in place (FSDP2's warning is moot)
                warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
                return model_values(self.model, self.attention, mb, batching, context=self.context_group)
        return model_logprobs(self.model, self.attention, mb, batching, head.temperature, context=self.context_group)

    @torch.no_grad()
    def forward(self, batch: TrainBatch, head: Head) -> torch.Tensor:
        """[N] the head's score of each of batch.input_ids (0 at each sequence's first token):
        each data-parallel rank computes its sequences, then they are gathered."""
        check_head(head, value_head=self.value_head, model=type(self).__name__)
        batching = self.logprob_batching
        plan = plan_for(batch, self.dp_size, batching)
        batch = batch.to(self.device)
        parts = []
        for sequences in plan.ranks[self.dp_rank]:
            scores, _ = self.forward_scores(micro_batch(batch, sequences), batching, head)
            if sequences is not None:
                parts.append(scores)
        mine = torch.cat(parts) if parts else torch.zeros(0, device=self.device)
        return gather_sequences(batch, plan, mine, self.dp_rank, self.dp_group if self.dp_size > 1 else None)


class AccumulatingRows(DataParallelRows):
    """Mixin for a trainable policy: micro-batched forward/backward over this rank's sequences.
    Needs self.train_batching (a MicroBatching), `accumulation_boundary(last)` (reduce
    gradients only at the last micro-batch) and `backward(loss)` from the backend."""

    train_batching: MicroBatching

    def forward_backward(self, batch: TrainBatch, loss: LossFn, head: Head) -> dict[str, float]:
        """Accumulate gradients of `loss` (of the head's scores) over this rank's sequences in
        micro-batches, reduced over the data-parallel ranks at the last one. Metrics summed over
        micro-batches and ranks, with `tokens_computed` (padding included) beside the loss's."""
        check_head(head, value_head=self.value_head, model=type(self).__name__)
        plan = plan_for(batch, self.dp_size, self.train_batching)
        batch = batch.to(self.device)
        totals: dict[str, torch.Tensor] = {}
        mine = plan.ranks[self.dp_rank]
        for i, sequences in enumerate(mine):
            mb = micro_batch(batch, sequences)
            self.accumulation_boundary(i == len(mine) - 1)
            scores, computed = self.forward_scores(mb, self.train_batching, head)
            value, metrics = loss(scores, mb)
            # Each rank's loss is already its share of the step's mean (algorithms/losses.py),
            # so gradients must be summed over ranks; FSDP2 and DeepSpeed average them, hence
            # the factor.
            self.backward(value * self.dp_size)
            accumulate(totals, {**metrics, "tokens_computed": torch.tensor(float(computed))})
        return all_reduce_metrics(totals, self.dp_group)

    def accumulation_boundary(self, last: bool) -> None:
        raise NotImplementedError

    def backward(self, loss: torch.Tensor) -> None:
        raise NotImplementedError


def model_logprobs(model, attention: str | None, mb: TrainBatch, batching: MicroBatching,
                   temperature: float, *, context: dist.ProcessGroup | None = None) -> tuple[torch.Tensor, int]:
    """[n] logprobs of the micro-batch's tokens from a Hugging Face causal LM laid out as
    `batching` says, and the tokens it computed (padding included). attention: the model's
    implementation when it reads packed boundaries (models/attention.py), else None. context: the
    context-parallel group each sequence is split over (models/context_parallel.py)."""
    head = picking_head(model)
    if context is not None:
        inputs, shard = context_layout(mb, batching, context)
        ids = inputs.input_ids.reshape(-1)
        following = torch.nn.functional.pad(ids[1:], (0, 1)).index_select(0, shard.local)
        if head is None:
            scores = token_scores(context_forward(model, inputs, shard)[0], following, temperature)
        else:  # each of the rank's positions scores its following token, without the full logits
            with head.picking(None, following, temperature):
                scores = context_forward(model, inputs, shard)
        return per_token(shard.gather(scores, 0), inputs.previous), len(shard.local)
    inputs = model_inputs(mb, batching, attention)
    if head is None:
        return picked_logprobs(run_model(model, attention, inputs), inputs, mb, temperature), inputs.tokens_computed
    with head.picking(inputs.previous, mb.input_ids, temperature):  # no full logits: models/logprob_head.py
        picked = run_model(model, attention, inputs)
    return picked * (inputs.previous >= 0), inputs.tokens_computed


def model_values(model, attention: str | None, mb: TrainBatch, batching: MicroBatching, *,
                 context: dist.ProcessGroup | None = None) -> tuple[torch.Tensor, int]:
    """[n] float32 values of the micro-batch's tokens from a model with a scalar head (a critic:
    models/critic.py), each read at its predecessor's position like a logprob; 0 at each
    sequence's first token. And the tokens computed (padding included)."""
    if context is not None:
        inputs, shard = context_layout(mb, batching, context)
        outputs = context_forward(model, inputs, shard)
        return per_token(shard.gather(outputs.reshape(-1).float(), 0), inputs.previous), len(shard.local)
    inputs = model_inputs(mb, batching, attention)
    outputs = run_model(model, attention, inputs)
    return per_token(outputs.reshape(-1).float(), inputs.previous), inputs.tokens_computed


def per_token(per_position: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """[n] each token's value read at its predecessor's flat position; 0 at a sequence's first."""
    return per_position.index_select(0, previous.clamp(min=0)) * (previous >= 0)


def model_inputs(mb: TrainBatch, batching: MicroBatching, attention: str | None):
    """The micro-batch laid out as `batching` says (batching.ModelInputs), prompts shared where
    the attention implementation reads shared-prompt rows."""
    return lay_out(mb, batching.layout, batching.length_multiple,
                   share_prompts=batching.share_prompts and attention == VARLEN)


def run_model(model, attention: str | None, inputs) -> torch.Tensor:
    """The model's output head over laid-out inputs: [R, W, V] logits (or what a picking head returns)."""
    boundaries = {}
    if inputs.attention_rows is not None:  # a prompt once, attended by each of its completions
        boundaries = dict(novarl_attention_rows=inputs.attention_rows, novarl_attention_take=inputs.attention_take,
                          novarl_shared_keys=inputs.shared_keys)
    elif inputs.attention_mask is None and attention:  # each sequence's attention alone
        boundaries = dict(cu_seq_lens_q=inputs.cu_seqlens, cu_seq_lens_k=inputs.cu_seqlens,
                          max_length_q=inputs.max_seqlen, max_length_k=inputs.max_seqlen)
        if inputs.piece_length is not None:  # pieces all alike: padded rows side by side
            boundaries["novarl_piece_length"] = inputs.piece_length
    # no KV cache: with one, transformers would not read packed rows' position ids as
    # sequence boundaries (and a training forward has no use for it)
    logits = model(input_ids=inputs.input_ids, position_ids=inputs.position_ids,
                   attention_mask=None if attention else inputs.attention_mask, use_cache=False, **boundaries).logits
    say_attention_path()  # (what compiled layers could not say inside)
    return logits


def context_layout(mb: TrainBatch, batching: MicroBatching, group: dist.ProcessGroup):
    """Context parallelism: the micro-batch's whole layout and this rank's share of its tokens
    (models/context_parallel.py). Every sequence (a packed row's, or each padded row) is laid out to a
    multiple of 2 x cp tokens."""
    from novarl.models.context_parallel import shard_rows

    split = 2 * dist.get_world_size(group)
    inputs = lay_out(mb, batching.layout, math.lcm(batching.length_multiple, split), sequence_multiple=split)
    return inputs, shard_rows(inputs.bounds, group, inputs.input_ids.device)


def context_forward(model, inputs, shard) -> torch.Tensor:
    """The model's outputs over the rank's share of the laid-out tokens: logits [1, n, V], a critic's
    values, or what a picking head returns."""
    local = shard.local
    return model(input_ids=inputs.input_ids.reshape(-1)[local][None],
                 position_ids=inputs.position_ids.reshape(-1)[local][None], use_cache=False,
                 novarl_context=shard).logits


@torch.no_grad()
def check_packing(model, attention: str | None, batching: MicroBatching, device: torch.device) -> None:
    """Refuse packing for a model whose attention crosses sequence boundaries in a packed row:
    two short samples of one prompt, packed and padded, must get the same logprobs. Run on the
    loaded model before it is sharded (one tiny forward each, on this rank alone)."""
    if batching.layout != "packed":
        return
    vocab_size = model.config.vocab_size
    ids = ((torch.arange(14) * 7 + 3) % max(vocab_size - 1, 1) + 1).view(2, 7)
    ids[1, :3] = ids[0, :3]  # one prompt of 3 tokens, two samples (shared when prompts are)
    two = TrainBatch.from_rows(ids, torch.arange(7) < torch.tensor([[7], [5]]),
                               torch.ones(2, 7, dtype=torch.bool), torch.zeros(2))
    two.prompt_lengths, two.group_ids = torch.tensor([3, 3]), torch.tensor([0, 0])
    two = two.to(device)
    training = model.training
    model.eval()  # no dropout: the two forwards must be comparable
    packed, _ = model_logprobs(model, attention, two, batching, 1.0)
    padded, _ = model_logprobs(model, attention, two, MicroBatching("fixed", 2, 14, batching.length_multiple), 1.0)
    model.train(training)
    if not torch.allclose(packed.float(), padded.float(), rtol=1e-3, atol=1e-3):
        raise UserError(
            f"policy.sequence_packing: {type(model).__name__} attends across sequences in a packed row (its logprobs "
            "differ from the same sequences padded), so packing would train on wrong numbers. Its attention "
            "does not read sequence boundaries from position ids; set policy.sequence_packing.enabled=false "
            "and use policy.dynamic_batching instead.")


def accumulate(totals: dict[str, torch.Tensor], metrics: dict[str, torch.Tensor]) -> None:
    """Add a micro-batch's metrics to the totals: summed, or the largest for a name ending in
    "_max"."""
    for name, metric in metrics.items():
        metric = metric.detach().float()
        if name not in totals:
            totals[name] = metric
        else:
            totals[name] = torch.maximum(totals[name], metric) if name.endswith("_max") else totals[name] + metric


def all_reduce_metrics(totals: dict[str, torch.Tensor], group) -> dict[str, float]:
    """The totals over the group's ranks (every rank gets them): summed, or the largest for a
    name ending in "_max". Every rank must hold the same names."""
    out: dict[str, float] = {}
    device = collective_device(group)
    for op, wanted in ((dist.ReduceOp.SUM, False), (dist.ReduceOp.MAX, True)):
        names = sorted(n for n in totals if n.endswith("_max") == wanted)
        if names:
            values = torch.stack([totals[n].to(device) for n in names])
            dist.all_reduce(values, op=op, group=group)
            out.update(zip(names, values.tolist()))
    return out
