"""Memory per GPU for training (and a colocated generator): pure arithmetic on a
`ModelShape`, nothing is loaded. All results are bytes; `GB` is 1e9 bytes, the
unit in which the ZeRO paper's example comes out exactly (120 / 31.4 / 16.6 /
1.9 GB; in GiB it would read 111.8 / 29.2 / 15.5 / 1.7).

Sources
- Model states: Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward
  Training Trillion Parameter Models", sec. 3.1 and 5 / Figure 1. Mixed-precision
  Adam holds 2 (fp16/bf16 weights) + 2 (grads) + K = 12 (fp32 master weights,
  momentum, variance) bytes per parameter Psi; over Nd data-parallel ranks:
      DDP 16 Psi;  stage 1: 4 Psi + 12 Psi/Nd;  stage 2: 2 Psi + 14 Psi/Nd;
      stage 3: 16 Psi/Nd.
  Pure fp32 training (novarl on CPU): 4 + 4 + 8 (Adam m, v; no master copy) = 16.
- Megatron's distributed optimizer: Megatron Core developer guide,
  "Distributed Optimizer": bytes per parameter 20 / 4 + 16/d (16-bit params and
  grads), 18 / 6 + 12/d (16-bit params, fp32 grads), 16 / 8 + 8/d (fp32).
- Activations: Korthikanti et al. 2022, "Reducing Activation Recomputation in
  Large Transformer Models", sec. 4 and Table 2. Bytes per transformer layer,
  for sequence s, micro-batch b, hidden h, heads a, tensor parallel t:
      no parallelism                   s b h (34 + 5 a s / h)
      tensor parallel                  s b h (10 + 24/t + 5 a s / (h t))
      tensor + sequence parallel       s b h / t (34 + 5 a s / h)
      + selective recomputation        drops the 5 a s / h term
      full recomputation               2 s b h (the layer's input only; / t with
                                       sequence parallel, whose input is a sequence shard)
  The 5 a s / h term is the attention score matrix (softmax in/out and dropout
  mask, O(s^2)). FlashAttention-style kernels never store it, which is why
  `flash_attention=True` (the default) drops it; selective recomputation then
  saves nothing more. The formula counts a GPT layer (4h MLP, LayerNorm, dropout
  masks); for SwiGLU/RMSNorm/GQA layers without dropout it is an estimate of the
  same size, not an exact count.
  Output layer (same paper, sec. 4.3): fp32 logits for the loss, 4 s b v / t. Where novarl's
  output head picks the following tokens' logprobs chunk by chunk (models/logprob_head.py: a
  plain-headed model on DTensor or DeepSpeed; every model on Megatron without context parallelism,
  each tensor-parallel rank over its v / t), it keeps the logits in the compute dtype where they take
  at most 4 GiB (else recomputes them chunk by chunk in the backward), plus one 1 GiB chunk of
  float32 logits and its gradient.
- Pipeline parallel (same paper, sec. 4.2.3): with 1F1B the first stage holds p
  micro-batches in flight of its L/p layers, i.e. L layers' worth; the
  interleaved schedule (m virtual stages) multiplies that by 1 + (p-1)/(p m).
- KV cache: 2 (K and V) x layers x KV heads x head_dim x bytes, per token.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Literal

from novarl.errors import UserError
from novarl.backends.contract.model_shape import ModelShape, largest_weight, layers_per_kept_unit
from novarl.models.architectures import HEAD_CHUNK_BYTES, HEAD_SAVE_LOGITS_BYTES

GB = 10**9

Precision = Literal["float32", "bfloat16", "float16"]
Optimizer = Literal["adam", "sgd"]
Recompute = Literal["none", "selective", "full"]
STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp2", "fsdp2_offload", "fsdp2_tp", "megatron")
_ZERO_STAGE = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3}
_PARALLEL_SIZES: dict[str, set[str] | None] = {
    **{zero: {"data_parallel_size"} for zero in _ZERO_STAGE},
    "fsdp2_tp": {"data_parallel_size", "tensor_parallel_size", "context_parallel_size"},
    "megatron": None,
}
"""The parallel sizes a strategy has above 1 (None: every one); the others: data and context parallel."""


def gb(num_bytes: float) -> float:
    """Bytes in GB (1e9 bytes)."""
    return num_bytes / GB


# ------------------------------------------------------------------ breakdown
@dataclass(frozen=True, kw_only=True)
class MemoryBreakdown:
    """Bytes on one GPU. `total` is everything resident at once; a colocated
    generator that frees its memory while training runs (vLLM sleep mode), beside
    training roles that wait in host memory while it generates
    (distributed/parking.py), peaks at max(`training`, `generation`) instead."""

    params: float
    """Resident training weights (this rank's shard)."""
    grads: float
    optimizer: float
    """Optimizer state, with the fp32 master weights of mixed precision."""
    activations: float
    """Saved for backward on the peak stage, with the output layer's fp32 logits."""
    gathered_params: float = 0.0
    """Unsharded working copies that ZeRO-3 / FSDP2 gather for compute."""
    generator_weights: float = 0.0
    kv_cache: float = 0.0
    reference_weights: float = 0.0
    """A frozen KL reference's weights, laid out like `params`, in the policy's processes."""
    critic_states: float = 0.0
    """PPO's critic: its weights, gradients and optimizer state, laid out like the policy's (the
    same architecture but the output head), resident beside them."""
    cpu_offloaded: float = 0.0
    """Model states moved to host memory (not counted in the GPU totals)."""
    notes: tuple[str, ...] = ()

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def training(self) -> float:
        return self.model_states + self.reference_weights + self.critic_states + self.gathered_params \
            + self.activations

    @property
    def generation(self) -> float:
        return self.generator_weights + self.kv_cache

    @property
    def total(self) -> float:
        return self.training + self.generation

    def gb(self, name: str = "total") -> float:
        """One field or total in GB (1e9 bytes)."""
        return gb(getattr(self, name))

    def as_dict_gb(self) -> dict[str, float]:
        numbers = {f.name: gb(getattr(self, f.name)) for f in fields(self) if f.name != "notes"}
        return {**numbers, "model_states": self.gb("model_states"), "training": self.gb("training"),
                "generation": self.gb("generation"), "total": self.gb("total")}


# --------------------------------------------------------------- model states
@dataclass(frozen=True)
class BytesPerParameter:
    weights: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer


def bytes_per_parameter(precision: Precision = "bfloat16", optimizer: Optimizer = "adam") -> BytesPerParameter:
    """The ZeRO paper's split: 16-bit weights and grads, fp32 master + state (K=12 for
    Adam, 8 for SGD with momentum); fp32 training keeps no master copy (4 + 4 + 8)."""
    state = 8 if optimizer == "adam" else 4
    if precision == "float32":
        return BytesPerParameter(4, 4, state)
    return BytesPerParameter(2, 2, 4 + state)


def fsdp2_bytes_per_parameter(precision: Precision = "bfloat16", optimizer: Optimizer = "adam") -> BytesPerParameter:
    """FSDP2 as novarl applies it: fp32 sharded weights, bf16 only in the gathered
    copies (MixedPrecisionPolicy param_dtype), grads reduced and kept in fp32.
    Same 16 bytes for Adam as the ZeRO split, divided 4 + 4 + 8."""
    return BytesPerParameter(4, 4, 8 if optimizer == "adam" else 4)


def megatron_bytes_per_parameter(precision: Precision = "bfloat16", optimizer: Optimizer = "adam", *,
                                 grad_reduce_in_fp32: bool = False) -> BytesPerParameter:
    """Megatron Core's table (Distributed Optimizer guide): with 16-bit grads the
    optimizer also keeps fp32 main grads, 2 + 2 + 16 = 20; with fp32 grads
    2 + 4 + 12 = 18; fp32 4 + 4 + 8 = 16. The optimizer part is what the
    distributed optimizer shards."""
    state = 8 if optimizer == "adam" else 4
    if precision == "float32":
        return BytesPerParameter(4, 4, state)
    if grad_reduce_in_fp32:
        return BytesPerParameter(2, 4, 4 + state)
    return BytesPerParameter(2, 2, 8 + state)


def zero_model_states(num_parameters: float, *, stage: int, data_parallel_size: int,
                      per_parameter: BytesPerParameter | None = None) -> tuple[float, float, float]:
    """(weights, grads, optimizer) bytes per rank for ZeRO stage 0 (DDP) to 3.
    Stage 1 shards the optimizer state, 2 also the grads, 3 also the weights."""
    per_parameter = per_parameter or bytes_per_parameter()
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage {stage} is not 0, 1, 2 or 3")
    nd = data_parallel_size
    weights = num_parameters * per_parameter.weights / (nd if stage >= 3 else 1)
    grads = num_parameters * per_parameter.grads / (nd if stage >= 2 else 1)
    optimizer = num_parameters * per_parameter.optimizer / (nd if stage >= 1 else 1)
    return weights, grads, optimizer


# ---------------------------------------------------------------- activations
def layer_activation_bytes(*, sequence_length: int, micro_batch_size: int, hidden_size: int,
                           num_attention_heads: int, tensor_parallel_size: int = 1,
                           sequence_parallel: bool = False, recompute: Recompute = "none",
                           flash_attention: bool = True) -> float:
    """Activations one transformer layer saves for backward (Korthikanti et al. 2022,
    Table 2), 16-bit activations, 1-byte dropout masks."""
    s, b, h, a, t = sequence_length, micro_batch_size, hidden_size, num_attention_heads, tensor_parallel_size
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    attention_scores = 0.0 if flash_attention or recompute == "selective" else 5 * a * s / h
    if sequence_parallel:
        return sbh / t * (34 + attention_scores)
    return sbh * (10 + 24 / t + attention_scores / t)


def output_activation_bytes(*, sequence_length: int, micro_batch_size: int, vocab_size: int,
                            tensor_parallel_size: int = 1) -> float:
    """fp32 logits kept for the loss, 4 s b v / t (Korthikanti et al. sec. 4.3)."""
    return 4 * sequence_length * micro_batch_size * vocab_size / tensor_parallel_size


def picked_output_bytes(*, tokens: int, vocab_size: int, compute_bytes: int) -> float:
    """What a picking output head holds (models/logprob_head.py): the logits in the compute dtype, kept
    for the backward where they take at most HEAD_SAVE_LOGITS_BYTES (else each chunk's is recomputed
    there), and one chunk's float32 logits and their gradient at a time."""
    logits = compute_bytes * tokens * vocab_size
    return (logits if logits <= HEAD_SAVE_LOGITS_BYTES else 0.0) + 2 * min(HEAD_CHUNK_BYTES, 4 * tokens * vocab_size)


def _compute_bytes(precision: Precision) -> int:
    return 4 if precision == "float32" else 2


def stack_activation_bytes(shape: ModelShape, *, num_layers: float, sequence_length: int, micro_batch_size: int,
                           tensor_parallel_size: int = 1, sequence_parallel: bool = False,
                           recompute: Recompute = "none", flash_attention: bool = True) -> float:
    """`num_layers` layers' worth of saved activations; with full recomputation plus
    one layer's activations rebuilt during its backward."""
    per_layer = dict(sequence_length=sequence_length, micro_batch_size=micro_batch_size,
                     hidden_size=shape.hidden_size, num_attention_heads=shape.num_attention_heads,
                     tensor_parallel_size=tensor_parallel_size, sequence_parallel=sequence_parallel,
                     flash_attention=flash_attention)
    saved = num_layers * layer_activation_bytes(recompute=recompute, **per_layer)
    if recompute == "full":
        saved += layer_activation_bytes(recompute="none", **per_layer)
    return saved


# ------------------------------------------------------------------ generator
def generator_weight_bytes(shape: ModelShape, *, tensor_parallel_size: int = 1, bytes_per_param: int = 2) -> float:
    """Inference weights on one generation rank (bf16 by default; vLLM splits every
    matrix, embeddings included, over its tensor-parallel ranks)."""
    return shape.parameters * bytes_per_param / tensor_parallel_size


def kv_cache_bytes_per_token(shape: ModelShape, *, tensor_parallel_size: int = 1, bytes_per_value: int = 2) -> int:
    """2 x layers x KV heads on this rank x head_dim x bytes. KV heads are split over
    tensor-parallel ranks and replicated when there are fewer heads than ranks."""
    heads_per_rank = math.ceil(shape.num_key_value_heads / tensor_parallel_size)
    return 2 * shape.num_layers * heads_per_rank * shape.head_dim * bytes_per_value


def kv_cache_bytes(shape: ModelShape, *, num_tokens: int, tensor_parallel_size: int = 1,
                   bytes_per_value: int = 2) -> float:
    """KV cache for `num_tokens` resident tokens (concurrent sequences x max length)."""
    return num_tokens * kv_cache_bytes_per_token(shape, tensor_parallel_size=tensor_parallel_size,
                                                 bytes_per_value=bytes_per_value)


def kv_cache_bytes_from_utilization(*, gpu_memory_bytes: float, gpu_memory_utilization: float,
                                    weight_bytes: float, reserved_bytes: float = 0.0) -> float:
    """vLLM's rule: the engine may use `gpu_memory_utilization` of the GPU; what its
    weights and `reserved_bytes` (activation peak, CUDA graphs) leave is KV cache."""
    return max(0.0, gpu_memory_utilization * gpu_memory_bytes - weight_bytes - reserved_bytes)


def max_kv_cache_tokens(shape: ModelShape, *, kv_bytes: float, tensor_parallel_size: int = 1,
                        bytes_per_value: int = 2) -> int:
    """Tokens that fit in `kv_bytes` of cache on each generation rank."""
    return int(kv_bytes // kv_cache_bytes_per_token(shape, tensor_parallel_size=tensor_parallel_size,
                                                    bytes_per_value=bytes_per_value))


@dataclass(frozen=True, kw_only=True)
class ColocatedGenerator:
    """A generation engine sharing the training GPUs. Give either the resident
    tokens (`num_sequences` x `max_model_len`) or vLLM's `gpu_memory_utilization`
    with `gpu_memory_bytes`."""

    tensor_parallel_size: int = 1
    bytes_per_param: int = 2
    kv_bytes_per_value: int = 2
    num_sequences: int | None = None
    """Sequences decoded at once."""
    max_model_len: int | None = None
    """Prompt + completion tokens per sequence."""
    gpu_memory_utilization: float | None = None
    gpu_memory_bytes: float | None = None

    def footprint(self, shape: ModelShape) -> tuple[float, float]:
        """(weight bytes, KV-cache bytes) on one GPU."""
        weights = generator_weight_bytes(shape, tensor_parallel_size=self.tensor_parallel_size,
                                         bytes_per_param=self.bytes_per_param)
        if self.gpu_memory_utilization is not None:
            if self.gpu_memory_bytes is None:
                raise UserError("ColocatedGenerator: gpu_memory_utilization needs gpu_memory_bytes.")
            return weights, kv_cache_bytes_from_utilization(
                gpu_memory_bytes=self.gpu_memory_bytes, gpu_memory_utilization=self.gpu_memory_utilization,
                weight_bytes=weights)
        if self.num_sequences is None or self.max_model_len is None:
            raise UserError("ColocatedGenerator: give num_sequences and max_model_len, "
                            "or gpu_memory_utilization and gpu_memory_bytes.")
        return weights, kv_cache_bytes(shape, num_tokens=self.num_sequences * self.max_model_len,
                                       tensor_parallel_size=self.tensor_parallel_size,
                                       bytes_per_value=self.kv_bytes_per_value)


# ------------------------------------------------------------------- strategy
@dataclass(frozen=True, kw_only=True)
class Parallelism:
    data_parallel_size: int = 1
    """Replicas (DDP) or the shard group (ZeRO, FSDP2, Megatron's distributed optimizer)."""
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    virtual_pipeline_parallel_size: int = 1
    """Model chunks per pipeline rank (interleaved 1F1B); 1: plain 1F1B."""
    context_parallel_size: int = 1
    """Splits the sequence; Megatron and FSDP2 also shard optimizer state over it."""
    expert_parallel_size: int = 1
    expert_tensor_parallel_size: int = 1
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = True
    """Megatron only: shard the optimizer state over data parallel x context parallel."""
    grad_reduce_in_fp32: bool = False
    """Megatron only: keep the grad buffer in fp32."""
    num_microbatches: int | None = None
    """Micro-batches per step on a pipeline; None: at least pipeline_parallel_size."""


@dataclass(frozen=True, kw_only=True)
class Workload:
    sequence_length: int
    """Tokens per sample (prompt + completion) in a training micro-batch."""
    micro_batch_size: int
    precision: Precision = "bfloat16"
    optimizer: Optimizer = "adam"
    recompute: Recompute = "none"
    """Activation checkpointing: 'full' is what dtensor_cfg.activation_checkpointing does."""
    flash_attention: bool = True


def estimate_memory(shape: ModelShape, *, strategy: str, workload: Workload,
                    parallel: Parallelism = Parallelism(),
                    generator: ColocatedGenerator | None = None) -> MemoryBreakdown:
    """Bytes per GPU for training `shape` with `strategy` (one of STRATEGIES), plus a
    colocated generator's weights and KV cache if given."""
    if strategy not in STRATEGIES:
        raise UserError(f"memory strategy '{strategy}' is not one of {', '.join(STRATEGIES)}.")
    _check_parallelism(strategy, parallel)
    if strategy in _ZERO_STAGE:
        breakdown = _data_parallel(shape, strategy, workload, parallel)
    elif _PARALLEL_SIZES.get(strategy, ()) is None:  # tensor, pipeline, context and expert parallel
        breakdown = _megatron(shape, workload, parallel)
    else:
        breakdown = _fsdp2(shape, strategy, workload, parallel)
    if generator is None:
        return breakdown
    weights, kv = generator.footprint(shape)
    return _replace(breakdown, generator_weights=weights, kv_cache=kv)


def reference_weights(breakdown: MemoryBreakdown, strategy: str, precision: Precision) -> float:
    """A frozen KL reference's weights per GPU beside the policy whose `breakdown` this is, laid out like its
    weights: on the DTensor backend (FSDP2's strategies) in the compute dtype, half the policy's float32 masters
    in bf16 (backends/training/dtensor.py model_weights: a model that does not train keeps none); on ZeRO and
    Megatron as the policy's weights are held."""
    if strategy.startswith("fsdp2") and precision != "float32":
        return breakdown.params / 2
    return breakdown.params


def _check_parallelism(strategy: str, parallel: Parallelism) -> None:
    sizes = {k: v for k, v in asdict(parallel).items() if k.endswith("_size") and v is not None}
    small = [f"{k}={v}" for k, v in sizes.items() if v < 1]
    if small:
        raise UserError(f"parallel sizes must be at least 1: {', '.join(small)}.")
    allowed = _PARALLEL_SIZES.get(strategy, {"data_parallel_size", "context_parallel_size"})
    extra = [f"{k}={v}" for k, v in sizes.items() if v > 1 and allowed is not None and k not in allowed]
    if extra:
        raise UserError(f"strategy '{strategy}' has no {', '.join(extra)}; use 'fsdp2_tp' for tensor "
                        "parallelism or 'megatron' for pipeline and expert parallelism.")


def _replace(breakdown: MemoryBreakdown, **changes: float) -> MemoryBreakdown:
    return MemoryBreakdown(**{**{f.name: getattr(breakdown, f.name) for f in fields(breakdown)}, **changes})


def _data_parallel(shape: ModelShape, strategy: str, work: Workload, parallel: Parallelism) -> MemoryBreakdown:
    """DDP and DeepSpeed ZeRO 1-3: the ZeRO paper's split, whole model on each rank.
    DeepSpeed's ZeRO optimizer keeps an fp32 master partition even when training in
    fp32, so stages 1-3 in fp32 hold 4 + 4 + 12 (measured: benchmarks/results/memory_cpu.md)."""
    stage = _ZERO_STAGE[strategy]
    per_parameter = bytes_per_parameter(work.precision, work.optimizer)
    if stage >= 1 and work.precision == "float32":
        per_parameter = BytesPerParameter(per_parameter.weights, per_parameter.grads, per_parameter.optimizer + 4)
    weights, grads, optimizer = zero_model_states(shape.parameters, stage=stage,
                                                  data_parallel_size=parallel.data_parallel_size,
                                                  per_parameter=per_parameter)
    gathered = _gathered_units(shape, work.precision, tensor_parallel_size=1) if stage == 3 else 0.0
    notes = ("ZeRO-3 working copies are approximated as FSDP2's: the root unit and two layers",) if stage == 3 else ()
    return MemoryBreakdown(params=weights, grads=grads, optimizer=optimizer, gathered_params=gathered,
                           activations=_full_model_activations(shape, work, parallel, tensor_parallel_size=1),
                           notes=notes)


def _fsdp2(shape: ModelShape, strategy: str, work: Workload, parallel: Parallelism) -> MemoryBreakdown:
    """FSDP2 as novarl's DTensor backend applies it: each decoder layer, then the root
    (embeddings, final norm, lm_head) sharded over dp x cp. TP (fsdp2_tp) splits the
    decoder layers, and the embeddings and head over the vocabulary (_root_per_rank). On one device
    (no offload) the same states, without FSDP2 (_one_device_copies)."""
    tp = parallel.tensor_parallel_size
    shards = parallel.data_parallel_size * parallel.context_parallel_size
    root = _root_per_rank(shape, tp)
    resident = (root + shape.num_layers * shape.layer_parameters / tp) / shards
    per_parameter = fsdp2_bytes_per_parameter(work.precision, work.optimizer)
    states = (resident * per_parameter.weights, resident * per_parameter.grads, resident * per_parameter.optimizer)
    activations = _full_model_activations(shape, work, parallel, tensor_parallel_size=tp) \
        + _context_parallel_kv(shape, work, parallel, tensor_parallel_size=tp)
    if shards == 1 and tp == 1 and strategy != "fsdp2_offload":
        gathered = _one_device_copies(shape, work.precision)
    else:
        gathered = _gathered_units(shape, work.precision, tensor_parallel_size=tp,
                                   whole=shards == 1 and strategy != "fsdp2_offload")
    if strategy != "fsdp2_offload":
        return MemoryBreakdown(params=states[0], grads=states[1], optimizer=states[2],
                               gathered_params=gathered, activations=activations)
    note = ("CPU offload: sharded weights, grads and optimizer state live in host memory and the "
            "optimizer steps there; the GPU keeps the gathered working copies and activations")
    return MemoryBreakdown(params=0.0, grads=0.0, optimizer=0.0, gathered_params=gathered,
                           activations=activations, cpu_offloaded=sum(states), notes=(note,))


def _context_parallel_kv(shape: ModelShape, work: Workload, parallel: Parallelism, *,
                         tensor_parallel_size: int) -> float:
    """novarl's DTensor context parallelism all-gathers each layer's keys and values
    (models/context_parallel.py) and keeps them for the backward: the other cp ranks' share of
    the sequence's K and V, per layer saved (one layer under full recomputation)."""
    cp = parallel.context_parallel_size
    if cp == 1:
        return 0.0
    compute_bytes = _compute_bytes(work.precision)
    heads = math.ceil(shape.num_key_value_heads / tensor_parallel_size)
    per_layer = 2 * work.sequence_length * (cp - 1) / cp * work.micro_batch_size * heads * shape.head_dim
    layers = 1 if work.recompute == "full" else shape.num_layers
    return per_layer * compute_bytes * layers


def _one_device_copies(shape: ModelShape, precision: Precision) -> float:
    """The DTensor backend's model on one device (backends/training/one_device.py): every weight's copy in the
    compute dtype through a pass, and the compute-dtype gradient of one weight at a time (the largest's) before
    it is added to the float32 one; nothing in float32 (the weights compute as they are)."""
    if precision == "float32":
        return 0.0
    compute_bytes = _compute_bytes(precision)
    return compute_bytes * (shape.parameters + largest_weight(shape))


def _root_per_rank(shape: ModelShape, tensor_parallel_size: int) -> float:
    """The parameters outside the decoder layers (embeddings, final norm, head) a tensor-parallel rank of the
    DTensor backend holds before FSDP2 shards them (models/vocab_parallel.py): the embeddings and a head that
    picks split over the vocabulary; embeddings tied to a head that does not pick whole with it. (A
    custom_parallel_plan, which leaves both whole, is not modelled.)"""
    root = shape.parameters - shape.num_layers * shape.layer_parameters
    embeddings = shape.embedding_parameters if shape.picking_head or not shape.tie_word_embeddings else 0
    split = embeddings + (shape.lm_head_parameters if shape.picking_head else 0)
    return root - split * (1 - 1 / tensor_parallel_size)


def _gathered_units(shape: ModelShape, precision: Precision, *, tensor_parallel_size: int,
                    whole: bool = False) -> float:
    """Unsharded copies during compute: the root unit (embeddings, final norm, lm_head;
    FSDP2 keeps the root gathered from forward to backward), the current and the
    prefetched layer in the compute dtype (every layer where `whole`: one data-parallel shard keeps
    its gathered copies through the micro-batches, backends/training/parallelize.py keeps_gathered),
    and one unit's unsharded fp32 gradient before its reduce-scatter (a layer's, or where `whole`
    a run of layers_per_kept_unit layers': parallelize.py fsdp_units)."""
    compute_bytes = _compute_bytes(precision)
    layer = shape.layer_parameters / tensor_parallel_size
    root = _root_per_rank(shape, tensor_parallel_size)
    unit = layers_per_kept_unit(int(layer), shape.num_layers) * layer if whole else layer
    return compute_bytes * (root + (shape.num_layers if whole else 2) * layer) + 4 * unit


def _full_model_activations(shape: ModelShape, work: Workload, parallel: Parallelism, *,
                            tensor_parallel_size: int) -> float:
    sequence = math.ceil(work.sequence_length / parallel.context_parallel_size)
    layers = stack_activation_bytes(
        shape, num_layers=shape.num_layers, sequence_length=sequence, micro_batch_size=work.micro_batch_size,
        tensor_parallel_size=tensor_parallel_size, sequence_parallel=parallel.sequence_parallel,
        recompute=work.recompute, flash_attention=work.flash_attention)
    if work.precision == "float32":  # the formula counts 16-bit activations
        layers *= 2
    return layers + _output_bytes(shape, work, sequence, picks=shape.picking_head,
                                  tensor_parallel_size=tensor_parallel_size if shape.picking_head else 1)


def _output_bytes(shape: ModelShape, work: Workload, sequence: int, *, picks: bool,
                  tensor_parallel_size: int = 1) -> float:
    """The output layer's activations for a micro-batch of `sequence`-token rows: a picking head's
    (picked_output_bytes), else the fp32 logits over this rank's part of the vocabulary."""
    if picks:
        return picked_output_bytes(tokens=sequence * work.micro_batch_size,
                                   vocab_size=math.ceil(shape.vocab_size / tensor_parallel_size),
                                   compute_bytes=_compute_bytes(work.precision))
    return output_activation_bytes(sequence_length=sequence, micro_batch_size=work.micro_batch_size,
                                   vocab_size=shape.vocab_size, tensor_parallel_size=tensor_parallel_size)


# ------------------------------------------------------------------- megatron
@dataclass(frozen=True)
class _Stage:
    name: str
    layers: int
    dense_parameters: float
    """On this rank: TP-split layers' attention/norms/router, embeddings or lm_head."""
    expert_parameters: float
    activations: float


def _megatron(shape: ModelShape, work: Workload, parallel: Parallelism) -> MemoryBreakdown:
    """Megatron TP x PP (x CP, EP): the heavier of the first and last pipeline stage.

    Dense weights split over tp, routed experts over ep x expert tp, layers over pp
    (the first stage gets the remainder); embeddings and lm_head are vocab-parallel
    over tp, on the first and the last stage (tied weights: a copy on each when
    pp > 1). The distributed optimizer shards dense state over dp x cp and expert
    state over the expert data-parallel group dp x cp x tp / (ep x etp)."""
    tp, pp, ep, etp = (parallel.tensor_parallel_size, parallel.pipeline_parallel_size,
                       parallel.expert_parallel_size, parallel.expert_tensor_parallel_size)
    if shape.num_layers < pp:
        raise UserError(f"pipeline_parallel_size={pp} is more than the model's {shape.num_layers} layers.")
    if (parallel.data_parallel_size * parallel.context_parallel_size * tp) % (ep * etp):
        raise UserError(f"expert_parallel_size x expert_tensor_parallel_size = {ep} x {etp} must divide "
                        f"data_parallel x context_parallel x tensor_parallel = "
                        f"{parallel.data_parallel_size} x {parallel.context_parallel_size} x {tp}.")
    stages = [_megatron_stage(shape, work, parallel, first=True)]
    if pp > 1:
        stages.append(_megatron_stage(shape, work, parallel, first=False))
    per_parameter = megatron_bytes_per_parameter(work.precision, work.optimizer,
                                                 grad_reduce_in_fp32=parallel.grad_reduce_in_fp32)
    dense_shards = parallel.data_parallel_size * parallel.context_parallel_size
    expert_shards = dense_shards * tp // (ep * etp)
    results = []
    for stage in stages:
        parameters = stage.dense_parameters + stage.expert_parameters
        if parallel.use_distributed_optimizer:
            optimizer_params = stage.dense_parameters / dense_shards + stage.expert_parameters / expert_shards
        else:
            optimizer_params = parameters
        results.append(MemoryBreakdown(
            params=parameters * per_parameter.weights, grads=parameters * per_parameter.grads,
            optimizer=optimizer_params * per_parameter.optimizer, activations=stage.activations,
            notes=(f"{stage.name} pipeline stage ({stage.layers} layers), the heavier one",)))
    return max(results, key=lambda result: result.training)


def _megatron_stage(shape: ModelShape, work: Workload, parallel: Parallelism, *, first: bool) -> _Stage:
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    experts_per_layer = shape.expert_parameters_per_layer / (parallel.expert_parallel_size
                                                             * parallel.expert_tensor_parallel_size)
    dense_per_layer = (shape.layer_parameters - shape.expert_parameters_per_layer) / tp
    last = not first or pp == 1
    layers = math.ceil(shape.num_layers / pp) if first else shape.num_layers // pp
    dense = layers * dense_per_layer
    if first:
        dense += shape.embedding_parameters / tp
    if last:
        head = shape.lm_head_parameters or (shape.embedding_parameters if pp > 1 else 0)
        dense += head / tp + shape.hidden_size
    sequence = math.ceil(work.sequence_length / parallel.context_parallel_size)
    in_flight = 1.0
    if first:
        in_flight = min(pp, parallel.num_microbatches or pp)
        if parallel.virtual_pipeline_parallel_size > 1:
            in_flight *= 1 + (pp - 1) / (pp * parallel.virtual_pipeline_parallel_size)
    activations = stack_activation_bytes(
        shape, num_layers=layers * in_flight, sequence_length=sequence, micro_batch_size=work.micro_batch_size,
        tensor_parallel_size=tp, sequence_parallel=parallel.sequence_parallel, recompute=work.recompute,
        flash_attention=work.flash_attention)
    if last:  # the output layer (any converted architecture's) picks but under context parallelism (megatron_model.py)
        picks = parallel.context_parallel_size == 1
        activations += _output_bytes(shape, work, sequence, picks=picks, tensor_parallel_size=tp)
    return _Stage("first" if first else "last", layers, dense, layers * experts_per_layer, activations)
