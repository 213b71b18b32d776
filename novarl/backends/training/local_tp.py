"""Tensor parallelism of a decoder layer with local tensors inside: the default Llama-family plans (with and without
sequence parallelism), in a form torch.compile traces whatever the sequence length.

torch's ColwiseParallel and RowwiseParallel run each linear on DTensors: the input made a Replicate DTensor, the
output made local again. Compiled, such a layer failed to trace its training pass once a micro-batch's length
differed from the first one's (torch 2.13, two CPU ranks: the backward's view of the split activations recursed
without end). Here the layers' weights are the same DTensors (split as torch's styles split them: q/k/v, gate
and up by output rows, o and down by input columns; checkpoints, exports and weight syncs read them as before),
read as their local shards inside the layer, and the two collectives of a layer are explicit (Megatron-LM's
form):

- at the attention's and the MLP's input, the activations are the same on every tensor-parallel rank; the
  backward sums their gradients over the ranks (`_SumGradients`: one all-reduce per block, where torch's styles
  all-reduce the input gradient of each of q, k and v, and of gate and up);
- after o and down, each rank's partial output is summed (`_SumOutputs`, an all-reduce; the backward passes the
  gradient on as it is).

With sequence parallelism (LOCAL_LAYER_PLAN_SP) the residual stream and the norms hold each rank's share of the
sequence: the blocks' inputs are all-gathered along it (the backward reduce-scatters), o's and down's outputs
reduce-scattered (the backward all-gathers), the first layer's input cut to the rank's share (`SplitSequence`);
the norms' weights, whole on every rank, get each rank's tokens' share of their gradient, which the trainer sums
over the ranks (parallelize.partial_parameters, as megatron-core does for its sequence-parallel norms).

Everything in the layer is then plain tensors and functional collectives, which dynamo traces with symbolic
lengths. The numbers are one rank's up to float rounding (tests/test_distributed.py, test_training_kernels.py,
test_lora_parallel.py). LoRA adapters are split with their layers (LocalColwise, LocalRowwise): the matrix on
the split side a DTensor split as the base is, the other (A of a column-split layer, B of a row-split one) a plain
tensor whole on every rank, FSDP2's alone (torch's styles made it a Replicate DTensor; such checkpoints resume),
whose gradient the trainer sums over the ranks where each holds a share (partial_adapter_parameters).

These styles are parts of the default plans, not styles to compose (a block's input gradient is summed by its
BlockInput, the partial gradients by the trainer for this layout alone): a custom plan that names them is refused
(parallelize.refuse_local_styles); custom plans run on torch's styles.
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


# torch 2.13 names them *_single (the *_tensor names warn that they are deprecated); older ones have only those
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


class _GatherSequence(torch.autograd.Function):
    """Forward: every rank's share of the sequence (dim 1) gathered; backward: the gradient summed over the ranks
    and split back (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _waited(_all_gather(x.contiguous(), 1, group))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _waited(_reduce_scatter(grad.contiguous(), "sum", 1, ctx.group)), None


class _ScatterSequence(torch.autograd.Function):
    """Forward: each rank's partial output summed over the ranks and split along the sequence (dim 1); backward:
    every rank's share of the gradient gathered."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _waited(_reduce_scatter(x.contiguous(), "sum", 1, group))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _waited(_all_gather(grad.contiguous(), 1, ctx.group)), None


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

    novarl_scatter_sequence: bool = False
    """Sequence parallelism: the partial outputs summed and split along the sequence (a reduce-scatter)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = torch.nn.functional.linear(x, _shard(self.weight))
        if self.novarl_scatter_sequence:
            out = _ScatterSequence.apply(partial, self.novarl_tp_group)
        else:
            out = _SumOutputs.apply(partial, self.novarl_tp_group)
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
    """A linear layer split by output rows (weight and bias Shard(0)), run on local tensors. With a LoRA adapter
    (PEFT's wrapper, its forward unchanged): the base and B split so, A (r x in) whole on every rank; A's gradient
    is then each rank's output rows' share, summed over the ranks by the trainer (`partial_adapter_parameters`)."""

    def _apply(self, module: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
        adapter = _adapter(module)
        if adapter is None:
            return _split_linear(module, device_mesh, Shard(0), Shard(0), _ColumnShard)
        base, _, lora_b = adapter
        for linear in (base, lora_b):
            _split_linear(linear, device_mesh, Shard(0), Shard(0), _ColumnShard)
        return module


class LocalRowwise(ParallelStyle):
    """A linear layer split by input columns (weight Shard(1), bias Replicate), its outputs summed; with
    scatter_sequence, summed and split along the sequence (sequence parallelism). With a LoRA adapter: the base
    and A split so (A's r outputs summed, or scattered, as the base's are: one more collective, r wide), B
    (out x r) whole on every rank; under sequence parallelism B's gradient is each rank's tokens' share, summed
    over the ranks by the trainer."""

    def __init__(self, *, scatter_sequence: bool = False) -> None:
        super().__init__()
        self.scatter_sequence = scatter_sequence

    def _apply(self, module: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
        adapter = _adapter(module)
        for linear in (module,) if adapter is None else adapter[:2]:  # the base and A
            local: Any = _split_linear(linear, device_mesh, Shard(1), Replicate(), _RowShard)
            local.novarl_scatter_sequence = self.scatter_sequence
        return module


def _adapter(module: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module] | None:
    """A PEFT LoRA wrapper's base layer and its adapter's A and B (novarl's one adapter), or None for a plain
    layer."""
    from novarl.models.lora import ADAPTER

    base, lora_a, lora_b = (getattr(module, name, None) for name in ("base_layer", "lora_A", "lora_B"))
    if (isinstance(base, torch.nn.Module) and isinstance(lora_a, torch.nn.ModuleDict)
            and isinstance(lora_b, torch.nn.ModuleDict) and ADAPTER in lora_a):
        return base, lora_a[ADAPTER], lora_b[ADAPTER]
    return None


def partial_adapter_parameters(layer: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The LoRA parameters of a decoder layer split by the local plans whose gradient each rank holds a share of,
    whole on every rank: A of a column-split layer; B of a row-split one under sequence parallelism."""
    partial: list[torch.nn.Parameter] = []
    for module in layer.modules():
        adapter = _adapter(module)
        if adapter is None:
            continue
        base, lora_a, lora_b = adapter
        if isinstance(base, _ColumnShard):
            partial.extend(lora_a.parameters())
        elif isinstance(base, _RowShard) and base.novarl_scatter_sequence:
            partial.extend(lora_b.parameters())
    return [param for param in partial if param.requires_grad]


class BlockInput(ParallelStyle):
    """A block's (attention's, MLP's) input, the same on every rank: without sequence parallelism its gradient
    summed over the group; with it (gather_sequence), each rank's share of the sequence all-gathered (the
    backward reduce-scatters the gradient)."""

    def __init__(self, *, gather_sequence: bool = False) -> None:
        super().__init__()
        self.gather_sequence = gather_sequence

    def _apply(self, module: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
        group = device_mesh.get_group().group_name
        gather = self.gather_sequence

        def whole(x: torch.Tensor) -> torch.Tensor:
            if gather:
                return _GatherSequence.apply(x, group)
            return _SumGradients.apply(x, group)

        return _on_hidden_states(module, whole)


def _on_hidden_states(module: torch.nn.Module, change) -> torch.nn.Module:
    """`module`'s input activations (its first positional argument, or `hidden_states` given by name, as Hugging
    Face's layers call their blocks) passed through `change` before its forward."""
    def hook(_module, args, kwargs):
        if args:
            return (change(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": change(kwargs["hidden_states"])}

    module.register_forward_pre_hook(hook, with_kwargs=True)
    return module


class _KeepShare(torch.autograd.Function):
    """Forward: this rank's share of the sequence (dim 1) of activations the same on every rank; backward: every
    rank's share of the gradient gathered."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any, rank: int, size: int) -> torch.Tensor:
        ctx.group = group
        return x.chunk(size, dim=1)[rank].contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _waited(_all_gather(grad.contiguous(), 1, ctx.group)), None, None, None


class SplitSequence(ParallelStyle):
    """The first decoder layer's input (the embeddings' output, whole on every rank) cut to this rank's share of
    the sequence: sequence parallelism's residual stream."""

    def _apply(self, module: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
        group, rank, size = device_mesh.get_group().group_name, device_mesh.get_local_rank(), device_mesh.size()
        return _on_hidden_states(module, lambda x: _KeepShare.apply(x, group, rank, size))


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
    "self_attn": BlockInput(),
    "self_attn.q_proj": LocalColwise(),
    "self_attn.k_proj": LocalColwise(),
    "self_attn.v_proj": LocalColwise(),
    "self_attn.o_proj": LocalRowwise(),
    "mlp": BlockInput(),
    "mlp.gate_proj": LocalColwise(),
    "mlp.up_proj": LocalColwise(),
    "mlp.down_proj": LocalRowwise(),
}
"""parallelize.LLAMA_LAYER_PLAN's split, on local tensors."""

LOCAL_LAYER_PLAN_SP: dict[str, ParallelStyle] = {
    "self_attn": BlockInput(gather_sequence=True),
    "self_attn.q_proj": LocalColwise(),
    "self_attn.k_proj": LocalColwise(),
    "self_attn.v_proj": LocalColwise(),
    "self_attn.o_proj": LocalRowwise(scatter_sequence=True),
    "mlp": BlockInput(gather_sequence=True),
    "mlp.gate_proj": LocalColwise(),
    "mlp.up_proj": LocalColwise(),
    "mlp.down_proj": LocalRowwise(scatter_sequence=True),
}
"""parallelize.LLAMA_LAYER_PLAN_SP's split, on local tensors: the residual stream and the norms on each rank's
share of the sequence (the norms' weights whole on every rank, their gradients summed over the ranks by the
trainer: parallelize.partial_parameters)."""
