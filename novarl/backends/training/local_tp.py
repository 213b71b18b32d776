"""Tensor parallelism of a decoder layer with local tensors inside: the default Llama-family plan without sequence
parallelism, in a form torch.compile traces whatever the sequence length.

torch's ColwiseParallel and RowwiseParallel run each linear on DTensors: the input made a Replicate DTensor, the
output made local again. Compiled, such a layer failed to trace its training pass once a micro-batch's length
differed from the first one's (torch 2.13, two CPU ranks: the backward's view of the split activations recursed
without end). Here the same weights (DTensors, split as torch's styles split them: q/k/v, gate and up by output
rows, o and down by input columns; checkpoints, exports and weight syncs read them as before) are read as their
local shards inside the layer, and the two collectives of a layer are explicit (Megatron-LM's form):

- at the attention's and the MLP's input, the activations are the same on every tensor-parallel rank; the
  backward sums their gradients over the ranks (`_SumGradients`: one all-reduce per block, where torch's styles
  all-reduce the input gradient of each of q, k and v, and of gate and up);
- after o and down, each rank's partial output is summed (`_SumOutputs`, an all-reduce; the backward passes the
  gradient on as it is).

Everything in the layer is then plain tensors and functional collectives, which dynamo traces with symbolic
lengths. The numbers are eager tensor parallelism's up to float rounding (tests/test_distributed.py).
Sequence parallelism, LoRA adapters in the layers and custom plans keep torch's styles (parallelize.apply_tp).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from novarl.errors import UserError


def _waited(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.wait() if isinstance(tensor, funcol.AsyncCollectiveTensor) else tensor


class _SumGradients(torch.autograd.Function):
    """Forward: the activations as they are (the same on every rank); backward: their gradient summed over the
    tensor-parallel group (each rank's holds its heads' or columns' share)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _waited(funcol.all_reduce(grad, "sum", ctx.group)), None


class _SumOutputs(torch.autograd.Function):
    """Forward: each rank's partial output summed over the tensor-parallel group; backward: the gradient as it is
    (the sum's gradient is the same for every rank's part)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        return _waited(funcol.all_reduce(x, "sum", group))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _ColumnShard(torch.nn.Linear):
    """A linear layer's forward on its output rows' shard (the input whole on every rank)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = _shard(self.bias) if self.bias is not None else None
        return torch.nn.functional.linear(x, _shard(self.weight), bias)


class _RowShard(torch.nn.Linear):
    """A linear layer's forward on its input columns' shard, the partial outputs summed over the group (the bias,
    whole on every rank, added once after the sum)."""

    novarl_tp_group: Any
    """The tensor-parallel group's name (functional collectives take it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _SumOutputs.apply(torch.nn.functional.linear(x, _shard(self.weight)), self.novarl_tp_group)
        return out if self.bias is None else out + _shard(self.bias)


def _shard(param: Any) -> torch.Tensor:
    """This rank's shard of a DTensor parameter (its gradient goes back to the DTensor's)."""
    return param.to_local()


_LOCAL_CLASSES: dict[tuple[type, type], type] = {}


def _local_class(base: type, behaviour: type) -> type:
    """`base` (nn.Linear or a subclass) with `behaviour`'s forward: the module keeps its attributes and names."""
    if base is torch.nn.Linear:
        return behaviour
    if (base, behaviour) not in _LOCAL_CLASSES:
        _LOCAL_CLASSES[base, behaviour] = type(f"{behaviour.__name__.lstrip('_')}{base.__name__}", (behaviour, base),
                                               {})
    return _LOCAL_CLASSES[base, behaviour]


class LocalColwise(ParallelStyle):
    """A linear layer split by output rows (weight and bias Shard(0)), run on local tensors."""

    def _apply(self, module: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
        return _split_linear(module, device_mesh, Shard(0), Shard(0), _ColumnShard)


class LocalRowwise(ParallelStyle):
    """A linear layer split by input columns (weight Shard(1), bias Replicate), its outputs summed."""

    def _apply(self, module: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
        return _split_linear(module, device_mesh, Shard(1), Replicate(), _RowShard)


class SumInputGradients(ParallelStyle):
    """A block (attention, MLP) whose input is the same on every rank: its gradient summed over the group."""

    def _apply(self, module: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
        group = device_mesh.get_group().group_name

        def hook(_module, args, kwargs):
            if args:
                return (_SumGradients.apply(args[0], group), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": _SumGradients.apply(kwargs["hidden_states"], group)}

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


def _split_linear(module: torch.nn.Module, mesh: DeviceMesh, weight_placement, bias_placement,
                  behaviour: type) -> torch.nn.Module:
    if not isinstance(module, torch.nn.Linear):
        raise UserError(f"tensor parallelism's default plan splits linear layers; this model has a "
                        f"{type(module).__name__} there: give policy.dtensor_cfg.custom_parallel_plan.")
    for name, placement in (("weight", weight_placement), ("bias", bias_placement)):
        param = getattr(module, name)
        if param is not None:
            split = distribute_tensor(param.data, mesh, [placement])
            setattr(module, name, torch.nn.Parameter(split, requires_grad=param.requires_grad))
    module.__class__ = _local_class(type(module), behaviour)
    local: Any = module
    local.novarl_tp_group = mesh.get_group().group_name
    return module


LOCAL_LAYER_PLAN: dict[str, ParallelStyle] = {
    "self_attn": SumInputGradients(),
    "self_attn.q_proj": LocalColwise(),
    "self_attn.k_proj": LocalColwise(),
    "self_attn.v_proj": LocalColwise(),
    "self_attn.o_proj": LocalRowwise(),
    "mlp": SumInputGradients(),
    "mlp.gate_proj": LocalColwise(),
    "mlp.up_proj": LocalColwise(),
    "mlp.down_proj": LocalRowwise(),
}
"""parallelize.LLAMA_LAYER_PLAN's split, on local tensors."""
