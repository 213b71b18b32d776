"""Which training layout to run a model on: the seeds' decision tree, checked
and if need be overridden by the memory model (`novarl.plan.memory`).

    advice = advise(ModelShape.from_name("7.5B"), gpus_per_node=8, num_nodes=1, sequence_length=4096)
    advice.recommended, advice.explanation, advice.to_dict()

The decision tree (seed 000, NeMo RL's backend guide), by total parameters (size
classes: a 70B model, 70.6B for Llama 3, is in the 10B-70B branch; see LARGE_MODEL):
    < 10B                    DTensor + vLLM
    10B-70B, single node     DTensor + vLLM (TP=8)
    10B-70B, multi-node      Megatron + vLLM
    > 70B                    Megatron + Megatron generation
Its pick is made concrete as a plain layout (DTensor: FSDP2 over every training
GPU, no TP; Megatron: the largest TP in a node and the shallowest pipeline that
fits). It is recommended when it fits; otherwise the fastest candidate that
fits is, and the explanation says why, with the numbers.

Fitting. A candidate fits when its peak per-GPU memory is at most HEADROOM
(90 %) of `gpu_memory_gb` (GB = 1e9 bytes; an "80 GB" card holds 80 GiB = 85.9
GB, so 80 is conservative) and its generator holds its weights plus the KV cache
of one full sequence. Activations are first taken without recomputation; a
layout that only fits with full activation checkpointing is listed with it.
Peak memory by placement:
    colocated vLLM      max(training, generation): vLLM sleeps while training
                        runs (novarl's vLLM backend does), the training roles'
                        states wait in host memory while it generates
                        (distributed/parking.py), and it takes
                        COLOCATED_VLLM_UTILIZATION (0.6, the seeds' default) of
                        the GPU when it generates.
    dedicated vLLM      training only; the generator gets its own GPUs (the last
                        node) with DEDICATED_VLLM_UTILIZATION of each.
    Megatron generation the training weights serve generation in place, so the
                        peak is max(training, model states + the KV buffer,
                        `mcore_generation_config.buffer_size_gb` = 20 GB).

Placement rule (seed 000: colocated is the default and "good for small-medium
models", dedicated is "recommended for large models"): colocated when the
model has < 10B parameters or the cluster is one node (there is no second node
to dedicate); dedicated otherwise, giving the last node to vLLM. Megatron
generation is always colocated: it runs on the training weights.

Expected-throughput score: relative training throughput per GPU, 1.0 for plain
data parallelism (DDP), the product of these factors (seed 004's rules of thumb
where it has one, our estimate where it has none):
    FSDP2 / ZeRO-3 sharding, dp > 1  x0.85  seed 004: 10-20 % slower than DDP
    ZeRO-2, Megatron                 x1.0   seed 004: ZeRO-2 near-DDP; Megatron
                                            highest throughput at scale
    sharded weights over nodes       x0.9   FSDP2/ZeRO-3 gather every layer's
                                            weights over InfiniBand, not NVLink
    tensor parallel, per doubling    x0.97  seed 004: near-linear to 8 GPUs,
                                            TP stays inside a node (NVLink)
    pipeline parallel                x(1 - (p-1)/(m+p-1)), the 1F1B bubble with
                                            m = ASSUMED_MICROBATCHES (8)
    interleaved pipeline, v chunks   x(1 - (p-1)/(v m+p-1)) instead, and x0.98 for
                                            v times the point-to-point sends
    context parallel, per doubling   x0.95  keys and values all-gathered per layer
    CPU offload                      x0.3   PCIe transfers and a CPU optimizer step
    full activation checkpointing    x0.75  one more forward: ~4/3 the compute
Candidates are ranked: those that fit first, then by score, then by lower peak.
The score compares training layouts; it does not model generation speed.

Enumerated: DTensor FSDP2; FSDP2 + TP (TP in {2, 4, 8} dividing the GPUs per
node and the attention heads); FSDP2 + CPU offload; DeepSpeed ZeRO-2 and
ZeRO-3; Megatron TP x PP (the same TPs, PP a power of two dividing the training
GPUs / TP, at most the layers; per TP the pipeline deepens only until a layout
fits, deeper ones only add bubble; a pipeline whose stages split evenly into
VIRTUAL_PIPELINE_SIZE (2) chunks runs interleaved where that still fits, except
under Megatron generation), and for a Mixture-of-Experts model each
expert-parallel size EP (a power of two dividing the experts and data x tensor
parallelism: whole experts, expert TP 1), scored x0.97 per doubling for the token
all-to-all and x0.7 when the expert group spans nodes. A Mixture-of-Experts model's
tree pick on Megatron is its best-scored fitting layout (expert tensor parallelism stays 1, as in
the recipes NeMo RL and ROLL ship; the memory model counts it where a config sets it). Context
parallelism (DTensor, tp 1, plain causal attention) is tried with recomputation when
recomputation alone does not fit. A layout is `built` when novarl has both its training and its generation
backend (every listed one has both today). The seeds' decision tree, its pick among these layouts and the
explanation are in plan/tree.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from novarl.errors import UserError
from novarl.plan.memory import (
    GB,
    ColocatedGenerator,
    MemoryBreakdown,
    Parallelism,
    Precision,
    Workload,
    estimate_memory,
    generator_weight_bytes,
    kv_cache_bytes,
    reference_weights,
)
from novarl.backends.contract.model_shape import ModelShape
from novarl.backends import registry
from novarl.backends.contract.resolve import BUILT_TRAINING_BACKENDS
from novarl.backends.registry import PREFERRED_GENERATION, generation_spec, training_spec
from novarl.plan.tree import SMALL_MODEL, explain, placement_for, tree_branch, tree_pick

HEADROOM = 0.9
"""Share of the GPU memory a layout may plan to use (the rest: CUDA context,
allocator fragmentation, NCCL buffers)."""
COLOCATED_VLLM_UTILIZATION = 0.6
DEDICATED_VLLM_UTILIZATION = 0.9
MEGATRON_GENERATION_BUFFER_GB = 20.0
ASSUMED_MICROBATCHES = 8
TENSOR_PARALLEL_SIZES = (1, 2, 4, 8)

Placement = Literal["colocated", "dedicated"]


@dataclass(frozen=True)
class _Layout:
    """A training layout before it is sized: what the memory model is asked about."""

    strategy: str
    backend: str
    memory_strategy: str
    """A key of `novarl.plan.memory.STRATEGIES`."""
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    expert_parallel_size: int = 1


@dataclass(frozen=True, kw_only=True)
class Candidate:
    strategy: str
    """'dtensor fsdp2', 'dtensor fsdp2+tp', 'dtensor fsdp2 + cpu offload',
    'deepspeed zero-2', 'deepspeed zero-3' or 'megatron tp x pp'."""
    training_backend: str
    """'dtensor', 'deepspeed' or 'megatron'."""
    built: bool
    """novarl has this training backend today."""
    data_parallel_size: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    context_parallel_size: int
    training_gpus: int
    generation_backend: str
    """'vllm' or 'megatron'."""
    generation_tp: int
    placement: Placement
    activation_checkpointing: bool
    """True: fits only with full activation recomputation."""
    memory_gb: dict[str, float]
    """Per training GPU, GB: MemoryBreakdown.as_dict_gb() plus 'peak' (see the module docstring)."""
    fits: bool
    score: float
    """Relative expected training throughput per GPU (1.0: DDP)."""
    score_factors: tuple[str, ...]
    notes: tuple[str, ...] = ()
    expert_parallel_size: int = 1
    """Megatron: ranks a Mixture-of-Experts layer's experts are spread over (whole experts)."""
    virtual_pipeline_parallel_size: int = 1
    """Megatron: model chunks per pipeline stage (interleaved 1F1B); 1: plain 1F1B."""

    @property
    def peak_gb(self) -> float:
        return self.memory_gb["peak"]

    @property
    def zero_stage(self) -> int | None:
        """DeepSpeed's ZeRO stage of a 'deepspeed zero-N' layout, else None."""
        return int(self.strategy[-1]) if self.strategy.startswith("deepspeed zero-") else None

    @property
    def parallel_sizes(self) -> str:
        return (f"dp={self.data_parallel_size} tp={self.tensor_parallel_size} "
                f"pp={self.pipeline_parallel_size} cp={self.context_parallel_size}"
                + (f" vpp={self.virtual_pipeline_parallel_size}" if self.virtual_pipeline_parallel_size > 1 else "")
                + (f" ep={self.expert_parallel_size}" if self.expert_parallel_size > 1 else ""))

    def describe(self) -> str:
        return (f"{self.strategy} ({self.parallel_sizes}{', activation checkpointing' * self.activation_checkpointing})"
                f" + {self.generation_backend} generation TP={self.generation_tp}, {self.placement}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy, "training_backend": self.training_backend, "built": self.built,
            "parallel": {"dp": self.data_parallel_size, "tp": self.tensor_parallel_size,
                         "pp": self.pipeline_parallel_size, "vpp": self.virtual_pipeline_parallel_size,
                         "cp": self.context_parallel_size, "ep": self.expert_parallel_size},
            "training_gpus": self.training_gpus,
            "generation": {"backend": self.generation_backend, "tensor_parallel_size": self.generation_tp},
            "placement": self.placement, "activation_checkpointing": self.activation_checkpointing,
            "memory_gb": {k: round(v, 3) for k, v in self.memory_gb.items()},
            "fits": self.fits, "score": round(self.score, 4), "score_factors": list(self.score_factors),
            "notes": list(self.notes),
        }


@dataclass(frozen=True, kw_only=True)
class Advice:
    candidates: list[Candidate]
    """Ranked: those that fit first, then by score."""
    recommended: Candidate | None
    """None when nothing fits."""
    tree_pick: Candidate
    """The seeds' decision tree's choice as a concrete layout."""
    tree_branch: str
    """'<10B', '10B-70B single node', '10B-70B multi-node' or '>70B'."""
    explanation: list[str]
    gpu_memory_gb: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "recommended": self.recommended.to_dict() if self.recommended else None,
            "tree_branch": self.tree_branch,
            "tree_pick": self.tree_pick.to_dict(),
            "explanation": list(self.explanation),
            "gpu_memory_gb": self.gpu_memory_gb,
            "headroom": HEADROOM,
            "candidates": [candidate.to_dict() for candidate in self.candidates],
        }


# ------------------------------------------------------------------ the tree


# ------------------------------------------------------------------ advise
def advise(shape: ModelShape, *, gpus_per_node: int, num_nodes: int, gpu_memory_gb: float = 80,
           sequence_length: int, micro_batch_size: int = 1, precision: Precision = "bfloat16",
           generation_tp: int | None = None, with_reference: bool = False, with_critic: bool = False,
           packed_row_tokens: int | None = None) -> Advice:
    """Rank the training layouts for `shape` on `num_nodes` x `gpus_per_node` GPUs of
    `gpu_memory_gb` GB each, and recommend one (see the module docstring). with_reference:
    a KL penalty keeps a frozen copy of the weights beside the policy's on each GPU. with_critic:
    PPO's critic keeps a second set of model states (weights, gradients, optimizer) beside them.
    packed_row_tokens: sequence packing's row (train_mb_tokens), what a micro-batch's
    activations are sized by instead of micro_batch_size x sequence_length."""
    if gpus_per_node < 1 or num_nodes < 1:
        raise UserError(f"the advisor plans for GPUs: cluster {num_nodes} node(s) x {gpus_per_node} GPU(s) has none.")
    if gpu_memory_gb <= 0 or sequence_length < 1 or micro_batch_size < 1:
        raise UserError("gpu_memory_gb, sequence_length and micro_batch_size must be positive.")
    branch = tree_branch(shape, num_nodes=num_nodes)
    tps = valid_tensor_parallel_sizes(shape, gpus_per_node=gpus_per_node)
    if generation_tp is not None and generation_tp not in tps:
        raise UserError(f"generation TP {generation_tp} must be one of {tps}: it must divide the "
                        f"{gpus_per_node} GPUs per node and the {shape.num_attention_heads} attention heads.")
    context = _Context(shape=shape, gpus_per_node=gpus_per_node, num_nodes=num_nodes, gpu_memory_gb=gpu_memory_gb,
                       workload=Workload(sequence_length=packed_row_tokens or sequence_length,
                                         micro_batch_size=1 if packed_row_tokens else micro_batch_size,
                                         precision=precision),
                       sequence_length=sequence_length,
                       generation_tp=generation_tp, tps=tps, branch=branch, with_reference=with_reference,
                       with_critic=with_critic)
    candidates = _candidates(context)
    ranked = sorted(candidates, key=lambda c: (not c.fits, -c.score, c.peak_gb))
    pick = tree_pick(context, candidates)
    fitting = [c for c in ranked if c.fits]
    recommended = pick if pick.fits else (fitting[0] if fitting else None)
    return Advice(candidates=ranked, recommended=recommended, tree_pick=pick, tree_branch=branch,
                  explanation=explain(context, pick, recommended, fitting), gpu_memory_gb=gpu_memory_gb)


def valid_tensor_parallel_sizes(shape: ModelShape, *, gpus_per_node: int) -> list[int]:
    """TP sizes in {1, 2, 4, 8} that divide the GPUs per node (TP stays on NVLink) and the heads."""
    return [t for t in TENSOR_PARALLEL_SIZES if gpus_per_node % t == 0 and shape.num_attention_heads % t == 0]


@dataclass(frozen=True, kw_only=True)
class _Context:
    shape: ModelShape
    gpus_per_node: int
    num_nodes: int
    gpu_memory_gb: float
    workload: Workload
    """A training micro-batch (a packed row when packing)."""
    sequence_length: int
    """The longest sequence: what one sequence's KV cache is sized by."""
    generation_tp: int | None
    tps: list[int]
    branch: str
    with_reference: bool = False
    with_critic: bool = False

    @property
    def budget_gb(self) -> float:
        return HEADROOM * self.gpu_memory_gb


def _candidates(context: _Context) -> list[Candidate]:
    layouts = [_Layout("dtensor fsdp2", "dtensor", "fsdp2")]
    layouts += [_Layout("dtensor fsdp2+tp", "dtensor", "fsdp2_tp", tensor_parallel_size=tp)
                for tp in context.tps if tp > 1 and context.shape.heads_split]
    layouts += [_Layout("dtensor fsdp2 + cpu offload", "dtensor", "fsdp2_offload"),
                _Layout("deepspeed zero-2", "deepspeed", "zero2"),
                _Layout("deepspeed zero-3", "deepspeed", "zero3")]
    candidates = [_size(context, layout) for layout in layouts]
    return candidates + _megatron_candidates(context)


def _megatron_candidates(context: _Context) -> list[Candidate]:
    """For each TP (and each expert-parallel size of a Mixture-of-Experts model), pipelines
    from the shallowest, deepening until one fits."""
    found = []
    generation = "megatron" if context.branch == ">70B" else "vllm"
    training_gpus = _training_gpus(context, generation)
    for tp in context.tps:
        for ep in expert_parallel_sizes(context.shape, training_gpus):
            pp = 1
            while (training_gpus // tp) % pp == 0 and pp <= context.shape.num_layers:
                if (training_gpus // pp) % ep:  # whole experts over ranks of dp x tp (etp = 1)
                    break
                candidate = _size(context, _Layout("megatron tp x pp", "megatron", "megatron", tp, pp, ep))
                found.append(candidate)
                if candidate.fits:
                    break
                pp *= 2
    return found


def expert_parallel_sizes(shape: ModelShape, training_gpus: int) -> list[int]:
    """1 for a dense model; for a Mixture-of-Experts model the powers of two that divide its
    experts and the training GPUs (megatron-core spreads whole experts over the ranks of
    data x tensor parallelism)."""
    if shape.num_experts <= 1:
        return [1]
    sizes, ep = [], 1
    while ep <= min(shape.num_experts, training_gpus):
        if not shape.num_experts % ep and not training_gpus % ep:
            sizes.append(ep)
        ep *= 2
    return sizes


CONTEXT_PARALLEL_SIZES = (2, 4, 8)
"""What the advisor tries, in order, when recomputation alone does not fit the activations."""
VIRTUAL_PIPELINE_SIZE = 2
"""Model chunks per stage the advisor tries on a Megatron pipeline (interleaved 1F1B)."""


def _virtual_stages(context: _Context, layout: _Layout, generation: str) -> tuple[int, ...]:
    """The virtual pipeline sizes to try, preferred first: interleaving on a Megatron pipeline whose
    stages' layers split evenly into chunks (and not under Megatron generation, which runs one
    chunk per stage), else none."""
    pp, v = layout.pipeline_parallel_size, VIRTUAL_PIPELINE_SIZE
    if not training_spec(layout.backend).pipeline or pp == 1 or generation_spec(generation).on_training_weights \
            or context.shape.num_layers % (pp * v):
        return (1,)
    return (v, 1)


def _generation_backend(context: _Context, layout: _Layout) -> str:
    """The tree's generation: the training backend's own above 70B where it has one, else vLLM."""
    own = training_spec(layout.backend).own_generation
    return own if own and context.branch == ">70B" else PREFERRED_GENERATION


def _training_gpus(context: _Context, generation_backend: str) -> int:
    placement = placement_for(context.shape, num_nodes=context.num_nodes, generation_backend=generation_backend)
    nodes = context.num_nodes - (1 if placement == "dedicated" else 0)
    return nodes * context.gpus_per_node


def _size(context: _Context, layout: _Layout) -> Candidate:
    """Size `layout` with the memory model: without recomputation, else with full recomputation."""
    generation = _generation_backend(context, layout)
    placement = placement_for(context.shape, num_nodes=context.num_nodes, generation_backend=generation)
    training_gpus = _training_gpus(context, generation)
    tp, pp, ep = layout.tensor_parallel_size, layout.pipeline_parallel_size, layout.expert_parallel_size
    dp = training_gpus // (tp * pp)
    generation_tp = tp if generation_spec(generation).on_training_weights else _vllm_tp(context, placement)
    spec = training_spec(layout.backend)
    parallel = Parallelism(data_parallel_size=dp, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                           expert_parallel_size=ep, sequence_parallel=spec.sequence_parallel_with_tp and tp > 1,
                           num_microbatches=ASSUMED_MICROBATCHES if pp > 1 else None)
    # recomputation first; then, where the activations still decide (long sequences), context
    # parallelism (DTensor's: models/context_parallel.py) splitting each sequence over cp ranks
    # On a Megatron pipeline, interleaved stages where they fit (a smaller bubble for a little more
    # of the first stage's activations), without recomputation before with it.
    tries = [(recompute, 1, vpp) for recompute in ("none", "full")
             for vpp in _virtual_stages(context, layout, generation)]
    if spec.context_parallel and tp == 1 and context.shape.plain_causal_attention:  # what novarl's cp runs
        tries += [("full", cp, 1) for cp in CONTEXT_PARALLEL_SIZES if not dp % cp]
    for recompute, cp, vpp in tries:
        workload = dataclasses.replace(context.workload, recompute=recompute)
        sized = dataclasses.replace(parallel, data_parallel_size=dp // cp, context_parallel_size=cp,
                                    virtual_pipeline_parallel_size=vpp)
        breakdown = _breakdown(context, layout, workload, sized, generation, placement, generation_tp)
        peak = _peak(breakdown, placement, generation)
        generator_fits = _generator_fits(context, generation, placement, generation_tp)
        fits = peak <= context.budget_gb * GB and generator_fits
        if fits:
            break
    if not fits:  # report the plain layout: no context parallelism, no interleaving
        recompute, cp, vpp = "full", 1, 1
        breakdown = _breakdown(context, layout, workload, parallel, generation, placement, generation_tp)
        peak = _peak(breakdown, placement, generation)
    notes = list(breakdown.notes)
    if vpp > 1:
        notes.append(f"interleaved pipeline: {vpp} model chunks per stage "
                     f"(policy.megatron_cfg.virtual_pipeline_model_parallel_size={vpp}) cut the bubble {vpp}x")
    if cp > 1:
        notes.append(f"context parallelism {cp}: the activations of {context.sequence_length}-token sequences "
                     "decide, so each sequence is split over "
                     f"{cp} ranks (policy.dtensor_cfg.context_parallel_size={cp})")
    if not generator_fits:
        notes.append(f"{generation} generation at TP={generation_tp} does not hold the weights and one "
                     f"{context.sequence_length}-token sequence of KV cache")
    if placement == "dedicated":
        notes.append(f"generation on the last node: {context.gpus_per_node // generation_tp} vLLM engine(s) "
                     f"of TP={generation_tp}")
    score, factors = _score(context, layout, dp=dp // cp, recompute=recompute, cp=cp, vpp=vpp)
    built = layout.backend in BUILT_TRAINING_BACKENDS and generation in registry.GENERATION
    return Candidate(strategy=layout.strategy, training_backend=layout.backend, built=built,
                     data_parallel_size=dp // cp, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                     context_parallel_size=cp, virtual_pipeline_parallel_size=vpp,
                     expert_parallel_size=ep,
                     training_gpus=training_gpus, generation_backend=generation, generation_tp=generation_tp,
                     placement=placement, activation_checkpointing=recompute == "full",
                     memory_gb={**breakdown.as_dict_gb(), "peak": peak / GB}, fits=fits, score=score,
                     score_factors=factors, notes=tuple(notes))


def _breakdown(context: _Context, layout: _Layout, workload: Workload, parallel: Parallelism,
               generation: str, placement: Placement, generation_tp: int) -> MemoryBreakdown:
    memory_bytes = context.gpu_memory_gb * GB
    generator = None
    on_weights = generation_spec(generation).on_training_weights
    if not on_weights and placement == "colocated":
        generator = ColocatedGenerator(tensor_parallel_size=generation_tp, gpu_memory_bytes=memory_bytes,
                                       gpu_memory_utilization=COLOCATED_VLLM_UTILIZATION)
    breakdown = estimate_memory(context.shape, strategy=layout.memory_strategy, workload=workload,
                                parallel=parallel, generator=generator)
    if on_weights:  # generation on the training weights: no second copy, a KV buffer
        breakdown = dataclasses.replace(breakdown, kv_cache=MEGATRON_GENERATION_BUFFER_GB * GB)
    if context.with_reference:  # the reference is sharded like the policy's weights
        breakdown = dataclasses.replace(breakdown, reference_weights=reference_weights(
            breakdown, layout.memory_strategy, workload.precision))
    if context.with_critic:  # PPO's critic: model states of its own, sharded like the policy's
        breakdown = dataclasses.replace(breakdown, critic_states=breakdown.model_states)
    return breakdown


def _peak(breakdown: MemoryBreakdown, placement: Placement, generation: str) -> float:
    if generation_spec(generation).on_training_weights:
        return max(breakdown.training, breakdown.model_states + breakdown.reference_weights + breakdown.critic_states
                   + breakdown.kv_cache)
    if placement == "colocated":
        return max(breakdown.training, breakdown.generation)
    return breakdown.training


def _generator_fits(context: _Context, generation: str, placement: Placement, generation_tp: int) -> bool:
    if generation_spec(generation).on_training_weights:
        return True  # its weights are the training weights, checked in the peak
    return _vllm_need(context, generation_tp) <= _vllm_share(placement) * context.gpu_memory_gb * GB


def _vllm_need(context: _Context, generation_tp: int) -> float:
    """Bytes one vLLM rank needs at least: bf16 weights and one full sequence of KV cache."""
    return (generator_weight_bytes(context.shape, tensor_parallel_size=generation_tp)
            + kv_cache_bytes(context.shape, num_tokens=context.sequence_length,
                             tensor_parallel_size=generation_tp))


def _vllm_share(placement: Placement) -> float:
    return COLOCATED_VLLM_UTILIZATION if placement == "colocated" else DEDICATED_VLLM_UTILIZATION


def _vllm_tp(context: _Context, placement: Placement) -> int:
    """The user's TP; for >= 10B the seeds' TP=8 (the largest valid up to 8); for a
    small model the smallest TP whose weights and one sequence fit vLLM's share."""
    if context.generation_tp is not None:
        return context.generation_tp
    if context.shape.parameters >= SMALL_MODEL:
        return context.tps[-1]
    budget = _vllm_share(placement) * context.gpu_memory_gb * GB
    return next((t for t in context.tps if _vllm_need(context, t) <= budget), context.tps[-1])


# ------------------------------------------------------------------ score
_SHARDING = {"fsdp2": 0.85, "fsdp2_tp": 0.85, "fsdp2_offload": 0.85, "zero3": 0.85, "zero2": 1.0, "megatron": 1.0}


def _score(context: _Context, layout: _Layout, *, dp: int, recompute: str, cp: int = 1, vpp: int = 1
           ) -> tuple[float, tuple[str, ...]]:
    """Relative training throughput per GPU and the factors it is made of (module docstring)."""
    score, factors = 1.0, []

    def apply(factor: float, why: str) -> None:
        nonlocal score
        score *= factor
        factors.append(f"x{factor:.3g} {why}")

    sharding = _SHARDING[layout.memory_strategy]
    if sharding != 1.0 and dp > 1:
        apply(sharding, "sharded weights (FSDP/ZeRO-3: 10-20% slower than DDP)")
    tp, pp = layout.tensor_parallel_size, layout.pipeline_parallel_size
    if layout.memory_strategy in ("fsdp2", "fsdp2_tp", "fsdp2_offload", "zero3") and dp * tp > context.gpus_per_node:
        apply(0.9, "weights gathered across nodes")
    if tp > 1:
        apply(0.97 ** (tp.bit_length() - 1), f"tensor parallel {tp} within a node")
    if pp > 1 and vpp == 1:
        m = ASSUMED_MICROBATCHES
        apply(1 - (pp - 1) / (m + pp - 1), f"pipeline bubble (p-1)/(m+p-1), p={pp}, m={m}")
    elif pp > 1:  # interleaved 1F1B: each stage's bubble is one chunk's, 1/v of the stage's work
        m = ASSUMED_MICROBATCHES
        apply(1 - (pp - 1) / (vpp * m + pp - 1), f"pipeline bubble (p-1)/(v m+p-1), p={pp}, v={vpp}, m={m}")
        apply(0.98, f"interleaved pipeline: {vpp}x the point-to-point sends")
    ep = layout.expert_parallel_size
    if ep > 1:  # every MoE layer sends its tokens to the experts' ranks and back (all-to-all)
        apply(0.97 ** (ep.bit_length() - 1), f"expert parallel {ep}: token all-to-all")
        if ep * tp > context.gpus_per_node:
            apply(0.7, "expert all-to-all across nodes (InfiniBand, not NVLink)")
    if cp > 1:  # each layer all-gathers its keys and values over the cp ranks, and sums their gradients back
        apply(0.95 ** (cp.bit_length() - 1), f"context parallel {cp}: keys and values all-gathered per layer")
    if layout.memory_strategy == "fsdp2_offload":
        apply(0.3, "CPU offload (PCIe transfers, CPU optimizer step)")
    if recompute == "full":
        apply(0.75, "full activation checkpointing")
    return score, tuple(factors)


# ------------------------------------------------------------------ tree pick


