"""The DTensor backend's model where its mesh is one device: no FSDP2, mixed precision as FSDP2 does it.

FSDP2 on one device shards nothing, yet its hooks run at every unit's forward and backward and its parameters are
DTensors that each optimizer, clipping and state-dict operator dispatches through: without them a compiled training
step takes 0.62-0.73x the host's time of FSDP2 with a unit a layer, 0.74-0.90x with kept runs of layers
(benchmarks/results/host_overhead_cpu.md, a CPU), time a GPU waits where a step's kernels are short. Here the model
is the plain module, and its mixed precision is FSDP2's MixedPrecisionPolicy (param_dtype = the compute dtype,
reduce_dtype = float32): the model's parameters stay float32 (the optimizer steps them; checkpoints, exports and
weight syncs read them); for a pass, copies in the compute dtype take their places (`gather`), each copy's gradient
is added to its parameter's float32 gradient as soon as the backward has it (and freed), and the parameters are put
back at the pass's end (`release`); as FSDP2 casts each unit's floating inputs, each decoder layer's are cast to
the compute dtype meanwhile (OLMo 2's rotary tables come float32, and so might a remote-code model's masks). In
float32 nothing is swapped. Same numbers as FSDP2 on one rank (its gradients too accumulate over micro-batches in
float32); the memory of a training pass the same or less by construction, not measured (no unit's gradient buffers:
one parameter's gradient at a time); a frozen model (the reference) holds every copy through its pass, where FSDP2
gathered a layer at a time.
"""

from __future__ import annotations

import functools

import torch

from novarl.models.loading import parameter_places


class ShardedWeights:
    """FSDP2's weights (more than one device, or CPU offload): gathered by its hooks; `release` frees what
    a pass left gathered (parallelize.reshard)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def gather(self) -> None:
        pass

    def release(self) -> None:
        from novarl.backends.training.parallelize import reshard

        reshard(self.model)


class OneDeviceWeights:
    """A one-device model's float32 parameters and, during a pass, their copies in the compute dtype."""

    def __init__(self, model: torch.nn.Module, compute_dtype: torch.dtype,
                 layers: list[torch.nn.Module] | tuple = ()) -> None:
        """layers: the modules whose floating inputs are cast to the compute dtype while the copies are in
        place (the decoder layers: FSDP2's units)."""
        self.compute_dtype = compute_dtype
        if compute_dtype != torch.float32:
            for layer in layers:
                layer.register_forward_pre_hook(self._cast_inputs, with_kwargs=True)
        self.places = parameter_places(model)  # every place a parameter is registered (a tied head: two)
        self.gathered = False

    def gather(self) -> None:
        """The compute-dtype copies in the parameters' places, until `release` (idempotent)."""
        if self.gathered or self.compute_dtype == torch.float32:
            return
        self.gathered = True  # first: `release` puts back whatever a failure (out of memory) left swapped
        for param, where in self.places:
            copy = torch.nn.Parameter(param.detach().to(self.compute_dtype), requires_grad=param.requires_grad)
            if param.requires_grad:
                copy.register_post_accumulate_grad_hook(functools.partial(_add_gradient, param))
            for module, name in where:
                module._parameters[name] = copy

    def release(self) -> None:
        """The float32 parameters back in their places; the copies (and any gradient a backward left on
        them) freed."""
        if not self.gathered:
            return
        for param, where in self.places:
            for module, name in where:
                module._parameters[name] = param
        self.gathered = False

    def _cast_inputs(self, module: torch.nn.Module, args: tuple, kwargs: dict):
        """A decoder layer's floating tensors in its arguments (and in tuples among them: rotary tables) cast
        to the compute dtype while the copies are in place, as FSDP2's MixedPrecisionPolicy casts a unit's."""
        if not self.gathered:
            return None
        dtype = self.compute_dtype

        def cast(value):
            if isinstance(value, torch.Tensor):
                return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
            if isinstance(value, tuple):
                return tuple(cast(v) for v in value)
            return value

        return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}


def _add_gradient(param: torch.nn.Parameter, copy: torch.Tensor) -> None:
    """A copy's gradient, once the backward has accumulated it, added to its float32 parameter's."""
    grad, copy.grad = copy.grad, None
    if grad is None:
        return
    if param.grad is None:
        param.grad = grad.to(param.dtype)
    else:
        param.grad.add_(grad)


def one_device(world_size: int, cpu_offload: bool) -> bool:
    """Whether the DTensor backend's model is one device's plain module (OneDeviceWeights), not FSDP2's:
    one rank, its parameters on its device (FSDP2's CPU offload keeps them on the host)."""
    return world_size == 1 and not cpu_offload
