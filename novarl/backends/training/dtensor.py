"""The DTensor training backend: FSDP2 over data-parallel ranks, tensor parallelism
inside each data-parallel replica (see parallelize.py for the order of steps); on one
device, the plain module with FSDP2's mixed precision (one_device.py).

Every rank runs the same methods (they are collective). Ranks of one
tensor-parallel group see the same rows; data-parallel ranks split the rows of
each batch into contiguous shares.
"""

from __future__ import annotations

import dataclasses
import io
import math
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh

from novarl.algorithms.losses import LossFn
from novarl.backends.protocols import ReferenceBackend, TrainingBackend, WeightSender
from novarl.backends.training.batching import MicroBatching
from novarl.backends.training.one_device import OneDeviceWeights, ShardedWeights, one_device
from novarl.backends.training.rows import AccumulatingRows, DataParallelRows, check_packing
from novarl.backends.training.optim import build_optimizer, build_scheduler
from novarl.backends.training.parallelize import (
    ParallelDims,
    apply_activation_checkpointing,
    apply_compile,
    compiles,
    apply_fsdp,
    apply_tp,
    build_mesh,
    clip_grad_norm,
    partial_parameters,
    sum_partial_gradients,
    cp_group,
    decoder_layers,
    dp_group,
    fsdp_mesh,
    keeps_gathered,
)
from novarl.config.schema import PolicyConfig
from novarl.errors import UserError
from novarl.distributed.parking import Parking, gradients, module_tensors, optimizer_tensors, wakes
from novarl.distributed.weight_sync import bucketed, full_weights, in_dtype
from novarl.models.attention import use_varlen_attention
from novarl.models.context_parallel import use_context_parallel_attention
from novarl.models.loading import DTYPES, ExportFormat, load_causal_lm, parameters_in
from novarl.models.logprob_head import use_picking_head
from novarl.models.scores import Head, training_precision
from novarl.types import TrainBatch
from novarl.models.lora import BaseModelLogprobs, hf_weights, is_adapter, save_hf


class ShardedModel(DataParallelRows):
    """A Hugging Face causal LM parallelised on a device mesh, and its data-parallel place."""

    process_reusable = True
    """It leaves nothing in its rank's process once dropped and the process group destroyed: the
    process may serve another run's group (kept_ranks.REUSE_RANKS_VARIABLE)."""

    def __init__(self, policy: PolicyConfig, model_path: str, device: torch.device | None,
                 *, trainable: bool, seed: int = 0, value_head: bool = False) -> None:
        """value_head: the output head replaced by a scalar one before sharding (a critic)."""
        from novarl.distributed.local import default_device

        self.device = device or default_device()
        self.value_head = value_head
        dt = policy.dtensor_cfg
        dims = ParallelDims(dist.get_world_size(), dt.tensor_parallel_size, dt.context_parallel_size)
        self.mesh: DeviceMesh = build_mesh(self.device.type, dims)
        self.dp_group = dp_group(self.mesh)
        self.dp_rank, self.dp_size = dist.get_rank(self.dp_group), dims.data_parallel
        precision = training_precision(policy.precision, on_gpu=self.device.type == "cuda")
        model = load_causal_lm(model_path, dtype=torch.float32, trust_remote_code=policy.trust_remote_code)
        self.attention = use_varlen_attention(model)
        model.to(self.device)
        # sequence parallelism splits every row's tokens evenly over the tensor-parallel ranks
        # (context parallelism lays each sequence out to a multiple of 2 x cp itself: rows.py)
        multiple = math.lcm(policy.make_sequence_length_divisible_by,
                            dims.tensor_parallel if dt.sequence_parallel else 1)
        self.train_batching = MicroBatching.from_policy(policy, training=True, sequence_multiple=multiple)
        self.logprob_batching = MicroBatching.from_policy(policy, training=False, sequence_multiple=multiple)
        check_packing(model, self.attention, self.logprob_batching, self.device)  # before sharding
        self.context_group = cp_group(self.mesh)
        if self.context_group is not None:
            if dt.sequence_parallel or dt.custom_parallel_plan:
                raise UserError("policy.dtensor_cfg.context_parallel_size > 1 with sequence_parallel or a "
                                "custom_parallel_plan: novarl's context parallelism composes with the default "
                                "tensor-parallel plan without sequence parallelism only.")
            self.attention = use_context_parallel_attention(model)
            say_on_first_rank("context parallelism lays every sample's prompt out with it: "
                              "policy.sequence_packing.share_prompts does not apply",
                              when=self.train_batching.share_prompts and trainable)
            # micro-batches planned as they are laid out: each sample with its prompt
            self.train_batching = dataclasses.replace(self.train_batching, share_prompts=False)
            self.logprob_batching = dataclasses.replace(self.logprob_batching, share_prompts=False)
        if value_head:
            from novarl.models.critic import add_value_head

            add_value_head(model)
        self.lora = dt.lora_cfg if trainable and dt.lora_cfg.enabled and not value_head else None
        self.adapter_sync = trainable and policy.sends_adapter
        if self.lora is not None:  # adapters in place, before sharding: the layers keep their paths
            from novarl.models.lora import inject, trainable_summary

            adapted = inject(model, self.lora, seed)
            say_on_first_rank(trainable_summary(model, adapted, self.lora))
        if dims.tensor_parallel > 1:
            said = apply_tp(model, self.mesh["tp"], dt)
            say_on_first_rank(f"{'critic' if value_head else 'policy'}: {said}", when=trainable)
        if not value_head:  # after tensor parallelism: a head that a custom plan splits stays the plain one
            use_picking_head(model, policy.logprob_chunk_size)
        if trainable and dt.activation_checkpointing:
            apply_activation_checkpointing(model)
        if compiles(dt, model, self.device):
            apply_compile(model)
            say_on_first_rank("decoder layers compiled (policy.dtensor_cfg.torch_compile: on by default on CUDA; "
                              "the first steps compile)", when=trainable and dt.torch_compile is None)
        self.weights, self.keep_gathered = model_weights(model, self.mesh, DTYPES[precision], trainable,
                                                         cpu_offload=dt.cpu_offload)
        model.train(trainable)
        if self.lora is None:
            model.requires_grad_(trainable)
        self.model = model
        self.parking = Parking()

    def park(self, group: str, host_too: bool = False) -> int:
        """Implements Parkable (distributed/parking.py): the weights (parameters and buffers) to host memory;
        a frozen model has no optimizer state."""
        return self.parking.park(group, module_tensors(self.model), host_too=host_too) if group == "weights" else 0

    @torch.no_grad()
    @wakes("weights")
    def forward(self, batch: TrainBatch, head: Head) -> torch.Tensor:
        """DataParallelRows.forward, the gathered weights freed at its end: FSDP2 keeps the root's (and
        with keep_gathered every layer's) after a forward, for a backward that a no-grad pass never runs;
        on one device the compute-dtype copies are made for the pass. With the training pass's end
        (forward_backward) this is the one place that frees them: nothing stays gathered between calls
        (while another role or a colocated engine runs, or an optimizer step or a load changes the
        weights; a gathered module lists its copies, without grads, as its parameters)."""
        try:
            self.weights.gather()
            return super().forward(batch, head)
        finally:
            self.weights.release()


def say_on_first_rank(text: str, when: bool = True) -> None:
    """`text` on the console, from the group's first rank only, if `when`."""
    if when and dist.get_rank() == 0:
        from novarl.logging.console import info

        info(text)


def model_weights(model: torch.nn.Module, mesh: DeviceMesh, dtype: torch.dtype, trainable: bool, *,
                  cpu_offload: bool) -> tuple[OneDeviceWeights | ShardedWeights, bool]:
    """(the model's weights, whether FSDP2 keeps them gathered through a step): on one device the plain
    module's (one_device.py), else FSDP2's, applied here (parallelize.apply_fsdp). A frozen model (the KL
    reference) holds its parameters in the compute dtype: float32 masters serve only an optimizer, and the
    compute-dtype copies a pass would make of them are these same values (the policy's at step 0: the KL
    starts at 0), so it holds half the bytes in bf16 and FSDP2 gathers them with no cast (its buffers stay
    as loaded, as mixed precision leaves them)."""
    if not trainable:
        parameters_in(model, dtype)
    if one_device(dist.get_world_size(), cpu_offload):
        return OneDeviceWeights(model, dtype, decoder_layers(model)), False
    keep = keeps_gathered(trainable, fsdp_mesh(mesh), cpu_offload)
    apply_fsdp(model, fsdp_mesh(mesh), param_dtype=dtype, cpu_offload=cpu_offload, keep_gathered=keep)
    return ShardedWeights(model), keep


class TrainableShardedModel(ShardedModel, AccumulatingRows):
    """A sharded model that trains: its optimizer and schedule, accumulation, clipping, and its
    resumable state (DCP). The policy and the critic are each one."""

    def __init__(self, policy: PolicyConfig, model_path: str, device: torch.device | None = None,
                 *, total_steps: int, seed: int = 0, value_head: bool = False) -> None:
        super().__init__(policy, model_path, device, trainable=True, seed=seed,
                         value_head=value_head)
        self.policy = policy
        assert policy.optimizer is not None  # null only with Megatron (schema.py)
        self.optimizer = build_optimizer(policy.optimizer, [p for p in self.model.parameters() if p.requires_grad],
                                         self.device)
        self.scheduler = build_scheduler(policy.scheduler, self.optimizer, total_steps)
        # whole on every tensor-parallel rank, each rank's gradient a share (parallelize.partial_parameters:
        # Qwen3's query/key norms; on the default plans LoRA's A of column-split layers, and under sequence
        # parallelism the norms, o's and down's biases and LoRA's B of row-split layers)
        self.partial = partial_parameters(self.model, policy.dtensor_cfg)

    def park(self, group: str, host_too: bool = False) -> int:
        """Implements Parkable: the optimizer's state, or the weights (any gradient, none between steps, freed
        with them), to host memory."""
        if group == "optimizer":
            return self.parking.park(group, optimizer_tensors(self.optimizer), host_too=host_too)
        return self.parking.park(group, module_tensors(self.model), gradients(self.model), host_too=host_too)

    @wakes("weights")
    def forward_backward(self, batch: TrainBatch, loss: LossFn, head: Head) -> dict[str, float]:
        """AccumulatingRows.forward_backward, the gathered weights freed at its end (FSDP2's last backward
        has freed them already; on one device the copies made for the pass, their gradients added to the
        float32 parameters' as the backward made them)."""
        try:
            self.weights.gather()
            return super().forward_backward(batch, loss, head)
        finally:
            self.weights.release()

    def accumulation_boundary(self, last: bool) -> None:
        if isinstance(self.weights, OneDeviceWeights):
            return  # nothing to reduce: the gradients accumulate in the parameters' float32 ones
        self.model.set_requires_gradient_sync(last)
        if self.keep_gathered:  # the gathered weights serve the next micro-batch; the last backward frees them
            self.model.set_reshard_after_backward(last)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def gpu_stats(self) -> dict[str, float]:
        """Collective: this step's GPU memory (and utilisation) over the training ranks; {} without CUDA."""
        from novarl.distributed.gpu_monitor import gpu_stats

        return gpu_stats()

    @wakes("weights", "optimizer")
    def optim_step(self) -> dict[str, float]:
        """Clip, step the optimizer and scheduler, zero the gradients. The gradient norm is read last: on a
        GPU the host queues the whole step before it waits for the norm."""
        if self.partial:
            sum_partial_gradients(self.partial, self.mesh["tp"].get_group())
        grad_norm = clip_grad_norm(list(self.model.parameters()), self.policy.max_grad_norm)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": float(grad_norm), "lr": lr}

    @wakes("weights")
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: every rank calls it; rank 0 gets the full CPU tensors, the others {}."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return cast(dict[str, torch.Tensor], get_model_state_dict(self.model, options=options))

    def _state_options(self) -> StateDictOptions:
        """With LoRA, the adapters only: the frozen base weights come from the model folder."""
        return StateDictOptions(ignore_frozen_params=self.lora is not None, strict=self.lora is None)

    def _checkpointed(self, model_state: dict) -> dict:
        """The model tensors a checkpoint holds: all, or with LoRA the adapters (a tied output head
        is a frozen weight that torch's state dict still lists)."""
        return model_state if self.lora is None else {k: v for k, v in model_state.items() if ".lora_" in k}

    @wakes("weights", "optimizer")
    def save(self, path: Path) -> None:
        model_state, optim_state = get_state_dict(self.model, self.optimizer, options=self._state_options())
        model_state = self._checkpointed(model_state)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(path))
        if dist.get_rank() == 0:
            torch.save(self.scheduler.state_dict(), Path(path) / "scheduler.pt")
        dist.barrier()

    @wakes("weights", "optimizer")
    def load(self, path: Path) -> None:
        """Load a checkpoint written by `save` with any number of ranks (DCP reshards). Nothing is
        unpickled with weights_only=False (DCP's `.metadata` pickle is checked before: see
        novarl/trainer/checkpoint.py)."""
        options = self._state_options()
        model_state, optim_state = get_state_dict(self.model, self.optimizer, options=options)
        state = {"model": self._checkpointed(model_state), "optim": optim_state}
        dcp.load(state, checkpoint_id=str(path), planner=WeightsOnlyLoadPlanner())
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=options)
        self.scheduler.load_state_dict(torch.load(Path(path) / "scheduler.pt", weights_only=True))

    @wakes("weights")
    def load_weights(self, path: Path) -> None:
        """The model weights of a checkpoint written by `save`, and nothing else (no optimizer
        state is read): what `novarl convert` needs."""
        options = self._state_options()
        state = {"model": self._checkpointed(get_model_state_dict(self.model, options=options))}
        dcp.load(state, checkpoint_id=str(path), planner=WeightsOnlyLoadPlanner())
        set_model_state_dict(self.model, state["model"], options=options)


class DTensorPolicy(TrainableShardedModel, BaseModelLogprobs, TrainingBackend, WeightSender):
    """The trainable policy on the DTensor backend (implements TrainingBackend)."""

    @wakes("weights")
    def weight_buckets(self, bucket_bytes: int, *, everywhere: bool, dtype: torch.dtype | None = None
                       ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Implements WeightSender. Collective over the training ranks: full tensors under their
        Hugging Face names, on this rank's device, in buckets of at most bucket_bytes, each
        gathered from the shards when its turn comes; on every rank (everywhere) or on rank 0
        alone (the others take part in the gathers). Floating tensors cast to dtype if given."""
        state = cast(dict[str, torch.Tensor], get_model_state_dict(self.model))  # this rank's shards, own names
        keep = everywhere or dist.get_rank() == 0
        if self.adapter_sync:  # the adapters alone: the engines hold the frozen base already
            full = full_weights(((n, t) for n, t in state.items() if is_adapter(n)), keep)
        else:
            # cast before the gathers, where no LoRA is merged (merged in float32, then cast)
            full = hf_weights(full_weights(state.items(), keep, None if self.lora else dtype), self.lora)
        yield from bucketed(((name, in_dtype(t, dtype)) for name, t in full), bucket_bytes)

    def save_hf(self, path: Path, tokenizer, fmt: ExportFormat | None = None) -> None:
        """A consolidated Hugging Face folder that transformers and vLLM load as is."""
        state = self.full_state_dict()
        if dist.get_rank() == 0:
            save_hf(path, self.model.config, state, tokenizer, fmt, self.lora)


class DTensorCritic(TrainableShardedModel, TrainingBackend):
    """The value model of PPO (its critic) on the DTensor backend: a causal LM whose output head is
    a zero-initialised scalar (models/critic.py), sharded like the policy. Its head is Values()
    (models/scores.py): `forward(batch, Values())` is the batch's [N] values, each token's from
    its predecessor's hidden state (the state it is emitted from), 0 at each sequence's first
    token; `forward_backward(batch, value loss, Values())` trains them (algorithms/losses.py)."""

    def __init__(self, policy: PolicyConfig, model_path: str, device: torch.device | None = None,
                 *, total_steps: int, seed: int = 0) -> None:
        super().__init__(policy, model_path, device, total_steps=total_steps, seed=seed,
                         value_head=True)

    def save_hf(self, path: Path, tokenizer, fmt: ExportFormat | None = None) -> None:
        """A Hugging Face token-classification folder (one label: the value; models/critic.py)."""
        from novarl.models.critic import save_critic_hf

        state = self.full_state_dict()
        if dist.get_rank() == 0:
            save_critic_hf(path, self.model.config, state, tokenizer, fmt)


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, but the non-tensor items (the optimizer's hyper-parameters: numbers,
    bools, tuples) are unpickled with weights_only=True; DCP's own `load_bytes` uses False."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        checked = io.BytesIO()
        torch.save(torch.load(value, weights_only=True), checked)  # refuses anything but plain data
        checked.seek(0)
        super().load_bytes(read_item, checked)


class DTensorReference(ShardedModel, ReferenceBackend):
    """The frozen reference policy (KL penalty) on the DTensor backend."""

    def __init__(self, policy: PolicyConfig, model_path: str, device: torch.device | None = None) -> None:
        super().__init__(policy, model_path, device, trainable=False)
