"""The input embeddings and the output head split over the vocabulary across the tensor-parallel ranks.

Under the DTensor backend's tensor parallelism the decoder layers are split, and without this every rank
would hold the embeddings and the head whole and compute the head's whole matmul for its tokens: on
Qwen2.5-32B with tensor parallelism 8, 1.6 B parameters of states on every rank and a sixth of each rank's
arithmetic spent on work another rank repeats. Split (NeMo RL's DTensor plans split both too), rank r holds
rows [first, first + n) of the [V, H] weights (torch.chunk's parts, the last ones shorter where tp does not
divide V), a DTensor Shard(0) over the tensor-parallel mesh, and:
- the embedding looks up the tokens it holds (zeros for the others) and the ranks' lookups are summed
  (Megatron's vocabulary-parallel embedding); its gradient is this rank's rows';
- the head (logprob_head.PickingHead) picks logprobs from its rows' logits, combining each row's logsumexp
  and the chosen token's logit over the group (chunked_logprobs' vocabulary mode), or, where the full logits
  are asked for, gathers the ranks' columns. The gradient in its input (the same hidden states on every
  rank) is summed over the group, so each rank's is the whole one, as with a whole head.
Tied weights stay tied: one Parameter for both modules. A head that does not pick (Gemma 2's soft-capped one)
stays whole, and so do embeddings tied to it; a critic's embeddings split beneath its own value head.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor


class _SumOverGroup(torch.autograd.Function):
    """Forward: the sum over the group's ranks; backward: the gradient as it is (every rank holds the same)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.mark_dirty(local)  # summed in place: the caller's fresh lookup, which nothing else reads
        dist.all_reduce(local, group=group)
        return local

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _SumGradientOverGroup(torch.autograd.Function):
    """Forward: the input as it is (the same on every rank); backward: its gradient summed over the group's ranks
    (each rank's is its part of the vocabulary's)."""

    @staticmethod
    def forward(ctx, same: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return same.view_as(same)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _GatherColumns(torch.autograd.Function):
    """[..., n_r] on each rank -> [..., sum of n_r] in rank order; the backward hands each rank its columns."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup, sizes: tuple[int, ...]) -> torch.Tensor:
        rank = dist.get_rank(group)
        ctx.start, ctx.size = sum(sizes[:rank]), sizes[rank]
        widest = max(sizes)
        padded = torch.nn.functional.pad(local, (0, widest - local.shape[-1])).contiguous()
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([part[..., :n] for part, n in zip(parts, sizes)], dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[..., ctx.start:ctx.start + ctx.size], None, None


def sum_gradient_over(same: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """`same` (equal on every rank of group), its gradient summed over the group's ranks."""
    return _SumGradientOverGroup.apply(same, group)


def gather_columns(local: torch.Tensor, group: dist.ProcessGroup, sizes: tuple[int, ...]) -> torch.Tensor:
    """Each rank's columns [..., sizes[rank]] side by side, differentiable."""
    return _GatherColumns.apply(local, group, sizes)


def part_sizes(rows: int, parts: int) -> tuple[int, ...]:
    """The rows of each of `parts` ranks in a Shard(0) DTensor of `rows` rows (torch.chunk's split)."""
    each = -(-rows // parts)
    return tuple(max(0, min(each, rows - each * r)) for r in range(parts))


class VocabParallel:
    """Where a module's weight [V, H] is split over a tensor-parallel group: the group, the ranks' row counts,
    and this rank's first row."""

    def __init__(self, mesh: DeviceMesh, rows: int) -> None:
        self.group = mesh.get_group()
        self.sizes = part_sizes(rows, mesh.size())
        self.first = sum(self.sizes[:mesh.get_local_rank()])
        self.size = self.sizes[mesh.get_local_rank()]


class VocabParallelEmbedding(torch.nn.Embedding):
    """An nn.Embedding whose weight is a Shard(0) DTensor over the vocabulary (split_vocabulary)."""

    vocab: VocabParallel

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        weight = self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight
        vocab = self.vocab
        # a token the vocabulary does not have fails, as the whole lookup's would (no wait for the GPU)
        torch._assert_async(((ids >= 0) & (ids < self.num_embeddings)).all(),
                            f"a token id outside the model's vocabulary of {self.num_embeddings}")
        outside = (ids < vocab.first) | (ids >= vocab.first + vocab.size)
        local = (ids - vocab.first).masked_fill(outside, 0)
        pad = self.padding_idx
        padding = pad - vocab.first if pad is not None and vocab.first <= pad < vocab.first + vocab.size else None
        out = torch.nn.functional.embedding(local, weight, padding, self.max_norm, self.norm_type,
                                            self.scale_grad_by_freq, self.sparse)
        return _SumOverGroup.apply(out.masked_fill(outside[..., None], 0), vocab.group)


SCALED_EMBEDDING = "ScaledWordEmbedding"
"""The name's end of Gemma's embedding classes (Gemma, Gemma 2 and 3 in transformers): nn.Embedding's lookup
(their forward calls it) times a scale; split through a subclass that puts the split lookup beneath theirs."""


def splits(model: torch.nn.Module) -> tuple[bool, bool, str]:
    """(the embeddings, the head, why not where they stay whole): what split_vocabulary splits. The embeddings
    where they are an nn.Embedding (or Gemma's scaled one) over whole tensors with a plain lookup (no max_norm,
    frequency-scaled or sparse gradients); the head where it also picks (an unbiased nn.Linear of a plain_head
    architecture over the same vocabulary: logprob_head.can_pick). Embeddings tied to a head that does not pick
    stay whole with it (its logits are read as they are); a critic's (its value head untied) split."""
    from novarl.models.logprob_head import can_pick

    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    lookup = type(embed) is torch.nn.Embedding or (
        isinstance(embed, torch.nn.Embedding) and type(embed).__name__.endswith(SCALED_EMBEDDING))
    if not lookup or isinstance(embed.weight, DTensor):
        return False, False, f"the input embeddings are a {type(embed).__name__}"
    if embed.max_norm is not None or embed.scale_grad_by_freq or embed.sparse:
        return False, False, "the input embeddings renormalise, scale or sparsify their rows"
    picks = can_pick(model) and head.out_features == embed.num_embeddings
    tied = head is not None and head.weight is embed.weight
    return picks or not tied, picks, "" if picks else "the output head gives its logits whole (it does not pick)"


@functools.cache
def _split_class(cls: type) -> type:
    """VocabParallelEmbedding, or for a subclass of nn.Embedding whose forward calls nn.Embedding's, the subclass
    with VocabParallelEmbedding's lookup beneath its forward."""
    if cls is torch.nn.Embedding:
        return VocabParallelEmbedding
    return type(f"VocabParallel{cls.__name__}", (cls, VocabParallelEmbedding), {})


def split_vocabulary(model: torch.nn.Module, mesh: DeviceMesh) -> str:
    """Split the embeddings and the head of `model` over the vocabulary across the 1-D tensor-parallel `mesh`,
    where `splits` says (nothing where a rank would hold no row); a split head becomes a PickingHead. What was
    done, for the log."""
    from novarl.models.logprob_head import PickingHead

    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    embeddings, picks, why = splits(model)
    if embeddings and min(part_sizes(embed.num_embeddings, mesh.size())) == 0:
        embeddings, picks, why = False, False, f"{embed.num_embeddings} rows cannot give {mesh.size()} ranks one each"
    if not embeddings:
        return f"the input embeddings and the output head stay whole on every tensor-parallel rank: {why}"
    tied = head is not None and head.weight is embed.weight
    vocab = VocabParallel(mesh, embed.num_embeddings)

    def split(weight: torch.nn.Parameter) -> torch.nn.Parameter:
        return torch.nn.Parameter(distribute_tensor(weight.detach(), mesh, [Shard(0)]),
                                  requires_grad=weight.requires_grad)

    embed.weight = split(embed.weight)
    embed.__class__ = _split_class(type(embed))
    embed.vocab = vocab
    if picks:
        head.weight = embed.weight if tied else split(head.weight)
        head.__class__ = PickingHead
        head.vocab = vocab
    rows = f"{max(vocab.sizes):,} of {embed.num_embeddings:,} rows a rank"
    if picks:
        return f"the input embeddings and the output head split over the vocabulary ({rows})"
    return f"the input embeddings split over the vocabulary ({rows}); the output head whole on every rank: {why}"
