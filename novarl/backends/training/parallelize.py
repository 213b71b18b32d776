"""Parallelism for Hugging Face causal LMs on DTensor, applied in a fixed order:

    mesh = build_mesh(...)                 # (dp,) or (dp, tp)
    apply_tp(model, mesh["tp"], plan)      # tensor parallel: attention heads and MLP columns split
    apply_activation_checkpointing(model)
    apply_fsdp(model, mesh["dp"], ...)     # FSDP2: each decoder layer, then the root

Each is a short function; the sizes are checked before any mesh exists.
"""

from __future__ import annotations

import fnmatch
import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from novarl.backends.contract.model_shape import layers_per_kept_unit
from novarl.config.schema import DTensorConfig
from novarl.distributed.local import collective_device, whole
from novarl.errors import UserError
from novarl.models.vocab_parallel import split_vocabulary

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# Llama / Qwen2 / Mistral decoder layers: q/k/v and gate/up split by output
# columns (heads), o/down by input rows, so each layer needs one all-reduce
# after attention and one after the MLP. Keys are module names inside a layer.
# These two run on torch's DTensor styles, for a custom_parallel_plan to name
# or build on; the default plans are the same splits on local tensors
# (local_tp.LOCAL_LAYER_PLAN and LOCAL_LAYER_PLAN_SP: they compile).
LLAMA_LAYER_PLAN: dict[str, ParallelStyle] = {
    "self_attn.q_proj": ColwiseParallel(),
    "self_attn.k_proj": ColwiseParallel(),
    "self_attn.v_proj": ColwiseParallel(),
    "self_attn.o_proj": RowwiseParallel(),
    "mlp.gate_proj": ColwiseParallel(),
    "mlp.up_proj": ColwiseParallel(),
    "mlp.down_proj": RowwiseParallel(),
}

# With sequence parallelism the residual stream between the two all-reduce points
# stays split along the sequence (dim 1): norms run on each rank's tokens, the
# attention and MLP inputs are all-gathered, and o/down reduce-scatter back.
LLAMA_LAYER_PLAN_SP: dict[str, ParallelStyle] = {
    "input_layernorm": SequenceParallel(),
    "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                    desired_input_kwarg_layouts={"hidden_states": Replicate()}),
    "self_attn.q_proj": ColwiseParallel(),
    "self_attn.k_proj": ColwiseParallel(),
    "self_attn.v_proj": ColwiseParallel(),
    "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
    "post_attention_layernorm": SequenceParallel(),
    "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
    "mlp.gate_proj": ColwiseParallel(),
    "mlp.up_proj": ColwiseParallel(),
    "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
}


HEAD_SPLIT = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")
"""Parameters of a decoder layer that the default plans leave whole on every tensor-parallel rank but that act on
the rank's attention heads alone (Qwen3's query and key norms): each rank's gradient is its heads' share, which
`sum_partial_gradients` adds up over the ranks (as megatron-core all-reduces its qk-layernorm gradients)."""

SPLIT_BIASES = ("self_attn.o_proj.bias", "mlp.down_proj.bias")
"""Sequence parallelism runs a decoder layer's attention and MLP on the whole sequence (gathered at their input,
reduce-scattered at their output) and its norms -- the modules of the layer named *norm*, however many (Llama's
two, Gemma 2's four) -- on the rank's share of it, as it adds these biases after o's and down's reduce-scatter
on local tensors (the default plan): each rank's gradient of such a weight, whole on every rank, is its tokens'
share, summed over the ranks (torch's SequenceParallel style makes a norm's weight a DTensor whose gradient
DTensor reduces instead)."""


def check_splittable(model: torch.nn.Module, size: int, *, default_plan: bool) -> None:
    """`size` divides the heads and the MLP's width; and the default plans, which split the attention by heads,
    find a query/key norm one head's (Qwen3's), not spanning every head's outputs (OLMo 2's: each rank would hold
    a part of what it normalises). Refused, naming what."""
    config: Any = model.config
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, name, None)
        if value is not None and value % size:
            raise UserError(f"policy.dtensor_cfg.tensor_parallel_size={size} must divide the model's "
                            f"{name}={value}.")
    layers = decoder_layers(model)
    if not default_plan or not layers:
        return
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    for name, weight in layers[0].named_parameters():
        if name in HEAD_SPLIT and weight.numel() != head_dim:
            raise UserError(f"policy.dtensor_cfg.tensor_parallel_size={size} with this {config.model_type} model: "
                            f"its {name.removesuffix('.weight')} normalises all the heads' outputs together "
                            f"({weight.numel()} values, heads of {head_dim}), which the default tensor-parallel "
                            "plan splits by heads. Use tensor_parallel_size: 1 (FSDP2 shards the model over the "
                            "data-parallel ranks), or a custom_parallel_plan that keeps the attention whole.")


def partial_parameters(model: torch.nn.Module, cfg: DTensorConfig) -> list[torch.nn.Parameter]:
    """The trainable parameters whose gradient each tensor-parallel rank holds a share of, whole on every rank:
    HEAD_SPLIT behind query and key projections split by heads (the default plans, or a custom plan that leaves
    the norms whole), LoRA's (local_tp.partial_adapter_parameters: the default plans'), and with sequence
    parallelism the layers' norms (a dict plan's where it leaves them plain modules) and, on the default plan,
    SPLIT_BIASES. A function plan's are its own. None without tensor parallelism."""
    if cfg.tensor_parallel_size == 1:
        return []
    from novarl.backends.training.local_tp import partial_adapter_parameters

    custom = cfg.custom_parallel_plan
    sequence_split = cfg.sequence_parallel and not (custom and callable(load_custom_plan(custom)))
    partial = []
    for layer in decoder_layers(model):
        heads_split = splits_heads(layer)
        for name, param in layer.named_parameters():
            whole = not on_tensor_parallel_mesh(param)  # the default plan's split biases: Replicate DTensors
            on_tokens = "norm" in name.split(".")[0] or (not custom and name in SPLIT_BIASES)
            if param.requires_grad and ((sequence_split and on_tokens and (whole or not custom))
                                        or (name in HEAD_SPLIT and heads_split and whole)):
                partial.append(param)
        partial += partial_adapter_parameters(layer)
    return partial


def splits_heads(layer: torch.nn.Module) -> bool:
    """Whether a decoder layer's query projection (a LoRA wrapper's base) is split over the tensor-parallel
    ranks: each rank's attention then runs on its heads alone."""
    params = dict(layer.named_parameters())
    weight = params.get("self_attn.q_proj.weight", params.get("self_attn.q_proj.base_layer.weight"))
    return weight is not None and on_tensor_parallel_mesh(weight)


def on_tensor_parallel_mesh(param: torch.Tensor) -> bool:
    """Whether a parameter is placed over the tensor-parallel ranks (split or replicated by a plan); FSDP2 puts
    the others on the data-parallel mesh alone."""
    return isinstance(param, DTensor) and "tp" in (param.device_mesh.mesh_dim_names or ())


def sum_partial_gradients(parameters: list[torch.nn.Parameter], group: dist.ProcessGroup) -> None:
    """Each of `parameters`' gradients summed over the tensor-parallel `group`, in one all-reduce (FSDP2's
    gradients: each rank's data-parallel shard, the same elements on every tensor-parallel rank)."""
    grads = [param.grad for param in parameters if param.grad is not None]
    if not grads:
        return
    local = [grad.to_local() if isinstance(grad, DTensor) else grad for grad in grads]
    # on the group's device: under CPU offload FSDP2 leaves the gradients on the CPU, and NCCL takes GPU tensors
    flat = torch.cat([tensor.reshape(-1) for tensor in local]).to(collective_device(group))
    dist.all_reduce(flat, group=group)
    for tensor, summed in zip(local, flat.split([tensor.numel() for tensor in local]), strict=True):
        tensor.copy_(summed.view_as(tensor))


@dataclass(frozen=True)
class ParallelDims:
    world_size: int
    tensor_parallel: int
    context_parallel: int

    @property
    def data_parallel(self) -> int:
        return self.world_size // (self.tensor_parallel * self.context_parallel)

    def check(self) -> None:
        product = self.tensor_parallel * self.context_parallel
        if self.world_size % product:
            raise UserError(f"world size {self.world_size} is not dp x tp x cp for any whole dp: "
                            f"tensor_parallel_size x context_parallel_size = {self.tensor_parallel} x "
                            f"{self.context_parallel} = {product} does not divide it.")


def build_mesh(device_type: str, dims: ParallelDims) -> DeviceMesh:
    """("dp",), ("dp", "tp"), or with context parallelism ("dp", "cp"[, "tp"]) and "dp_cp", the two
    flattened (what FSDP2 shards over: a cp rank holds other tokens of the same sequences)."""
    dims.check()
    if dims.context_parallel > 1:
        sizes: tuple[int, ...] = (dims.data_parallel, dims.context_parallel)
        names: tuple[str, ...] = ("dp", "cp")
        if dims.tensor_parallel > 1:
            sizes, names = (*sizes, dims.tensor_parallel), (*names, "tp")
        mesh = init_device_mesh(device_type, sizes, mesh_dim_names=names)
        mesh["dp", "cp"]._flatten("dp_cp")
        return mesh
    if dims.tensor_parallel == 1:
        return init_device_mesh(device_type, (dims.data_parallel,), mesh_dim_names=("dp",))
    return init_device_mesh(device_type, (dims.data_parallel, dims.tensor_parallel), mesh_dim_names=("dp", "tp"))


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The ranks FSDP2 shards parameters over: data (and context) parallel ones."""
    names = mesh.mesh_dim_names or ()
    if "cp" in names:
        return mesh["dp_cp"]
    return mesh["dp"] if "tp" in names else mesh


def cp_group(mesh: DeviceMesh) -> dist.ProcessGroup | None:
    """The context-parallel group of this rank (None without context parallelism)."""
    return mesh["cp"].get_group() if "cp" in (mesh.mesh_dim_names or ()) else None


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a Hugging Face causal LM (Llama/Qwen2/Mistral layout)."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise UserError(f"{type(model).__name__} has no .model.layers: novarl cannot shard it per layer.")
    return list(layers)


def apply_tp(model: torch.nn.Module, tp_mesh: DeviceMesh, cfg: DTensorConfig) -> str:
    """Tensor parallelism with the default Llama-family plan or `custom_parallel_plan`. The default plans (LoRA
    adapters included) run on local tensors (local_tp.py: they compile); a custom plan on torch's DTensor styles.
    With the default plan, the embeddings and the output head are split over the vocabulary
    (models/vocab_parallel.py). Under sequence parallelism a dict plan's layers get the default's ends (the
    sequence split after the embeddings, gathered before the head); a function plan places its own. What became
    of the embeddings and the head, for the log."""
    from novarl.backends.training import local_tp

    size = tp_mesh.size()
    check_splittable(model, size, default_plan=not cfg.custom_parallel_plan)
    frozen = {name for name, param in model.named_parameters() if not param.requires_grad}
    default = local_tp.LOCAL_LAYER_PLAN_SP if cfg.sequence_parallel else local_tp.LOCAL_LAYER_PLAN
    plan = load_custom_plan(cfg.custom_parallel_plan) if cfg.custom_parallel_plan else default
    if cfg.custom_parallel_plan and not callable(plan):
        refuse_local_styles(plan, cfg.custom_parallel_plan)
        if cfg.sequence_parallel:
            check_returns_split_sequence(plan, cfg.custom_parallel_plan)
    if callable(plan):
        if any(hasattr(module, "lora_A") for module in model.modules()):
            raise UserError(f"policy.dtensor_cfg.custom_parallel_plan='{cfg.custom_parallel_plan}' is a function, "
                            "and LoRA is on: give a dict plan, whose adapted layers novarl splits with their "
                            "adapters.")
        plan(model, tp_mesh)
    else:
        apply_plan(model, tp_mesh, plan)
    if cfg.sequence_parallel and not callable(plan):  # a function plan places the whole model, ends included
        apply_sequence_parallel_ends(model, tp_mesh)
    vocabulary = ("the input embeddings and the output head stay whole on every tensor-parallel rank: "
                  "policy.dtensor_cfg.custom_parallel_plan places the model's layers")
    if not cfg.custom_parallel_plan:  # the embeddings and the picking head over the vocabulary
        vocabulary = split_vocabulary(model, tp_mesh)
    for name, param in model.named_parameters():  # torch's SequenceParallel makes the norms' weights trainable
        if name in frozen:
            param.requires_grad_(False)
    # DTensor warns that (dp, tp) norms take two all-reduces; on these sizes that is fine.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    return vocabulary


def refuse_local_styles(plan: dict[str, ParallelStyle], spec: str) -> None:
    """local_tp's styles are parts of the default plans, not styles to compose: a block's input gradient is summed
    by its BlockInput, the adapters' and the norms' by the trainer for the default plans' layout. In a custom
    plan they would train on a rank's share of those gradients; refused, naming the keys."""
    from novarl.backends.training import local_tp

    local = (local_tp.LocalColwise, local_tp.LocalRowwise, local_tp.BlockInput, local_tp.SplitSequence)
    keys = [key for key, style in plan.items() if isinstance(style, local)]
    if keys:
        raise UserError(f"policy.dtensor_cfg.custom_parallel_plan='{spec}' gives {keys} novarl's local-tensor "
                        "styles (backends/training/local_tp.py), which run only as the default plans: leave "
                        "custom_parallel_plan unset for them (with sequence_parallel: true for the "
                        "sequence-parallel one), or write the plan with torch's styles (ColwiseParallel, "
                        "RowwiseParallel; novarl.backends.training.parallelize:LLAMA_LAYER_PLAN is the default "
                        "split so).")


def check_returns_split_sequence(plan: dict[str, ParallelStyle], spec: str) -> None:
    """Under sequence parallelism a dict plan's layers take and return the residual stream split along the
    sequence, as LLAMA_LAYER_PLAN_SP's do (novarl splits it after the embeddings and gathers it before the head):
    every RowwiseParallel of the plan reduce-scatters to Shard(1). One that returns the whole sequence from either
    block is refused here rather than failing in the next layer."""
    rowwise = [style for style in plan.values() if isinstance(style, RowwiseParallel)]
    if not rowwise or not all(Shard(1) in style.output_layouts for style in rowwise):
        raise UserError(f"policy.dtensor_cfg.custom_parallel_plan='{spec}' with sequence_parallel: true: its layers "
                        "must return the residual stream split along the sequence, as "
                        "novarl.backends.training.parallelize:LLAMA_LAYER_PLAN_SP's do (RowwiseParallel("
                        "output_layouts=Shard(1)) for o_proj and down_proj, SequenceParallel for the norms, "
                        "PrepareModuleInput from Shard(1) to Replicate() for the attention and the MLP); not every "
                        "RowwiseParallel of it returns Shard(1). Set sequence_parallel: false for this plan, or "
                        "write it so.")


def apply_plan(model: torch.nn.Module, tp_mesh: DeviceMesh, plan: dict[str, ParallelStyle]) -> None:
    """Apply a per-layer plan (keys relative to a decoder layer, fnmatch patterns allowed)."""
    for layer in decoder_layers(model):
        names = [n for n, _ in layer.named_modules() if n]
        resolved = {n: style for pattern, style in plan.items() for n in fnmatch.filter(names, pattern)}
        unmatched = [p for p in plan if not fnmatch.filter(names, p)]
        if unmatched:
            raise UserError(f"parallel plan keys {unmatched} match no module of a decoder layer "
                            f"(modules: {', '.join(names[:12])}, ...).")
        parallelize_module(layer, tp_mesh, with_lora_adapters(layer, resolved))


class ReplicatedAdapter(ParallelStyle):
    """A LoRA adapter's small matrix kept whole on every tensor-parallel rank: its parameters
    Replicate DTensors, its input taken as `input_layout` (a local tensor in, a local tensor out).
    Its gradient may come out Partial (the input split along the sequence): FSDP2 reduces it to
    the parameter's placement before the optimizer sees it."""

    def __init__(self, input_layout: Placement) -> None:
        super().__init__()
        self.input_layout = input_layout

    def _apply(self, module: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
        layout = self.input_layout

        def to_dtensor(_module, inputs, mesh):
            return tuple(DTensor.from_local(x, mesh, (layout,), run_check=False)
                         if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)

        def to_local(_module, output, _mesh):
            return output.to_local() if isinstance(output, DTensor) else output

        return distribute_module(module, device_mesh, input_fn=to_dtensor, output_fn=to_local)


def with_lora_adapters(layer: torch.nn.Module, plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """The plan for a decoder layer whose linear layers may carry LoRA adapters (PEFT's wrappers,
    see novarl/models/lora.py). A wrapped layer's base is split as the plan says, and its
    adapter so that it adds to the base's output shard with no extra communication but one
    all-reduce of rank-r activations where the base has one:
    - column-wise (output split): A (r x in) whole on every rank, B (out x r) split by rows
      like the base;
    - row-wise (input split): A split by columns like the base (its r outputs reduced the way
      the base's are), B whole on every rank, reading A's output in the base's output layout.
    local_tp's styles (the default plans) split a wrapped layer's adapter themselves, the same way."""
    from novarl.backends.training.local_tp import LocalColwise, LocalRowwise
    from novarl.models.lora import ADAPTER

    expanded: dict[str, ParallelStyle] = {}
    for name, style in plan.items():
        module = layer.get_submodule(name)
        lora_a = getattr(module, "lora_A", None)
        if not (isinstance(lora_a, torch.nn.ModuleDict) and ADAPTER in lora_a) or isinstance(
                style, (LocalColwise, LocalRowwise)):
            expanded[name] = style
            continue
        a, b = f"{name}.lora_A.{ADAPTER}", f"{name}.lora_B.{ADAPTER}"
        if not getattr(style, "use_local_output", False):
            raise UserError(f"the parallel plan's style for '{name}' returns DTensors (use_local_output=False); "
                            "LoRA adapters add local tensors to a layer's output.")
        if isinstance(style, ColwiseParallel):
            expanded[a] = ReplicatedAdapter(Replicate())
            expanded[b] = ColwiseParallel(output_layouts=style.output_layouts[0])
        elif isinstance(style, RowwiseParallel):
            expanded[a] = RowwiseParallel(input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0])
            expanded[b] = ReplicatedAdapter(style.output_layouts[0])
        else:
            raise UserError(f"LoRA adapts '{name}', which the parallel plan gives {type(style).__name__}; "
                            "an adapted layer must be ColwiseParallel or RowwiseParallel.")
        expanded[f"{name}.base_layer"] = style
    return expanded


def apply_sequence_parallel_ends(model: PreTrainedModel, tp_mesh: DeviceMesh) -> None:
    """Split the embeddings' output along the sequence before the first layer (local_tp.SplitSequence, inside the
    first layer's compiled graph where it compiles), run the final norm on each rank's tokens, and gather the
    sequence again before the head."""
    from novarl.backends.training.local_tp import SplitSequence

    parallelize_module(decoder_layers(model)[0], tp_mesh, SplitSequence())
    parallelize_module(model.model.norm, tp_mesh, SequenceParallel())
    parallelize_module(model.get_output_embeddings(), tp_mesh, PrepareModuleInput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True))


def load_custom_plan(spec: str) -> dict[str, ParallelStyle] | Callable[[torch.nn.Module, DeviceMesh], None]:
    """`module:name` -> a dict plan for decoder layers, or a callable(model, tp_mesh)."""
    module_name, _, attr = spec.partition(":")
    try:
        plan = getattr(importlib.import_module(module_name), attr)
    except Exception as err:  # the user's module may raise anything on import
        raise UserError(f"policy.dtensor_cfg.custom_parallel_plan='{spec}' cannot be imported ({err}); "
                        "give 'module:name' of a dict plan or a function(model, tp_mesh).") from None
    if not (callable(plan) or isinstance(plan, dict)):
        raise UserError(f"policy.dtensor_cfg.custom_parallel_plan='{spec}' is a {type(plan).__name__}, "
                        "not a dict plan or a function(model, tp_mesh).")
    return plan


def apply_activation_checkpointing(model: PreTrainedModel) -> None:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def compiles(cfg: DTensorConfig, model: PreTrainedModel, device: torch.device) -> bool:
    """Whether the decoder layers are compiled: dtensor_cfg.torch_compile, or where it is None, on
    the layout it was measured to win on (CUDA, a PLAIN_CAUSAL model, no tp, cp, LoRA or
    activation checkpointing)."""
    if cfg.torch_compile is not None:
        return cfg.torch_compile
    from novarl.models.architectures import PLAIN_CAUSAL

    return (device.type == "cuda" and model.config.model_type in PLAIN_CAUSAL and cfg.tensor_parallel_size == 1
            and cfg.context_parallel_size == 1 and not cfg.lora_cfg.enabled and not cfg.activation_checkpointing)


def apply_compile(model: torch.nn.Module) -> None:
    """Compile each decoder layer in place (its module and parameter names unchanged), as torchtitan
    does: after tensor parallelism and activation checkpointing, before FSDP. Each layer is its own
    graph (the same code for every layer: compiled once, reused), graph breaks allowed. A picking
    head's chunk steps are compiled too (models/logprob_head.py: fused)."""
    from novarl.models.compile_limits import allow_recompiles
    from novarl.models.logprob_head import picking_head

    allow_recompiles()
    for layer in decoder_layers(model):
        layer.compile(dynamic=None)
    head = picking_head(model)
    if head is not None:
        head.fused = True


def apply_fsdp(model: torch.nn.Module, dp_mesh: DeviceMesh, *, param_dtype: torch.dtype,
               cpu_offload: bool, keep_gathered: bool = False) -> None:
    """Shard each decoder layer, then the root (embeddings, final norm, head). keep_gathered: each
    layer's gathered (compute-dtype) weights are kept after its forward, for the backward and the next
    micro-batch, until `reshard` or a backward that reshards (FSDPModule.set_reshard_after_backward);
    the layers are then sharded in runs of consecutive ones (fsdp_units)."""
    kwargs: dict = {"mesh": dp_mesh}
    if keep_gathered:  # else FSDP2's default: layers resharded after forward, the root kept for the backward
        kwargs["reshard_after_forward"] = False
    if param_dtype != torch.float32:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    for unit in fsdp_units(decoder_layers(model), keep_gathered):
        fully_shard(unit if len(unit) > 1 else unit[0], **kwargs)
    fully_shard(model, **kwargs)


def fsdp_units(layers: list[torch.nn.Module], keep_gathered: bool) -> list[list[torch.nn.Module]]:
    """The decoder layers FSDP2 shards together (one gather, one gradient reduction and one set of hooks each):
    one unit a layer, or where the gathered weights are kept and this torch's FSDP2 runs a unit's hooks on each
    of its modules (groups_modules_fully), runs of layers_per_kept_unit layers (by the largest layer's
    parameters on this rank)."""
    if not keep_gathered or not layers or not groups_modules_fully():
        return [[layer] for layer in layers]
    largest = max(sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in layer.parameters())
                  for layer in layers)
    size = layers_per_kept_unit(largest, len(layers))
    return [layers[start:start + size] for start in range(0, len(layers), size)]


def groups_modules_fully() -> bool:
    """Whether this torch's FSDP2 runs a unit of several modules' forward hooks on each module and completes a
    unit some module of which did not run (FSDPState._force_complete_incomplete_states; torch 2.13 has it). Older
    versions ran the pre-hook on the first module to run and the post-hook on the last only, which novarl has not
    tested (with recomputation, a unit's modules run again in the backward): their layers stay a unit each."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    return hasattr(FSDPState, "_force_complete_incomplete_states")


def keeps_gathered(trainable: bool, dp_mesh: DeviceMesh, cpu_offload: bool) -> bool:
    """Whether a model's gathered weights stay from one micro-batch to the next (apply_fsdp): for a
    trainable model on one data-parallel shard, where gathering is no saving (the shard is the whole
    weight: only a cast copy is freed) and costs a cast and a copy of every layer in each forward and
    backward (12 a step at 4 + 4 micro-batches). Then a step gathers twice: in its logprob pass, freed at
    its end (dtensor.py ShardedModel.forward: nothing stays gathered between calls, while another role or
    a colocated engine runs), and in the training pass's first forward, freed by its last backward. Not
    with CPU offload (the copies would keep the model on the GPU) nor for frozen models."""
    return trainable and dp_mesh.size() == 1 and not cpu_offload


def reshard(model: torch.nn.Module) -> None:
    """Free every gathered weight copy (FSDP2), so that the next forward gathers the sharded weights anew."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def clip_grad_norm(parameters: list[torch.nn.Parameter], max_norm: float | None) -> torch.Tensor:
    """Global gradient norm (and clipping) over parameters that may live on different
    meshes -- (dp,) for replicated-across-tp ones, (dp, tp) for tensor-parallel ones --
    which torch's clip_grad_norm_ cannot stack together. The norm stays on the gradients' device
    (a 0-dim float32 tensor): nothing here waits for the GPU, so the optimizer's step is queued
    behind the clipping before the caller reads the norm."""
    groups: dict[object, list[tuple[torch.nn.Parameter, torch.Tensor]]] = {}
    for p in parameters:
        if p.grad is not None:
            groups.setdefault(getattr(p.grad, "device_mesh", None), []).append((p, p.grad))
    squares: torch.Tensor | None = None
    for mesh, pairs in groups.items():
        grads = [grad for _, grad in pairs]
        if mesh is None:
            norm = torch.nn.utils.get_total_norm(grads)
        else:  # each gradient's norm, partial over the mesh (torch's get_total_norm would reduce it where it is,
            # on the host under CPU offload, which NCCL refuses): reduced once, on the mesh's devices
            norm = torch.linalg.vector_norm(whole(cast(DTensor, torch.stack(torch._foreach_norm(grads, 2.0)))))
        norm = norm.float() ** 2
        squares = norm if squares is None else squares + norm.to(squares.device)
    if squares is None:
        return torch.zeros((), dtype=torch.float32)
    total = squares.sqrt()
    if max_norm:
        for pairs in groups.values():
            torch.nn.utils.clip_grads_with_norm_([p for p, _ in pairs], max_norm, total.to(pairs[0][1].device))
    return total


def dp_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    return mesh["dp"].get_group() if len(mesh.mesh_dim_names or ()) > 1 else mesh.get_group()
