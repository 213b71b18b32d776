"""The Megatron-core training backend: tensor, pipeline (plain or interleaved), context,
data, expert and expert-tensor parallelism with megatron-core's GPTModel,
DistributedDataParallel and (distributed) optimizer. The model side (layout, chunks,
weights in and out, the schedule over micro-batches) is megatron_model.py's
`MegatronModel`; this module adds training and checkpoints.

Same contract as the other backends (TrainingBackend) and the same Ray worker
groups. Every rank runs each method. Ranks are laid out by megatron-core
(tp-cp-ep-dp-pp order): tensor-parallel ranks split each layer, pipeline stages
hold consecutive layers (or v interleaved chunks of them), context-parallel ranks
two chunks of every sequence, data-parallel ranks compute their shares of each batch's
sequences in the micro-batches of backends/training/batching.py (packed sequences
run varlen through `PackedSeqParams`: Transformer Engine's attention, or without it
novarl's SDPAttention, backends/megatron/attention.py).

- Weights: the Hugging Face checkpoint is converted once (backends/megatron/
  cache.py, by global rank 0 while the others wait) and each rank loads its
  tensor-parallel shard, cut to its pipeline stage. `named_weights` gathers the
  shards back to Hugging Face names (the same name mapping), for the generator
  and for export.
- Loss: each micro-batch's loss is already its share of the step's token mean
  (algorithms/losses.py), so megatron-core runs with `calculate_per_token_loss`
  (no division by the micro-batch count) and DDP sums gradients over data-parallel
  ranks (`average_in_collective` off).
- Logprobs come from the vocab-parallel logits without gathering the vocabulary
  (megatron-core's vocab-parallel cross-entropy); the padding rows Megatron adds
  to the vocabulary are masked out.
- Optimizer and schedule come from `megatron_cfg.optimizer` and `.scheduler`
  (the seeds' rule for Megatron), gradient clipping from `optimizer.clip_grad`;
  the precision from `policy.precision` (`optimizer.bf16/fp16/params_dtype` follow it);
  DDP from `megatron_cfg.distributed_data_parallel_config`.
- Parameters are all-gathered synchronously at each step (the generator reads
  them right after), so `overlap_param_gather` is not applied.

megatron-core is imported in this module's functions only. It needs CUDA; see
backends/megatron/cpu.py for running it on the CPU in tests.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from novarl.algorithms.losses import LossFn
from novarl.backends.protocols import ReferenceBackend, TrainingBackend, WeightSender
from novarl.backends.megatron.convert import experts_file, join_expert_tensor_parts
from novarl.backends.training.megatron_model import MegatronModel
from novarl.backends.training.megatron_optim import (  # noqa: F401 (ddp_config: read by tests)
    _load_optimizer_state, _optimizer_state, build_optimizer, build_scheduler, ddp_config, fuse_adam)
from novarl.backends.training.megatron_checkpoint import CHECKPOINT_DIR, LAYOUT_FILE
from novarl.backends.training.rows import accumulate, all_reduce_metrics
from novarl.config.schema import PolicyConfig
from novarl.distributed.parking import module_tensors, optimizer_tensors, wakes
from novarl.errors import UserError
from novarl.logging.console import info
from novarl.models.scores import Head
from novarl.types import TrainBatch



class MegatronPolicy(MegatronModel, TrainingBackend, WeightSender):
    """The trainable policy on Megatron-core (implements TrainingBackend)."""

    def __init__(self, policy: PolicyConfig, model_path: str, device: torch.device | None = None, *,
                 total_steps: int, seed: int = 42, emulate_cuda: bool = False,
                 value_head: bool = False) -> None:
        super().__init__(policy, model_path, device, trainable=True, seed=seed,
                         emulate_cuda=emulate_cuda, value_head=value_head)
        from megatron.core.distributed import DistributedDataParallel, finalize_model_grads

        mc = policy.megatron_cfg
        self.distributed_optimizer = mc.optimizer.use_distributed_optimizer and mc.use_distributed_optimizer
        ddp = ddp_config(mc, self.distributed_optimizer)
        # one DDP per model chunk; the later chunks' gradients in one bucket each (megatron-core's rule)
        self.model_chunks = [DistributedDataParallel(self.config, ddp, module=module, disable_bucketing=index > 0)
                             for index, module in enumerate(self.modules)]
        no_sync = [chunk.no_sync for chunk in self.model_chunks]
        self.config.no_sync_func = no_sync if len(no_sync) > 1 else no_sync[0]
        # gradients are summed as they are: no division by a token count (see the module doc)
        self.config.finalize_model_grads_func = partial(_finalize_without_token_scaling, finalize_model_grads)
        self.optimizer = build_optimizer(mc, self.model_chunks, precision=self.precision,
                                         distributed=self.distributed_optimizer)
        self.scheduler = build_scheduler(mc, self.optimizer, total_steps)
        self.config.grad_scale_func = self.optimizer.scale_loss  # fp16's loss scale (1 otherwise)
        self._zero_grad_buffers()
        self.optimizer.zero_grad()
        if dist.get_rank() == 0:
            interleaved = f" ({len(self.modules)} chunks each)" if len(self.modules) > 1 else ""
            experts = f" ep={self.ep_size} etp={self.etp_size}" if self.shape.num_experts else ""
            context = f" cp={self.cp_size}" if self.cp_size > 1 else ""
            info(f"Megatron: tp={self.tp_size} pp={self.pp_size}{interleaved}{context} dp={self.dp_size}{experts}, "
                 f"{self.precision}, "
                 f"{'distributed' if self.distributed_optimizer else 'replicated'} {mc.optimizer.optimizer} "
                 f"optimizer, {self.config.recompute_granularity or 'no'} recomputation"
                 + (", logprobs from the output layer chunk by chunk" if self.picks_logprobs else ""))

    def park(self, group: str, host_too: bool = False) -> int:
        """Implements Parkable: the optimizers' state and fp32 master weights, or the weights (the gradient
        buffers, zero between steps, freed with them: they come back zeroed), to host memory."""
        weights = [t for module in self.modules for t in module_tensors(module)]
        if group == "weights":
            grads = [g for p in weights for g in (getattr(p, "main_grad", None), p.grad) if g is not None]
            return self.parking.park(group, weights, grads, host_too=host_too)
        inner = [o.optimizer for o in self._optimizers() if getattr(o, "optimizer", None) is not None]
        masters = [p for o in inner for g in o.param_groups for p in g["params"]]
        # an fp32 run's optimizer steps the weights themselves: those stay with the weights
        return self.parking.park(group, [*masters, *(t for o in inner for t in optimizer_tensors(o))],
                                 besides=weights, host_too=host_too)

    @wakes("weights")
    def forward_backward(self, batch: TrainBatch, loss: LossFn, head: Head) -> dict[str, float]:
        """Accumulate gradients of `loss` (of the head's scores) over this rank's rows in
        micro-batches (through the pipeline), reduced over data-parallel ranks after the last.
        Metrics summed over micro-batches and ranks, on every rank."""
        def loss_of(scores, mb, computed):
            value, metrics = loss(scores, mb)
            return value, {**_detached_metrics(metrics), "tokens_computed": torch.tensor(float(computed))}

        _, kept = self._run_pipeline(batch, self.train_batching, loss_of, head, forward_only=False)
        totals: dict[str, torch.Tensor] = {}
        for metrics in kept:
            accumulate(totals, metrics)
        names = sorted(totals)
        if self.pp_size > 1:  # only the last stage computed the loss: it tells the others
            box = [names]
            dist.broadcast_object_list(box, src=self._last_stage_rank(), group=self.pp_group)
            names = box[0]
        summed = torch.stack([totals[n].to(self.device) for n in names]) if kept else torch.zeros(len(names), device=self.device)
        if self.pp_size > 1:
            dist.broadcast(summed, src=self._last_stage_rank(), group=self.pp_group)
        return all_reduce_metrics(dict(zip(names, summed)), self.dp_group)

    def gpu_stats(self) -> dict[str, float]:
        """Collective: this step's GPU memory (and utilisation) over the training ranks; {} without CUDA."""
        from novarl.distributed.gpu_monitor import gpu_stats

        return gpu_stats()

    @wakes("weights", "optimizer")
    def optim_step(self) -> dict[str, float]:
        """Clip (optimizer.clip_grad), step the optimizer and the schedule, zero the gradients."""
        lr = self.optimizer.param_groups[0]["lr"]
        succeeded, grad_norm, _ = self.optimizer.step()
        if not succeeded:
            info("Megatron skipped an optimizer step (the loss scaler found inf/nan gradients)")
        self.scheduler.step(increment=1)
        self._zero_grad_buffers()
        self._empty_cache(level=2)
        return {"grad_norm": float(grad_norm) if grad_norm is not None else float("nan"), "lr": lr}

    def _zero_grad_buffers(self) -> None:
        for chunk in self.model_chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()

    @wakes("weights")
    def weight_buckets(self, bucket_bytes: int, *, everywhere: bool, dtype: torch.dtype | None = None
                       ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Implements WeightSender. Collective over the ranks: full tensors (Hugging Face names) in
        buckets of at most bucket_bytes. Rank 0 assembles them from the tensor-, pipeline- and
        expert-parallel owners (full_state_dict: the whole model once, on its CPU); with
        `everywhere` it then broadcasts them bucket by bucket to the other ranks."""
        from novarl.distributed.weight_sync import GroupChannel, bucketed, in_dtype

        full = self.full_state_dict()
        buckets = bucketed(((n, in_dtype(t, dtype)) for n, t in full.items()), bucket_bytes)
        if not everywhere:
            yield from buckets
            return
        channel = GroupChannel()
        if dist.get_rank() == 0:
            for bucket in buckets:
                channel.send([bucket])  # one bucket per message: each is yielded as soon as it is out
                yield bucket
            channel.send([])  # the end
            return
        while True:
            bucket = list(channel.receive())
            if not bucket:
                return
            yield bucket

    # ---------------------------------------------------------- checkpoints
    @wakes("weights", "optimizer")
    def save(self, path: Path) -> None:
        """The model shards (one file per tensor-parallel rank and pipeline stage, global layer
        numbers: `novarl convert` reads them offline), each rank's optimizer state and fp32
        master weights, and the schedule, under path/megatron/. Resuming needs the same
        tp x pp x dp layout."""
        folder = Path(path) / CHECKPOINT_DIR
        if dist.get_rank() == 0:
            folder.mkdir(parents=True, exist_ok=True)
        dist.barrier(group=self.cpu_group)
        dense, experts = self._local_state()
        if self.holds_dense:
            torch.save(dense, folder / f"model_tp{self.tp_rank}_pp{self.pp_rank}.pt")
        if self.holds_experts:
            torch.save(experts, folder / experts_file(self.ep_rank, self.pp_rank, self.etp_rank, self.etp_size))
        torch.save([_optimizer_state(o) for o in self._optimizers()], folder / f"optim_rank{dist.get_rank()}.pt")
        if dist.get_rank() == 0:
            torch.save(self.scheduler.state_dict(), folder / "scheduler.pt")
            (folder / LAYOUT_FILE).write_text(json.dumps(self._layout(), indent=2))
        dist.barrier(group=self.cpu_group)

    @torch.no_grad()
    @wakes("weights", "optimizer")
    def load(self, path: Path) -> None:
        folder = Path(path) / CHECKPOINT_DIR
        saved = json.loads((folder / LAYOUT_FILE).read_text())
        if saved != self._layout():
            raise UserError(f"{path} was written with {saved} (Megatron ranks); this run has "
                            f"{self._layout()}. Resume with the same layout, or export it with "
                            "`novarl convert` and start from the Hugging Face folder.")
        model_state = torch.load(folder / f"model_tp{self.tp_rank}_pp{self.pp_rank}.pt", weights_only=True)
        if self.shape.num_experts:  # this rank's experts, whole: _load_chunks cuts them to its part
            model_state.update(join_expert_tensor_parts([
                torch.load(folder / experts_file(self.ep_rank, self.pp_rank, r, self.etp_size), weights_only=True)
                for r in range(self.etp_size)]))  # (saved under global expert numbers)
        self._load_chunks(model_state, tied=False, error=UserError)
        # weights_only: the optimizer and schedule states are tensors, numbers, strings, lists and dicts
        states = torch.load(folder / f"optim_rank{dist.get_rank()}.pt", weights_only=True)
        for optimizer, state in zip(self._optimizers(), states, strict=True):
            _load_optimizer_state(optimizer, state)
        fuse_adam(self.optimizer)  # (a state written before Adam was fused brings its groups' foreach)
        self.scheduler.load_state_dict(torch.load(folder / "scheduler.pt", weights_only=True))

    def _optimizers(self) -> list:
        """megatron-core's optimizers behind the chained one (one per parameter group kind)."""
        return list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))

    def _layout(self) -> dict[str, Any]:
        parallel = {"tp": self.tp_size, "pp": self.pp_size, "dp": self.dp_size, "ep": self.ep_size}
        # written where they are not 1, so that checkpoints without them read as they were
        parallel.update({name: size for name, size in (("vpp", len(self.modules)), ("etp", self.etp_size),
                                                       ("cp", self.cp_size)) if size > 1})
        layout = {"parallel": parallel, "vocab_size": self.shape.vocab_size, "experts": self.shape.num_experts,
                  "fused_norms": self.fused_norms, "distributed_optimizer": self.distributed_optimizer}
        if not self.fused_norms and self.precision != "float32":
            # the local spec's norms in the 16-bit dtype (model.py norms_in_params_dtype), which moves them among the
            # optimizer's fp32 and 16-bit weights: a checkpoint written before, with fp32 norms, reads as another layout
            layout["norms"] = self.precision
        return layout

    def save_hf(self, path: Path, tokenizer, fmt=None) -> None:
        """A consolidated Hugging Face folder (in `fmt`, an ExportFormat: fp32 by default) from
        every rank's shard."""
        from novarl.models.loading import save_hf_folder

        state = self.full_state_dict()
        if dist.get_rank() == 0:
            save_hf_folder(path, self.hf_config, state, tokenizer, fmt)


class MegatronReference(MegatronModel, ReferenceBackend):
    """The frozen reference policy (KL penalty) beside a Megatron policy, laid out like it."""

    def __init__(self, policy: PolicyConfig, model_path: str, device: torch.device | None = None, *,
                 emulate_cuda: bool = False) -> None:
        super().__init__(policy, model_path, device, trainable=False, emulate_cuda=emulate_cuda)


def _finalize_without_token_scaling(finalize, model, num_tokens=None, **kwargs) -> None:
    finalize(model, None, **kwargs)


def _detached_metrics(metrics: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: metric.detach().float() for name, metric in metrics.items()}
