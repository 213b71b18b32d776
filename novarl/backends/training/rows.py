"""What every training backend does the same way with a batch's rows.

Data-parallel ranks split each batch into contiguous shares; ranks that split
one model (tensor parallel) see the same rows. Logprobs are computed on each
rank's share and all-gathered, so every rank returns the whole batch's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from novarl.algorithms.losses import LossFn
from novarl.models.loading import token_logprobs
from novarl.types import TrainBatch


class DataParallelRows:
    """Mixin: needs self.model (callable like a Hugging Face causal LM), self.device,
    self.temperature, self.dp_group, self.dp_rank, self.dp_size, self.logprob_batch_size
    and self.sequence_multiple (pad the length to a multiple of it; 1: no padding)."""

    def shard(self, batch: TrainBatch) -> TrainBatch:
        """This data-parallel rank's contiguous share of the rows."""
        return data_parallel_share(batch, self.dp_rank, self.dp_size, self.device)

    def forward_logprobs(self, mb: TrainBatch) -> torch.Tensor:
        ids, mask = mb.input_ids, mb.attention_mask
        length = ids.shape[1]
        pad = -length % self.sequence_multiple  # sequence parallelism splits the sequence evenly
        if pad:
            ids = torch.nn.functional.pad(ids, (0, pad), value=0)
            mask = torch.nn.functional.pad(mask, (0, pad), value=False)
        logits = self.model(input_ids=ids, attention_mask=mask).logits
        return token_logprobs(logits, ids, self.temperature)[:, :length]

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """[B, L] logprobs of batch.input_ids (0 on padding): each data-parallel rank
        computes its share, then they are all-gathered."""
        local = self.shard(batch)
        parts = [self.forward_logprobs(local.slice(s, s + self.logprob_batch_size))
                 * local.attention_mask[s:s + self.logprob_batch_size]
                 for s in range(0, len(local), self.logprob_batch_size)]
        mine = torch.cat(parts)
        if self.dp_size == 1:
            return mine.cpu()
        gathered = [torch.empty_like(mine) for _ in range(self.dp_size)]
        dist.all_gather(gathered, mine, group=self.dp_group)
        return torch.cat(gathered).cpu()



class AccumulatingRows(DataParallelRows):
    """Mixin for a trainable policy: micro-batched forward/backward over this rank's rows.
    Needs self.micro_batch_size, `accumulation_boundary(last)` (reduce gradients only at
    the last micro-batch) and `backward(loss)` from the backend."""

    def forward_backward(self, batch: TrainBatch, loss: LossFn) -> dict[str, float]:
        """Accumulate gradients of `loss` over this rank's rows in micro-batches, reduced over
        the data-parallel ranks at the last one. Metrics summed over micro-batches and ranks."""
        local = self.shard(batch)
        totals: dict[str, torch.Tensor] = {}
        starts = range(0, len(local), self.micro_batch_size)
        for i, start in enumerate(starts):
            mb = local.slice(start, start + self.micro_batch_size)
            self.accumulation_boundary(i == len(starts) - 1)
            value, metrics = loss(self.forward_logprobs(mb), mb)
            # Each rank's loss is already its share of the step's mean (algorithms/losses.py),
            # so gradients must be summed over ranks; FSDP2 and DeepSpeed average them, hence
            # the factor.
            self.backward(value * self.dp_size)
            accumulate(totals, metrics)
        return all_reduce_metrics(totals, self.dp_group)

    def accumulation_boundary(self, last: bool) -> None:
        raise NotImplementedError

    def backward(self, loss: torch.Tensor) -> None:
        raise NotImplementedError


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
    for op, wanted in ((dist.ReduceOp.SUM, False), (dist.ReduceOp.MAX, True)):
        names = sorted(n for n in totals if n.endswith("_max") == wanted)
        if names:
            values = torch.stack([totals[n] for n in names])
            dist.all_reduce(values, op=op, group=group)
            out.update(zip(names, values.tolist()))
    return out


def data_parallel_share(batch: TrainBatch, rank: int, size: int, device: torch.device) -> TrainBatch:
    """Data-parallel rank `rank`'s contiguous share of the rows (of `size` equal shares), on `device`."""
    if len(batch) % size:
        raise ValueError(f"{len(batch)} rows do not split over {size} data-parallel ranks")
    share = len(batch) // size
    return _to(batch.slice(rank * share, (rank + 1) * share), device)


def _to(batch: TrainBatch, device: torch.device) -> TrainBatch:
    if device.type == "cpu":
        return batch
    moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in vars(batch).items()}
    moved["extras"] = {k: v.to(device) for k, v in batch.extras.items()}
    return TrainBatch(**moved)
