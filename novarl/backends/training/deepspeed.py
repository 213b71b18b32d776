"""The DeepSpeed ZeRO training backend: stages 0 (plain data parallel), 1, 2 and 3, CPU offload, bf16.

Same contract as the DTensor backend (TrainingBackend) and the same Ray worker
groups: every rank runs each method; data-parallel ranks split each batch into
contiguous shares (rows.py). ZeRO partitions, over the data-parallel ranks,
the optimizer state (stage 1), and the gradients (2), and the parameters (3).

- Precision: `policy.precision: bfloat16` keeps bf16 weights for the forward and
  backward and fp32 master weights in the optimizer; float32 trains in fp32.
- Accumulation: each optimizer step's micro-batches on a rank accumulate
  gradients, reduced once, at the last one (the accumulation boundary is set
  explicitly, so a short last chunk is handled the same way as DTensor's).
- Clipping: `policy.max_grad_norm` becomes DeepSpeed's `gradient_clipping`.
- Offload: `deepspeed_cfg.offload_optimizer` keeps the optimizer state and step
  on the CPU (from GPUs, DeepSpeed's CPU Adam, a C++ op built on first use: see
  ops.py; on a CPU host, torch's AdamW, with no op to build); `offload_param`
  (stage 3) keeps the parameters there too.
- `deepspeed_cfg.torch_compile`: each decoder layer compiled before the engine
  wraps the model (prepare_layers), stages 0-2; off by default until measured
  on a GPU.
- The frozen reference: below stage 3 a copy with no engine, its weights in the
  compute dtype and its buffers as the engine leaves them, so it computes as the
  policy does before its first update.
- `deepspeed_cfg.config` is merged over the config built here, for any
  DeepSpeed key novarl does not set (see `deepspeed_config`).

DeepSpeed is imported in this module only.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from novarl.algorithms.losses import LossFn
from novarl.backends.protocols import ReferenceBackend, TrainingBackend, WeightSender
from novarl.backends.training.optim import build_optimizer, build_scheduler
from novarl.backends.training.batching import MicroBatching
from novarl.backends.training.deepspeed_checkpoint import CHECKPOINT_TAG  # <role>/deepspeed/, no `latest` file beside
from novarl.backends.training.rows import AccumulatingRows, DataParallelRows, check_packing
from novarl.backends.training.parallelize import apply_activation_checkpointing, apply_compile
from novarl.config.schema import PolicyConfig
from novarl.distributed.parking import Parking, held_tensors, module_tensors, wakes
from novarl.distributed.weight_sync import bucketed, in_dtype
from novarl.errors import ConfigError
from novarl.models.attention import use_varlen_attention
from novarl.models.logprob_head import use_picking_head
from novarl.models.loading import ExportFormat, load_causal_lm, parameters_in
from novarl.models.scores import Head, training_precision
from novarl.models.lora import BaseModelLogprobs, hf_weights, is_adapter, save_hf
from novarl.types import TrainBatch


def deepspeed_config(policy: PolicyConfig, *, world_size: int, accumulation_steps: int, on_gpu: bool,
                     hidden_size: int) -> dict[str, Any]:
    """The DeepSpeed JSON config for `policy`, with `deepspeed_cfg.config` merged over it.

    Communication buckets are sized to the model like the Hugging Face integration's
    "auto" values (hidden_size^2 elements): DeepSpeed's default, 5e8 elements, would hold
    2 GB of fp32 buckets whatever the model's size."""
    ds = policy.deepspeed_cfg
    precision = training_precision(policy.precision, on_gpu=on_gpu)
    bucket = int(min(5e8, max(5e5, hidden_size**2)))
    zero: dict[str, Any] = {"stage": ds.zero_stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket}
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": on_gpu}
        # on a CPU host the training is on the CPU already: torch's AdamW steps it (build_deepspeed_optimizer)
        extra_top = {} if on_gpu else {"zero_force_ds_cpu_optimizer": False}
    else:
        extra_top = {}
    if ds.offload_param:
        if ds.zero_stage != 3:
            raise ConfigError(f"policy.deepspeed_cfg.offload_param needs zero_stage 3 (it is {ds.zero_stage}): "
                              "only stage 3 partitions the parameters.")
        zero["offload_param"] = {"device": "cpu", "pin_memory": on_gpu}
    if ds.zero_stage == 3:
        # Gather each layer's parameters as it runs, and release them after; keep none resident.
        zero.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=int(0.9 * bucket),
                    stage3_max_live_parameters=bucket, stage3_max_reuse_distance=bucket)
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": policy.train_micro_batch_size,
        "gradient_accumulation_steps": accumulation_steps,
        "train_batch_size": policy.train_micro_batch_size * accumulation_steps * world_size,
        "gradient_clipping": policy.max_grad_norm or 0.0,
        "zero_optimization": zero,
        "bf16": {"enabled": precision == "bfloat16"},
        "fp16": {"enabled": precision == "float16"},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
        **extra_top,
    }
    return _merge(config, ds.config or {})


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        merged[key] = _merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) \
            else value
    return merged


class DeepSpeedModel(DataParallelRows):
    """A Hugging Face causal LM in a DeepSpeed engine, one data-parallel rank of it."""

    process_reusable = True
    """Once dropped, with the process group destroyed and DeepSpeed's groups let go of (`leave_process`), its
    rank's process may serve another run's group (kept_ranks.REUSE_RANKS_VARIABLE)."""

    def leave_process(self) -> None:
        """DeepSpeed's process-wide groups let go of, as in a new process (their world is being destroyed)."""
        _forget_groups_of_a_destroyed_world()
        _deepspeeds_world.clear()

    engine: Any
    """The DeepSpeedEngine; None for a frozen copy below ZeRO-3 (its parameters whole, nothing to gather)."""
    optimizer: torch.optim.Optimizer | None
    scheduler: torch.optim.lr_scheduler.LRScheduler | None

    def __init__(self, policy: PolicyConfig, model_path: str, device: torch.device | None, *, trainable: bool,
                 accumulation_steps: int = 1, total_steps: int = 1, seed: int = 0,
                 value_head: bool = False) -> None:
        """value_head: the output head replaced by a scalar one before the engine (a critic)."""
        from novarl.distributed.local import default_device

        self.device = device or default_device()
        self.parking = Parking()
        deepspeed = join_deepspeed(self.device)
        self.value_head = value_head
        self.dp_group = dist.group.WORLD
        self.dp_rank, self.dp_size = dist.get_rank(), dist.get_world_size()
        multiple = policy.make_sequence_length_divisible_by
        self.train_batching = MicroBatching.from_policy(policy, training=True, sequence_multiple=multiple)
        self.logprob_batching = MicroBatching.from_policy(policy, training=False, sequence_multiple=multiple)
        self.zero_stage = policy.deepspeed_cfg.zero_stage
        model = load_causal_lm(model_path, dtype=torch.float32, trust_remote_code=policy.trust_remote_code)
        self.attention = use_varlen_attention(model)
        config: dict[str, Any] | None = deepspeed_config(
            policy, world_size=self.dp_size, accumulation_steps=accumulation_steps, on_gpu=self.device.type == "cuda",
            hidden_size=getattr(model.config, "hidden_size", None) or 4096)
        check_packing(model, self.attention, self.logprob_batching, torch.device("cpu"))  # before the engine
        if value_head:
            from novarl.models.critic import add_value_head

            add_value_head(model)
        lora = policy.dtensor_cfg.lora_cfg
        self.lora = lora if trainable and lora.enabled and not value_head else None
        self.adapter_sync = trainable and policy.sends_adapter
        if self.lora is not None:  # adapters in place, before the engine: the optimizer gets them alone
            from novarl.models.lora import inject, trainable_summary

            adapted = inject(model, self.lora, seed)
            if self.dp_rank == 0:
                from novarl.logging.console import info

                info(trainable_summary(model, adapted, self.lora))
        else:
            model.requires_grad_(trainable)
        prepare_layers(model, policy, trainable=trainable, value_head=value_head, device=self.device)
        model.train(trainable)
        self.optimizer = self.scheduler = None
        if trainable:
            self.optimizer = build_deepspeed_optimizer(policy, [p for p in model.parameters() if p.requires_grad],
                                                       on_gpu=self.device.type == "cuda")
            self.scheduler = build_scheduler(policy.scheduler, self.optimizer, total_steps)
        elif self.zero_stage != 3:  # a frozen copy needs no engine unless its parameters are partitioned
            config = None
        if config is None:  # its weights in the engine's compute dtype, its buffers (rotary tables) as the engine's
            self.engine = None
            parameters_in(model, _dtype(policy, self.device))  # on the host: no float32 copy on the device
            self.model = model.to(self.device)
            return
        try:
            self.engine, *_ = deepspeed.initialize(model=model, optimizer=self.optimizer,
                                                   lr_scheduler=self.scheduler, config=config)
        except (ValueError, AssertionError, KeyError) as err:
            raise ConfigError(f"DeepSpeed refused its config (policy.deepspeed_cfg, with deepspeed_cfg.config "
                              f"merged over it): {err}") from None
        self.model = self.engine  # called like the module; ZeRO-3 gathers parameters on the way
        if self.lora is not None:
            _drop_every_frozen_name(self.engine)

    def park(self, group: str, host_too: bool = False) -> int:
        """Implements Parkable (distributed/parking.py): the weights (the module's parameters and buffers, under
        ZeRO-3 each parameter's partitions), or everything else the engine's optimizer holds (ZeRO's fp32
        partitions, flat buffers, gradient buckets and state, found by held_tensors), to host memory. DeepSpeed
        keeps the gradient buckets that a pass fills among its optimizer's own, so a pass wakes both groups; the
        weight sync wakes the weights alone."""
        module = self.model if self.engine is None else self.engine.module
        weights = [*module_tensors(module), *zero3_partitions(module)]
        if group == "weights":
            return self.parking.park(group, weights, host_too=host_too)
        if self.engine is None:
            return 0
        return self.parking.park(group, held_tensors(self.engine.optimizer), besides=weights, host_too=host_too)

    @wakes()
    def forward(self, batch: TrainBatch, head: Head) -> torch.Tensor:
        return super().forward(batch, head)

    @wakes("weights")
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: every rank calls it; rank 0 gets the full CPU tensors (Hugging Face
        names), the others {}. Stage 3 gathers each partitioned parameter in turn."""
        module = self.engine.module if self.engine is not None else self.model
        full: dict[str, torch.Tensor] = {}
        if self.zero_stage == 3 and self.engine is not None:
            import deepspeed

            for name, param in module.named_parameters():
                with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                    if self.dp_rank == 0:
                        full[name] = param.detach().to("cpu", copy=True)
            for name, buffer in module.named_buffers():
                if self.dp_rank == 0 and name in module.state_dict():
                    full[name] = buffer.detach().to("cpu", copy=True)
            if self.dp_rank == 0:  # tied weights share one parameter: add the other names
                state = module.state_dict(keep_vars=True)
                by_id = {id(p): n for n, p in module.named_parameters()}
                for name, tensor in state.items():
                    if name not in full and id(tensor) in by_id:
                        full[name] = full[by_id[id(tensor)]]
            return full
        if self.dp_rank != 0:
            return {}
        return {name: tensor.detach().to("cpu", copy=True) for name, tensor in module.state_dict().items()}


class TrainableDeepSpeedModel(DeepSpeedModel, AccumulatingRows):
    """A DeepSpeed engine that trains: accumulation, clipping, the optimizer's step and the
    engine's resumable state. The policy and the critic are each one."""

    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler

    def __init__(self, policy: PolicyConfig, model_path: str, device: torch.device | None = None, *,
                 total_steps: int, accumulation_steps: int = 1, seed: int = 0,
                 value_head: bool = False) -> None:
        super().__init__(policy, model_path, device, trainable=True,
                         accumulation_steps=accumulation_steps, total_steps=total_steps, seed=seed,
                         value_head=value_head)

    @wakes()
    def forward_backward(self, batch: TrainBatch, loss: LossFn, head: Head) -> dict[str, float]:
        return super().forward_backward(batch, loss, head)

    def accumulation_boundary(self, last: bool) -> None:
        self.engine.set_gradient_accumulation_boundary(last)

    def backward(self, loss: torch.Tensor) -> None:
        # the loss is already the step's mean: no division by the accumulation steps
        self.engine.backward(loss, scale_wrt_gas=False)

    def gpu_stats(self) -> dict[str, float]:
        """Collective: this step's GPU memory (and utilisation) over the training ranks; {} without CUDA."""
        from novarl.distributed.gpu_monitor import gpu_stats

        return gpu_stats()

    @wakes()
    def optim_step(self) -> dict[str, float]:
        """Clip (gradient_clipping), step the optimizer and the schedule, zero the gradients.
        grad_norm: the norm of the step's reduced gradients before clipping."""
        lr = self.optimizer.param_groups[0]["lr"]
        # DeepSpeed keeps the norm its ZeRO and bf16/fp16 optimizers compute; ZeRO stage 0 in fp32 steps the
        # plain torch optimizer and keeps none: measured here, on the gradients it has already all-reduced
        own = None if hasattr(self.engine.optimizer, "_global_grad_norm") else self._gradient_norm()
        self.engine.step()
        grad_norm = self.engine.get_global_grad_norm() if own is None else own
        grad_norm = float(grad_norm) if grad_norm is not None else math.nan
        return {"grad_norm": grad_norm, "lr": lr}

    def _gradient_norm(self) -> float:
        """The 2-norm of every gradient of the module (whole on each rank: ZeRO stage 0)."""
        grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
        return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0

    @wakes()
    def save(self, path: Path) -> None:
        """The engine's partitioned state (weights, optimizer, schedule) under path/deepspeed/;
        with LoRA the adapters alone (the frozen base comes from the model folder). Resuming
        needs the same number of ranks."""
        self.engine.save_checkpoint(str(path), tag=CHECKPOINT_TAG, save_latest=False,
                                    exclude_frozen_parameters=self.lora is not None)
        dist.barrier()

    @wakes()
    def load(self, path: Path) -> None:
        load_path, _ = self.engine.load_checkpoint(str(path), tag=CHECKPOINT_TAG, load_optimizer_states=True,
                                                   load_lr_scheduler_states=True,
                                                   load_module_strict=self.lora is None)
        if load_path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint in {path / CHECKPOINT_TAG}")


class DeepSpeedPolicy(TrainableDeepSpeedModel, BaseModelLogprobs, TrainingBackend, WeightSender):
    """The trainable policy on DeepSpeed ZeRO (implements TrainingBackend)."""

    @wakes("weights")
    def weight_buckets(self, bucket_bytes: int, *, everywhere: bool, dtype: torch.dtype | None = None
                       ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Implements WeightSender. Collective over the ranks: full tensors (Hugging Face names)
        in buckets of at most bucket_bytes, on every rank (everywhere) or on rank 0 alone.
        Stage 3 gathers one bucket's partitioned parameters at a time; below stage 3 every
        rank holds them whole already. LoRA layers merged (in float32), then floating tensors
        cast to dtype if given."""
        keep = everywhere or self.dp_rank == 0
        if self.adapter_sync:  # the adapters alone: the engines hold the frozen base already
            full = self._full_tensors(bucket_bytes, keep, wanted=is_adapter)
        else:
            full = hf_weights(self._full_tensors(bucket_bytes, keep), self.lora)
        yield from bucketed(((name, in_dtype(tensor, dtype)) for name, tensor in full), bucket_bytes)

    def _full_tensors(self, bucket_bytes: int, keep: bool, wanted=lambda name: True
                      ) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective: the module's full tensors in order (the `wanted` names; on this rank if
        keep); under stage 3 gathered a bucket's worth of parameters at a time, and copied out
        before release."""
        module = self.engine.module if self.engine is not None else self.model
        state = {name: tensor for name, tensor in module.state_dict(keep_vars=True).items() if wanted(name)}
        if not (self.zero_stage == 3 and self.engine is not None):
            if keep:
                yield from ((name, tensor.detach()) for name, tensor in state.items())
            return
        import deepspeed

        def nbytes(tensor: torch.Tensor) -> int:
            return getattr(tensor, "ds_numel", tensor.numel()) * tensor.element_size()

        names = list(state)
        while names:
            chunk: list[str] = []
            size = 0
            while names and (not chunk or size + nbytes(state[names[0]]) <= bucket_bytes):
                chunk.append(names.pop(0))
                size += nbytes(state[chunk[-1]])
            params = list({id(state[n]): state[n] for n in chunk if hasattr(state[n], "ds_id")}.values())
            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                gathered = [(name, state[name].detach().clone()) for name in chunk] if keep else []
            yield from gathered

    def save_hf(self, path: Path, tokenizer, fmt: ExportFormat | None = None) -> None:
        """A consolidated Hugging Face folder (in `fmt`: fp32 by default), from any ZeRO stage."""
        state = self.full_state_dict()
        if self.dp_rank == 0:
            save_hf(path, self.engine.module.config, state, tokenizer, fmt, self.lora)


class DeepSpeedCritic(TrainableDeepSpeedModel, TrainingBackend):
    """PPO's value model on DeepSpeed ZeRO: a causal LM with a zero-initialised scalar head
    (models/critic.py) in its own engine, partitioned like the policy. As on DTensor
    (dtensor.py DTensorCritic), its head is Values()."""

    def __init__(self, policy: PolicyConfig, model_path: str, device: torch.device | None = None, *,
                 total_steps: int, accumulation_steps: int = 1, seed: int = 0) -> None:
        super().__init__(policy, model_path, device, total_steps=total_steps,
                         accumulation_steps=accumulation_steps, seed=seed, value_head=True)

    def save_hf(self, path: Path, tokenizer, fmt: ExportFormat | None = None) -> None:
        """A Hugging Face token-classification folder (one label: the value; models/critic.py)."""
        from novarl.models.critic import save_critic_hf

        state = self.full_state_dict()
        if self.dp_rank == 0:
            save_critic_hf(path, self.engine.module.config, state, tokenizer, fmt)


class DeepSpeedReference(DeepSpeedModel, ReferenceBackend):
    """The frozen reference policy (KL penalty) beside a DeepSpeed policy: partitioned
    like it under ZeRO-3, a plain replica otherwise."""

    def __init__(self, policy: PolicyConfig, model_path: str, device: torch.device | None = None) -> None:
        super().__init__(policy, model_path, device, trainable=False)


def zero3_partitions(module: torch.nn.Module) -> list[torch.Tensor]:
    """ZeRO-3's partitions of the module's parameters (ds_tensor, and ds_secondary_tensor where ZeRO++ keeps
    one): where a partitioned parameter's weights are, its own storage empty. None below stage 3."""
    return [part for param in module.parameters()
            for part in (getattr(param, "ds_tensor", None), getattr(param, "ds_secondary_tensor", None))
            if isinstance(part, torch.Tensor)]


_deepspeeds_world: list[Any] = []
"""The torch.distributed world DeepSpeed last joined in this process (DeepSpeed keeps its groups process-wide)."""


def join_deepspeed(device: torch.device):
    """`deepspeed`, its communication joined to this process's torch.distributed world.

    DeepSpeed keeps groups it made from the world (a clone of it, the data-parallel group) for the
    process's life, and lets go of them only when the world is destroyed through DeepSpeed's own
    destroy_process_group. Where something else destroyed that world and a new one was made (vLLM in
    the same process ends its engine so; or a user's code), DeepSpeed's next engine would use the
    dead world's groups ("Group ... is not registered"): they are let go of here first."""
    from novarl.backends.training.ops import deepspeed_environment, skip_shared_memory_op

    if not dist.is_initialized():
        raise RuntimeError("the DeepSpeed backend needs the process group joined first")
    deepspeed_environment()
    import deepspeed

    # DeepSpeed's own collectives use a name torch has deprecated; not the user's to fix.
    warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.* is deprecated", category=FutureWarning)
    # DeepSpeed's CUDA accelerator reads the launcher's LOCAL_RANK; a Ray rank has it set (ray_group.py),
    # one in-process rank (the driver) may not: its device's index
    os.environ.setdefault("LOCAL_RANK", str(device.index or 0))
    skip_shared_memory_op(device)
    world = dist.group.WORLD
    if _deepspeeds_world and _deepspeeds_world[0] is not world:
        _forget_groups_of_a_destroyed_world()
    _deepspeeds_world[:] = [world]
    deepspeed.init_distributed(dist_backend=dist.get_backend())
    return deepspeed


def _forget_groups_of_a_destroyed_world() -> None:
    """DeepSpeed's process-wide groups let go of, as its destroy_process_group does after the world's end
    (deepspeed.utils.groups._release_process_group_references, DeepSpeed 0.19.8 on). An earlier DeepSpeed
    (0.18-0.19.7, which novarl takes too) has no such function but keeps the same module-level names: they
    are set back to their first values here."""
    import sys

    from deepspeed.utils import groups

    release = getattr(groups, "_release_process_group_references", None)
    if release is not None:
        release(group=None)
        return
    for name, first in _DEEPSPEED_GROUPS.items():
        if isinstance(first, dict) and isinstance(getattr(groups, name, None), dict):
            getattr(groups, name).clear()
        elif hasattr(groups, name):
            setattr(groups, name, first)
    sequence_parallel = sys.modules.get("deepspeed.runtime.sequence_parallel.parallel_state_sp")
    for name in ("_SEQUENCE_PARALLEL_GROUP", "_SEQUENCE_DATA_PARALLEL_GROUP"):
        if sequence_parallel is not None and hasattr(sequence_parallel, name):
            setattr(sequence_parallel, name, None)


_DEEPSPEED_GROUPS: dict[str, Any] = {
    **dict.fromkeys(("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
                     "_EXPERT_DATA_PARALLEL_GROUP_RANKS", "_ALL_TO_ALL_GROUP"), {}),
    **dict.fromkeys(("_WORLD_GROUP", "_ZERO_PARAM_INTRA_PARALLEL_GROUP", "_TENSOR_MODEL_PARALLEL_GROUP",
                     "_MODEL_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP", "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE",
                     "_MPU_TENSOR_MODEL_PARALLEL_RANK", "mpu", "mesh_device"), None),
    "expert_tensor_parallel_world_size": 1,
}
"""deepspeed.utils.groups' process-wide names (0.18-0.19.8) and their values when the module is first imported."""


def _drop_every_frozen_name(engine) -> None:
    """Make the engine's checkpoints leave out every name of a frozen parameter. DeepSpeed's
    exclude_frozen_parameters drops each by its first name only, so a tied head (lm_head.weight,
    the embeddings under a second name) would be saved whole in every LoRA checkpoint."""
    own = engine.module_state_dict

    def module_state_dict(*args, exclude_frozen_parameters: bool = False, **kwargs):
        state = own(*args, exclude_frozen_parameters=exclude_frozen_parameters, **kwargs)
        if exclude_frozen_parameters:
            for name, param in engine.module.named_parameters(remove_duplicate=False):
                if not param.requires_grad:
                    state.pop(name, None)
        return state

    engine.module_state_dict = module_state_dict


def prepare_layers(model: torch.nn.Module, policy: PolicyConfig, *, trainable: bool, value_head: bool,
                   device: torch.device) -> None:
    """The model's layers as the engine takes them: the picking head (its chunk steps compiled on CUDA, as
    Megatron's, or with the layers), activation checkpointing, and with deepspeed_cfg.torch_compile each decoder
    layer compiled (parallelize.apply_compile, after the checkpointing, as DTensor's: the same layers)."""
    if not value_head:
        use_picking_head(model, policy.logprob_chunk_size, fused=device.type == "cuda")
    if trainable and policy.deepspeed_cfg.activation_checkpointing:
        apply_activation_checkpointing(model)
    if policy.deepspeed_cfg.torch_compile:
        apply_compile(model)


def build_deepspeed_optimizer(policy: PolicyConfig, params, *, on_gpu: bool) -> torch.optim.Optimizer:
    """The configured torch optimizer; with optimizer offload from a GPU, DeepSpeed's CPU Adam(W)
    with the same hyper-parameters (DeepSpeed steps offloaded state with its own kernel). On a
    CPU host the training is on the CPU already: torch's optimizer steps the offloaded state,
    and no C++ op is built."""
    optimizer = policy.optimizer
    assert optimizer is not None  # null only with Megatron (schema.py)
    device = torch.device("cuda" if on_gpu else "cpu")  # the device it steps on: torch's fused kernel there
    if not policy.deepspeed_cfg.offload_optimizer:
        return build_optimizer(optimizer, params, device)
    name = optimizer.name.removeprefix("torch.optim.")
    if name not in ("Adam", "AdamW"):
        raise ConfigError(f"policy.deepspeed_cfg.offload_optimizer steps Adam or AdamW on the CPU; "
                          f"policy.optimizer.name is {optimizer.name}.")
    if not on_gpu:
        return build_optimizer(optimizer, params, device)
    from novarl.backends.training.ops import cpu_adam

    kwargs = dict(optimizer.kwargs)
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    kwargs.pop("foreach", None)
    kwargs.pop("fused", None)
    return cpu_adam()(params, adamw_mode=name == "AdamW", **kwargs)


def _dtype(policy: PolicyConfig, device: torch.device) -> torch.dtype:
    from novarl.models.loading import DTYPES

    return DTYPES[training_precision(policy.precision, on_gpu=device.type == "cuda")]
