"""How a token-level batch meets the model: which sequences each data-parallel rank
computes, in which micro-batches, laid out how.

Three layouts, chosen by `policy.*` (NeMo RL's keys; packing and dynamic batching
exclude each other):

- packed (`sequence_packing.enabled`): the sequences of a micro-batch end to end in
  one row of at most `train_mb_tokens` (`logprob_mb_tokens`) tokens, bins filled by
  `sequence_packing.algorithm`, the row rounded up to `sequence_length_round`.
  Position ids restart at 0 at each sequence, and each sequence attends only to
  itself: transformers builds the block-diagonal causal mask from the position ids
  for SDPA and eager attention, and runs flash-attention's varlen kernel on them;
  Megatron gets `PackedSeqParams` (Transformer Engine's varlen attention, or without it
  novarl's, backends/megatron/attention.py).
- dynamic (`dynamic_batching.enabled`): sequences sorted by length, grouped while
  rows x padded length stays within the token budget; each micro-batch is padded to
  its own longest sequence, rounded up to `sequence_length_round`.
- fixed (neither): `train_micro_batch_size` (`logprob_batch_size`) sequences per
  micro-batch, in order, padded to the micro-batch's longest.

Every rank computes the same plan from the sequence lengths alone (each holds the
whole batch), so the ranks agree without a message. A rank with fewer micro-batches
than another runs empty ones (one token, no loss): FSDP, ZeRO-3 and Megatron need
every rank in every forward. The loss divides by the step's global token count, so
how sequences are cut and laid out changes nothing but the floating-point order.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from novarl.models.attention import SharedKeys
from novarl.models.scores import token_scores
from novarl.types import TrainBatch, to_device

Layout = Literal["packed", "dynamic", "fixed"]


@dataclass(frozen=True)
class MicroBatching:
    """How one kind of pass (training, or logprobs) cuts a batch into micro-batches."""

    layout: Layout
    rows: int
    """fixed: sequences per micro-batch."""
    tokens: int
    """packed, dynamic: token budget of a micro-batch (a longer sequence goes alone)."""
    length_multiple: int = 1
    """Padded lengths (fixed, dynamic: each row; packed: the packed row) are multiples of it."""
    algorithm: str = "modified_first_fit_decreasing"
    """packed: the bin-packing algorithm (PACKERS)."""
    share_prompts: bool = False
    """packed: a group's prompt (TrainBatch.group_ids) is laid out once in the row and its
    samples attend to it (needs novarl's varlen attention: models/attention.py)."""

    @classmethod
    def from_policy(cls, policy, *, training: bool, sequence_multiple: int = 1) -> "MicroBatching":
        """From a `PolicyConfig`: the training pass (training=True) or the logprob pass.
        sequence_multiple: what the backend needs every padded length to be a multiple of
        (make_sequence_length_divisible_by, the tensor-parallel size with sequence parallelism)."""
        rows = policy.train_micro_batch_size if training else (policy.logprob_batch_size
                                                                 or policy.train_micro_batch_size)
        sections: tuple[tuple[Layout, Any], ...] = (("packed", policy.sequence_packing),
                                                    ("dynamic", policy.dynamic_batching))
        for layout, section in sections:
            if section.enabled:
                budget = section.train_mb_tokens if training else section.logprob_mb_tokens
                return cls(layout, rows, budget or policy.max_seq_length * rows,
                           math.lcm(section.sequence_length_round, sequence_multiple),
                           getattr(section, "algorithm", "modified_first_fit_decreasing"),
                           getattr(section, "share_prompts", False))
        return cls("fixed", rows, policy.max_seq_length * rows, sequence_multiple)


# ---------------------------------------------------------------- bin packing
def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Longest first, each into the first bin with room (a new bin when none has)."""
    return _first_fit(sorted(range(len(lengths)), key=lambda i: -lengths[i]), lengths, capacity)


def first_fit_shuffle(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """First fit in a shuffled order (seeded: every rank must shuffle alike)."""
    order = list(range(len(lengths)))
    random.Random(len(lengths)).shuffle(order)
    return _first_fit(order, lengths, capacity)


def concatenative(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """In order, a new bin whenever the next sequence does not fit: for debugging."""
    bins: list[list[int]] = []
    used = capacity
    for i, n in enumerate(lengths):
        if used + n > capacity:
            bins.append([])
            used = 0
        bins[-1].append(i)
        used += n
    return bins


def modified_first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Johnson and Garey's MFFD (1985): large items (> capacity/2) open a bin each; the bins
    with most room take the largest medium item (> capacity/3) that fits; then each bin,
    tightest first, takes the two smallest small items (> capacity/6) that fit together; the
    rest go first-fit-decreasing."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    large = [i for i in order if lengths[i] > capacity / 2]
    medium = [i for i in order if capacity / 3 < lengths[i] <= capacity / 2]
    small = [i for i in order if capacity / 6 < lengths[i] <= capacity / 3]
    bins = [[i] for i in large]
    room = [capacity - lengths[i] for i in large]
    for b in sorted(range(len(bins)), key=lambda b: -room[b]):
        fit = next((i for i in medium if lengths[i] <= room[b]), None)  # medium is longest first
        if fit is not None:
            medium.remove(fit)
            bins[b].append(fit)
            room[b] -= lengths[fit]
    for b in sorted(range(len(bins)), key=lambda b: room[b]):
        if len(small) >= 2 and lengths[small[-1]] + lengths[small[-2]] <= room[b]:
            pair = [small.pop(), small.pop()]
            bins[b].extend(pair)
            room[b] -= sum(lengths[i] for i in pair)
    placed = {i for b in bins for i in b}
    rest = [i for i in order if i not in placed]
    return _first_fit(rest, lengths, capacity, bins, room)


def _first_fit(order: Sequence[int], lengths: Sequence[int], capacity: int,
               bins: list[list[int]] | None = None, room: list[int] | None = None) -> list[list[int]]:
    bins, room = bins if bins is not None else [], room if room is not None else []
    for i in order:
        b = next((b for b, r in enumerate(room) if lengths[i] <= r), None)
        if b is None:
            bins.append([i])
            room.append(capacity - lengths[i])
        else:
            bins[b].append(i)
            room[b] -= lengths[i]
    return bins


PACKERS: dict[str, Callable[[Sequence[int], int], list[list[int]]]] = {
    "modified_first_fit_decreasing": modified_first_fit_decreasing,
    "first_fit_decreasing": first_fit_decreasing,
    "first_fit_shuffle": first_fit_shuffle,
    "concatenative": concatenative,
}
"""policy.sequence_packing.algorithm -> packer(lengths, capacity) -> bins of indices."""


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def dynamic_groups(lengths: Sequence[int], tokens: int, multiple: int) -> list[list[int]]:
    """Longest first; a group grows while its rows x its padded length stay within `tokens`."""
    groups: list[list[int]] = []
    width = 0
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if groups and (len(groups[-1]) + 1) * width <= tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
            width = round_up(lengths[i], multiple)
    return groups


# ---------------------------------------------------------------- the plan
@dataclass(frozen=True)
class Plan:
    """Each data-parallel rank's micro-batches: ranks[r][k] is the sequences of rank r's k-th
    micro-batch (None: an empty one, run so that every rank takes part in every forward)."""

    ranks: list[list[list[int] | None]]
    layout: Layout

    def sequences(self, rank: int) -> list[int]:
        """Rank `rank`'s sequences, in the order its micro-batches compute them."""
        return [i for mb in self.ranks[rank] if mb is not None for i in mb]


def plan_micro_batches(lengths: Sequence[int], dp_size: int, batching: MicroBatching,
                       prompt_lengths: Sequence[int] | None = None, group_ids: Sequence[int] | None = None) -> Plan:
    """The same plan on every rank, from the sequence lengths (and, to share prompts in packed
    rows, each sequence's prompt length and group) alone."""
    lengths = [int(n) for n in lengths]
    if batching.layout == "fixed":  # contiguous shares, as even as the count allows
        bounds = [len(lengths) * r // dp_size for r in range(dp_size + 1)]
        ranks = [[list(range(s, min(s + batching.rows, bounds[r + 1])))
                  for s in range(bounds[r], bounds[r + 1], batching.rows)] for r in range(dp_size)]
        return Plan(_equalise(ranks), "fixed")
    if batching.layout == "packed":
        if batching.algorithm not in PACKERS:
            raise ValueError(f"unknown policy.sequence_packing.algorithm {batching.algorithm!r}; "
                             f"one of {sorted(PACKERS)}")
        if batching.share_prompts and prompt_lengths is not None and group_ids is not None:
            items, sizes = prompt_items(lengths, list(prompt_lengths), list(group_ids), batching.tokens)
        else:
            items, sizes = [[i] for i in range(len(lengths))], lengths
        bins = [[i for item in b for i in items[item]] for b in PACKERS[batching.algorithm](sizes, batching.tokens)]
    else:
        bins = dynamic_groups(lengths, batching.tokens, batching.length_multiple)
    return Plan(_equalise(_deal(_split_to(bins, dp_size, lengths), dp_size, lengths)), batching.layout)


def plan_for(batch: TrainBatch, dp_size: int, batching: MicroBatching) -> Plan:
    """plan_micro_batches for a batch."""
    prompts, groups = batch.prompt_lengths, batch.group_ids
    return plan_micro_batches(batch.lengths.tolist(), dp_size, batching, None if prompts is None else prompts.tolist(),
                              None if groups is None else groups.tolist())


def prompt_items(lengths: list[int], prompt_lengths: list[int], group_ids: list[int], capacity: int
                 ) -> tuple[list[list[int]], list[int]]:
    """What packing with shared prompts puts in bins: each group's consecutive sequences, as
    many as fit `capacity` tokens with the prompt counted once (a larger group is cut into
    several items, each with its prompt); and each item's tokens."""
    items: list[list[int]] = []
    sizes: list[int] = []
    for i, n in enumerate(lengths):
        same = items and group_ids[items[-1][-1]] == group_ids[i]
        if same and sizes[-1] + n - prompt_lengths[i] <= capacity:
            items[-1].append(i)
            sizes[-1] += n - prompt_lengths[i]
        else:
            items.append([i])
            sizes.append(n)
    return items, sizes


def _split_to(bins: list[list[int]], count: int, lengths: Sequence[int]) -> list[list[int]]:
    """At least `count` bins where the sequences allow: the fullest bins are halved."""
    bins = [list(b) for b in bins]
    while len(bins) < count:
        splittable = [b for b in bins if len(b) > 1]
        if not splittable:
            break
        fullest = max(splittable, key=lambda b: sum(lengths[i] for i in b))
        bins.remove(fullest)
        bins += [fullest[::2], fullest[1::2]]
    return bins


def _deal(bins: list[list[int]], dp_size: int, lengths: Sequence[int]) -> list[list[list[int]]]:
    """Bins by tokens, fullest first, dealt to the ranks back and forth (0..n-1, n-1..0, ...):
    the ranks' micro-batch counts differ by one at most, and their tokens little."""
    bins = sorted(bins, key=lambda b: -sum(lengths[i] for i in b))
    ranks: list[list[list[int]]] = [[] for _ in range(dp_size)]
    for k, b in enumerate(bins):
        turn, r = divmod(k, dp_size)
        ranks[r if turn % 2 == 0 else dp_size - 1 - r].append(b)
    return ranks


def _equalise(ranks: list[list[list[int]]]) -> list[list[list[int] | None]]:
    most = max(len(r) for r in ranks)  # 0 for an empty batch: no micro-batch anywhere
    return [list(r) + [None] * (most - len(r)) for r in ranks]


def micro_batch(batch: TrainBatch, sequences: list[int] | None) -> TrainBatch:
    """The micro-batch of `sequences`; for None, an empty one: one token of the batch's first,
    no loss, no sequence (its output is dropped)."""
    if sequences is not None:
        return batch.select(sequences)
    one = batch.select([0]) if len(batch) else batch
    index = torch.zeros(1, dtype=torch.long, device=one.input_ids.device)

    def zeros(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else torch.zeros_like(t[index])

    empty = TrainBatch(
        input_ids=one.input_ids[index], cu_seqlens=to_device(torch.tensor([0, 1]), one.cu_seqlens.device),
        position_ids=torch.zeros_like(one.position_ids[index]), loss_mask=torch.zeros_like(one.loss_mask[index]),
        advantages=torch.zeros_like(one.advantages[index]),
        generator_logprobs=torch.zeros_like(one.generator_logprobs[index]),
        old_logprobs=zeros(one.old_logprobs), reference_logprobs=zeros(one.reference_logprobs),
        returns=zeros(one.returns), old_values=zeros(one.old_values), positive=zeros(one.positive),
        global_valid_tokens=batch.global_valid_tokens, global_valid_sequences=batch.global_valid_sequences,
        global_positive_tokens=batch.global_positive_tokens)
    return empty


# ---------------------------------------------------------------- model inputs
@dataclass(frozen=True)
class ModelInputs:
    """A micro-batch as the model takes it: R rows of W tokens."""

    input_ids: torch.Tensor
    """[R, W] int64, pad id 0 in padding."""
    position_ids: torch.Tensor
    """[R, W] int64, restarting at 0 at each sequence (packed rows hold several)."""
    attention_mask: torch.Tensor | None
    """[R, W] bool for padded rows (True on tokens); None for a packed row (the position ids
    tell the sequences apart)."""
    index: torch.Tensor
    """[n] int64 where the micro-batch's tokens are in the flattened [R * W] rows, in order."""
    previous: torch.Tensor
    """[n] int64 where, in the flattened rows, the token before each of the micro-batch's tokens
    (in its sequence) is: its logits predict the token; -1 at each sequence's first token."""
    cu_seqlens: torch.Tensor
    """packed: [k + 1] int32 boundaries of the sequences in the row (each padded to
    sequence_multiple, the row's tail padding a sequence of its own), for varlen kernels.
    Padded rows: [R + 1] the rows' bounds (0, W, 2W, ...)."""
    max_seqlen: int
    attention_rows: torch.Tensor | None = None
    """Shared prompts: [A, L] int64 the row positions of each attention row (a prompt and one of
    its completions, causal; padded at the end), for novarl's varlen attention; else None."""
    attention_take: torch.Tensor | None = None
    """Shared prompts: [W] int64 where in the flattened [A * L] attention outputs each row
    position's output is (a prompt's from its group's first attention row)."""
    shared_keys: SharedKeys | None = None
    """Shared prompts: the same attention rows as a varlen kernel takes them (models/attention.py)."""
    piece_length: int | None = None
    """packed: where every piece of the row (each sequence with its padding, the row's tail) holds the same
    number of tokens, that number: the row is then W / piece_length padded rows side by side, and the
    attention runs them as such (models/attention.py: SDPA's kernel, not the varlen one). Else None."""
    bounds: tuple[int, ...] = ()
    """cu_seqlens as host ints: read without waiting on the device (context parallelism's shares)."""

    @property
    def tokens_computed(self) -> int:
        return int(self.input_ids.numel())

    def to(self, device: torch.device) -> "ModelInputs":
        """On `device` (copies queued without waiting; a CPU layout is freshly made, nothing changes it)."""
        def move(value):
            if isinstance(value, torch.Tensor):
                return to_device(value, device)
            return value.to(device) if isinstance(value, SharedKeys) else value

        return ModelInputs(**{f.name: move(getattr(self, f.name)) for f in dataclasses.fields(self)})


def lay_out(mb: TrainBatch, layout: Layout, multiple: int, *, sequence_multiple: int = 1,
            width: int | None = None, rows: int | None = None, share_prompts: bool = False) -> ModelInputs:
    """The micro-batch as model inputs. packed: one row, each sequence padded to a multiple of
    `sequence_multiple` (context parallelism splits each), the row to a multiple of `multiple`;
    with share_prompts, each group's prompt once, then its samples' completions.
    Padded (fixed, dynamic): one row per sequence, padded to the longest, rounded up to
    `multiple`. `width` and `rows` fix R and W instead (pipeline buffers have one shape)."""
    device = mb.input_ids.device
    mb = mb.host or mb  # the layout computed on the CPU, from the host copy where there is one
    if share_prompts and layout == "packed" and _shares_a_prompt(mb):
        return _shared_prompt_row(mb, multiple, width).to(device)
    lengths = mb.lengths.cpu()
    first = mb.position_ids.cpu() == 0
    if layout == "packed":
        slots = torch.tensor([round_up(int(n), sequence_multiple) for n in lengths.tolist()], dtype=torch.long)
        starts = torch.nn.functional.pad(torch.cumsum(slots, 0), (1, 0))
        used = int(starts[-1])
        total = width if width is not None else round_up(max(used, 1), multiple)
        cu = torch.cat([starts, tail_pieces(used, total, int(slots.max()) if len(slots) else total)])
        # every slot counts from 0, its sequence's padding included, so that a sequence and its
        # padding are one sequence to the attention; the row's tail is one more
        slot_of = torch.repeat_interleave(torch.arange(len(cu) - 1), cu.diff())
        positions = torch.arange(total) - cu[slot_of]
        index = torch.repeat_interleave(starts[:-1], lengths) + mb.position_ids.cpu()
        ids = torch.zeros(total, dtype=torch.long)
        ids[index] = mb.input_ids.cpu()
        pieces = cu.diff()
        alike = int(pieces[0]) if len(pieces) and bool((pieces == pieces[0]).all()) else None
        return ModelInputs(ids[None], positions[None], None, index, torch.where(first, -1, index - 1),
                           cu.to(torch.int32), int(pieces.max()), piece_length=alike,
                           bounds=tuple(cu.tolist())).to(device)
    count = rows if rows is not None else len(mb)
    longest = int(lengths.max()) if len(mb) else 1
    W = width if width is not None else round_up(longest, multiple)
    index = mb.sequence_index.cpu() * W + mb.position_ids.cpu()
    ids = torch.zeros(count * W, dtype=torch.long)
    ids[index] = mb.input_ids.cpu()
    mask = torch.zeros(count * W, dtype=torch.bool)
    mask[index] = True
    positions = torch.arange(W).expand(count, W)
    cu = torch.arange(count + 1, dtype=torch.int32) * W
    return ModelInputs(ids.view(count, W), positions, mask.view(count, W), index, torch.where(first, -1, index - 1),
                       cu, W, bounds=tuple(cu.tolist())).to(device)


def _shares_a_prompt(mb: TrainBatch) -> bool:
    """Whether some sequence follows another of its group with the same prompt (consecutive): only then does
    laying prompts out once save anything (and its gathered keys cost something)."""
    if mb.group_ids is None or mb.prompt_lengths is None:
        return False
    groups, prompts = mb.group_ids.cpu(), mb.prompt_lengths.cpu()
    return bool(((groups[1:] == groups[:-1]) & (prompts[1:] == prompts[:-1])).any())


def _shared_prompt_row(mb: TrainBatch, multiple: int, width: int | None) -> ModelInputs:
    """One packed row: for each group of consecutive sequences with one group id, the prompt
    once (positions 0..P-1), then every sequence's completion (positions P..), then padding to
    a multiple of `multiple`. Attention rows pair the prompt with each completion; the row's
    padding is cut into pieces of its own. Vectorised: it runs for every micro-batch."""
    assert mb.prompt_lengths is not None and mb.group_ids is not None  # lay_out's condition
    cu, positions, ids = mb.cu_seqlens.cpu(), mb.position_ids.cpu(), mb.input_ids.cpu()
    prompts, groups = mb.prompt_lengths.cpu(), mb.group_ids.cpu()
    sequence = mb.sequence_index.cpu()
    # a sequence leads its group (lays the prompt out) unless it continues the previous one's
    leads = torch.ones(len(mb), dtype=torch.bool)
    leads[1:] = (groups[1:] != groups[:-1]) | (prompts[1:] != prompts[:-1])
    leader = torch.cummax(torch.where(leads, torch.arange(len(mb)), 0), 0).values
    laid = (positions >= prompts[sequence]) | leads[sequence]  # tokens that take a place in the row
    slot = torch.cumsum(laid.long(), 0) - 1
    # a follower's prompt token sits where its leader's did
    index = torch.where(laid, slot, slot[cu[leader[sequence]] + positions])
    used = int(laid.sum())
    total = width if width is not None else round_up(max(used, 1), multiple)
    longest = int(mb.lengths.max())
    ends = tail_pieces(used, total, longest)
    starts = torch.cat([torch.tensor([used]), ends[:-1]])[:len(ends)]
    # attention row s: sequence s's tokens, at their row positions (its prompt at its leader's)
    rows = torch.zeros(len(mb) + len(ends), longest, dtype=torch.long)  # padded at the end: never attended
    rows[sequence, positions] = index
    take = torch.empty(total, dtype=torch.long)
    take[slot[laid]] = sequence[laid] * longest + positions[laid]
    for piece, (begin, end) in enumerate(zip(starts.tolist(), ends.tolist(), strict=True)):
        rows[len(mb) + piece, :end - begin] = torch.arange(begin, end)
        take[begin:end] = (len(mb) + piece) * longest + torch.arange(end - begin)
    keys = _shared_keys(rows, take, torch.cat([mb.lengths.cpu(), ends - starts]))
    row_ids = torch.zeros(total, dtype=torch.long)
    row_ids[slot[laid]] = ids[laid]
    row_positions = torch.arange(total) - used  # the padding counts from 0
    row_positions[index] = positions
    previous = torch.where(positions == 0, -1, index[(torch.arange(len(ids)) - 1).clamp(min=0)])
    cu_rows = torch.tensor([0, total], dtype=torch.int32)
    return ModelInputs(row_ids[None], row_positions[None], None, index, previous, cu_rows, total, rows, take, keys,
                       bounds=(0, total))


def _shared_keys(rows: torch.Tensor, take: torch.Tensor, lengths: torch.Tensor) -> SharedKeys:
    """Attention rows [A, L] (their `lengths` [A] real positions each) and the row's take [W] as
    queries and gathered keys for a varlen kernel: row a's queries are the row positions whose
    output take reads from row a (consecutive, in row order)."""
    width = rows.shape[1]
    queries = torch.bincount(take // width, minlength=len(rows))
    cu_queries = torch.nn.functional.pad(torch.cumsum(queries, 0), (1, 0)).to(torch.int32)
    cu_keys = torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)).to(torch.int32)
    index = rows[torch.arange(width) < lengths[:, None]]
    return SharedKeys(index, cu_queries, cu_keys, int(queries.max()), int(lengths.max()))


def tail_pieces(used: int, total: int, longest: int) -> torch.Tensor:
    """Ends of the pieces the padding after `used` tokens of a `total`-token row is cut into,
    none longer than `longest`: attention work is rows x their longest, and the tail is no row."""
    step = max(longest, 1)
    pieces = max(0, -(-(total - used) // step))
    return torch.arange(used + step, used + step * (pieces + 1), step).clamp(max=total)[:pieces]


def picked_logprobs(logits: torch.Tensor, inputs: ModelInputs, mb: TrainBatch, temperature: float) -> torch.Tensor:
    """[n] logprobs of the micro-batch's tokens from the model's logits [R, W, V], each read
    from its predecessor's logits (inputs.previous) at the sampling temperature; 0 at each
    sequence's first token. Only the n positions needed go through the softmax."""
    previous = inputs.previous
    # index_select: its backward adds with index_add (a prompt's last logits predict each sample's first token)
    rows = logits.reshape(-1, logits.shape[-1]).index_select(0, previous.clamp(min=0))
    return token_scores(rows, mb.input_ids, temperature) * (previous >= 0)


def gather_sequences(batch: TrainBatch, plan: Plan, mine: torch.Tensor, rank: int, group) -> torch.Tensor:
    """[N] per-token values of the whole batch, on every rank, from each data-parallel rank's
    `mine` (its sequences' tokens, in plan order); on the CPU."""
    size = len(plan.ranks)
    if size == 1:
        out = torch.empty(batch.num_tokens, dtype=mine.dtype)
        out[batch.token_index(plan.sequences(0))] = mine.cpu()
        return out
    indices = [batch.token_index(plan.sequences(r)) for r in range(size)]
    longest = max(len(i) for i in indices)
    padded = torch.nn.functional.pad(mine, (0, longest - mine.numel()))
    gathered = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(gathered, padded, group=group)
    out = torch.empty(batch.num_tokens, dtype=mine.dtype)
    for index, values in zip(indices, gathered, strict=True):
        out[index] = values[:len(index)].cpu()
    return out
