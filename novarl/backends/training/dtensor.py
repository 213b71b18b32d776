"""The DTensor training backend: FSDP2 (`fully_shard`) over a device mesh.

Parallelism is applied in a fixed order, each step a short function:
activation checkpointing, then `apply_fsdp` (each decoder layer, then the
root). Tensor/context parallelism arrive with the multi-rank work; until then
`novarl.plan` refuses sizes > 1 before anything is built.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from novarl.algorithms.losses import LossFn
from novarl.config.schema import PolicyConfig
from novarl.models.loading import DTYPES, load_causal_lm, token_logprobs
from novarl.backends.training.optim import build_optimizer, build_scheduler
from novarl.types import TrainBatch


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a Hugging Face causal LM (Llama/Qwen2/Mistral layout)."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no .model.layers: cannot shard it per layer")
    return list(layers)


def apply_activation_checkpointing(model: torch.nn.Module) -> None:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def apply_fsdp(model: torch.nn.Module, mesh: DeviceMesh, *, param_dtype: torch.dtype,
               cpu_offload: bool) -> None:
    """Shard each decoder layer, then the root (embeddings, norm, head)."""
    kwargs: dict = {"mesh": mesh}
    if param_dtype != torch.float32:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)


def build_sharded_model(policy: PolicyConfig, model_path: str, device: torch.device,
                        *, trainable: bool) -> torch.nn.Module:
    """Load the HF model in fp32 master weights and shard it with FSDP2 on a 1-D mesh."""
    precision = policy.precision or ("bfloat16" if device.type == "cuda" else "float32")
    model = load_causal_lm(model_path, dtype=torch.float32, trust_remote_code=policy.trust_remote_code)
    model.to(device)
    if trainable and policy.dtensor_cfg.activation_checkpointing:
        apply_activation_checkpointing(model)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("dp",))
    apply_fsdp(model, mesh, param_dtype=DTYPES[precision], cpu_offload=policy.dtensor_cfg.cpu_offload)
    model.train(trainable)
    model.requires_grad_(trainable)
    return model


def data_parallel_shard(batch: TrainBatch) -> TrainBatch:
    """This rank's contiguous share of the rows (the batch divides evenly: see plan_batches)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    if len(batch) % size:
        raise ValueError(f"{len(batch)} rows do not split over {size} data-parallel ranks")
    share = len(batch) // size
    return batch.slice(rank * share, (rank + 1) * share)


@torch.no_grad()
def batched_logprobs(model: torch.nn.Module, batch: TrainBatch, micro_batch_size: int,
                     temperature: float) -> torch.Tensor:
    """[B, L] logprobs of the whole batch: each rank computes its shard, then all-gather."""
    local = data_parallel_shard(batch)
    out = []
    for start in range(0, len(local), micro_batch_size):
        mb = local.slice(start, start + micro_batch_size)
        logits = model(input_ids=mb.input_ids.to(_device(model)),
                       attention_mask=mb.attention_mask.to(_device(model))).logits
        out.append((token_logprobs(logits, mb.input_ids.to(logits.device), temperature)
                    * mb.attention_mask.to(logits.device)).cpu())
    mine = torch.cat(out)
    if dist.get_world_size() == 1:
        return mine
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, mine.to(_comm_device()))  # gloo on CPU, NCCL on GPU
    return torch.cat([p.cpu() for p in parts])


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _comm_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _to(batch: TrainBatch, device: torch.device) -> TrainBatch:
    if device.type == "cpu":
        return batch
    moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in vars(batch).items()}
    moved["extras"] = {k: v.to(device) for k, v in batch.extras.items()}
    return TrainBatch(**moved)


class DTensorPolicy:
    """The trainable policy on the DTensor backend (implements TrainingBackend)."""

    def __init__(self, policy: PolicyConfig, model_path: str, device: torch.device | None = None,
                 *, total_steps: int, temperature: float) -> None:
        from novarl.distributed.local import default_device

        device = device or default_device()
        self.policy = policy
        self.device = device
        self.temperature = temperature
        self.model = build_sharded_model(policy, model_path, device, trainable=True)
        self.optimizer = build_optimizer(policy.optimizer, self.model.parameters())
        self.scheduler = build_scheduler(policy.scheduler, self.optimizer, total_steps)
        self.micro_batch_size = policy.train_micro_batch_size
        self.logprob_batch_size = policy.logprob_batch_size or policy.train_micro_batch_size

    def forward_backward(self, batch: TrainBatch, loss: LossFn) -> dict[str, float]:
        """Accumulate gradients of `loss` over `batch` in micro-batches; metrics summed."""
        local = data_parallel_shard(batch)
        totals: dict[str, torch.Tensor] = {}
        starts = range(0, len(local), self.micro_batch_size)
        for i, start in enumerate(starts):
            mb = _to(local.slice(start, start + self.micro_batch_size), self.device)
            self.model.set_requires_gradient_sync(i == len(starts) - 1)
            logits = self.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
            value, metrics = loss(token_logprobs(logits, mb.input_ids, self.temperature), mb)
            # Each rank's loss is already its share of the step's mean (algorithms/losses.py),
            # so gradients must be summed over ranks; FSDP2 averages them, hence the factor.
            (value * dist.get_world_size()).backward()
            for name, metric in metrics.items():
                totals[name] = totals.get(name, 0.0) + metric.detach().float()
        names = sorted(totals)
        summed = torch.stack([totals[n] for n in names]).to(_comm_device())
        dist.all_reduce(summed)  # every rank's share adds up to the step's value
        return dict(zip(names, summed.tolist()))

    def optim_step(self) -> dict[str, float]:
        """Clip, step the optimizer and scheduler, zero the gradients."""
        max_norm = self.policy.max_grad_norm
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), max_norm if max_norm else math.inf)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": float(grad_norm), "lr": lr}

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """[B, L] logprobs of batch.input_ids under the current weights (0 on padding)."""
        return batched_logprobs(self.model, batch, self.logprob_batch_size, self.temperature)

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (unsharded) tensors under their Hugging Face names, on the CPU (rank 0 only)."""
        yield from self.full_state_dict().items()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: every rank calls it; rank 0 gets the full CPU tensors, the others {}."""
        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def save(self, path: Path) -> None:
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(path))
        if dist.get_rank() == 0:
            torch.save(self.scheduler.state_dict(), Path(path) / "scheduler.pt")
        dist.barrier()

    def load(self, path: Path) -> None:
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        self.scheduler.load_state_dict(torch.load(Path(path) / "scheduler.pt", weights_only=True))

    def save_hf(self, path: Path, tokenizer) -> None:
        """A consolidated Hugging Face folder that transformers and vLLM load as is."""
        state = dict(self.named_weights())
        if dist.get_rank() != 0:
            return
        config = self.model.config
        with torch.device("meta"):
            from transformers import AutoModelForCausalLM

            plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(state, strict=True, assign=True)
        plain.tie_weights()
        plain.save_pretrained(path, safe_serialization=True)
        tokenizer.save_pretrained(path)


class DTensorReference:
    """The frozen reference policy (KL penalty) on the DTensor backend."""

    def __init__(self, policy: PolicyConfig, model_path: str, device: torch.device | None = None,
                 *, temperature: float) -> None:
        from novarl.distributed.local import default_device

        device = device or default_device()
        self.model = build_sharded_model(policy, model_path, device, trainable=False)
        self.batch_size = policy.logprob_batch_size or policy.train_micro_batch_size
        self.temperature = temperature

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return batched_logprobs(self.model, batch, self.batch_size, self.temperature)
