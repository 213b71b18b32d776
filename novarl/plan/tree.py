"""The seeds' decision tree in the advisor (plan/advisor.py): the size branch a model falls in
(< 10B, 10B-70B on one node or several, > 70B), the backends each branch names and the placement
rule, the tree's choice as one of the advisor's candidate layouts, and the explanation `novarl plan`
prints: the tree's pick, what the memory model says of it, and what is recommended instead."""

from __future__ import annotations

from typing import TYPE_CHECKING

from novarl.backends.contract.model_shape import ModelShape
from novarl.backends.contract.resolve import BUILT_TRAINING_BACKENDS
from novarl.backends.registry import generation_spec, training_spec

if TYPE_CHECKING:
    from novarl.plan.advisor import Candidate, Placement
    from novarl.plan.advisor import _Context as Context

SMALL_MODEL = 10e9


LARGE_MODEL = 71e9
"""The seeds' branches are size classes: a "70B" model is in the 10B-70B branch although Llama 3 70B
has 70.6B parameters (the assumed shape for `--model 70B` has 69.7B: both give the same layout);
the seeds' own >70B example is Qwen2.5-72B (72.7B)."""


def tree_branch(shape: ModelShape, *, num_nodes: int) -> str:
    """The branch of the seeds' decision tree that `shape` falls in."""
    if shape.parameters < SMALL_MODEL:
        return "<10B"
    if shape.parameters <= LARGE_MODEL:
        return "10B-70B single node" if num_nodes == 1 else "10B-70B multi-node"
    return ">70B"


TREE_TEXT = {
    "<10B": "DTensor + vLLM",
    "10B-70B single node": "DTensor + vLLM (TP=8)",
    "10B-70B multi-node": "Megatron + vLLM",
    ">70B": "Megatron + Megatron generation",
}


def placement_for(shape: ModelShape, *, num_nodes: int, generation_backend: str) -> Placement:
    """Colocated for < 10B, one node, or Megatron generation; dedicated otherwise."""
    if generation_spec(generation_backend).on_training_weights or shape.parameters < SMALL_MODEL or num_nodes == 1:
        return "colocated"
    return "dedicated"


def tree_pick(context: Context, candidates: list[Candidate]) -> Candidate:
    """The tree's choice as a concrete layout: plain FSDP2 for DTensor; for a dense model on
    Megatron the largest TP and the shallowest pipeline that fits (or the deepest tried); for
    a Mixture-of-Experts model on Megatron, the layout of tensor, pipeline and expert
    parallelism that fits with the best score (the recipes NeMo RL and ROLL ship spread the
    experts with expert parallelism and keep TP small), or the one of least memory."""
    if context.branch in ("<10B", "10B-70B single node"):
        return next(c for c in candidates if c.strategy == "dtensor fsdp2")
    if context.shape.num_experts > 1:
        megatron = [c for c in candidates if training_spec(c.training_backend).pipeline]
        fitting = [c for c in megatron if c.fits]
        if fitting:
            return max(fitting, key=lambda c: (c.score, -c.peak_gb))
        return min(megatron, key=lambda c: c.peak_gb)
    megatron = [c for c in candidates if training_spec(c.training_backend).pipeline
                and c.tensor_parallel_size == context.tps[-1]]
    return next((c for c in megatron if c.fits), megatron[-1])


def explain(context: Context, pick: Candidate, recommended: Candidate | None,
             fitting: list[Candidate]) -> list[str]:
    shape, budget = context.shape, context.budget_gb
    count = f"{shape.parameters / 1e9:.1f}B" if shape.parameters >= 1e8 else f"{shape.parameters / 1e6:.2f}M"
    lines = [f"{count} parameters on {context.num_nodes} node(s) x {context.gpus_per_node} "
             f"GPU(s): the seeds' decision tree ({context.branch}) picks {TREE_TEXT[context.branch]}, "
             f"here {pick.describe()}."]
    budget_text = f"the {budget:.1f} GB budget ({budget / context.gpu_memory_gb:.0%} of {context.gpu_memory_gb:g} GB)"
    if pick.fits:
        lines.append(f"The memory model confirms it: {pick.peak_gb:.1f} GB peak per GPU, within {budget_text}.")
    else:
        lines.append(f"The memory model overrides it: it needs {pick.peak_gb:.1f} GB per GPU"
                     + (" even with full activation checkpointing" if pick.activation_checkpointing else "")
                     + f" "
                     f"(model states {pick.memory_gb['model_states']:.1f}, activations "
                     f"{pick.memory_gb['activations']:.1f}), more than {budget_text}"
                     + ("" if not any("does not hold" in note for note in pick.notes)
                        else ", or its generator does not fit")
                     + ".")
        if recommended is not None:
            same = (recommended.training_backend == pick.training_backend
                    and recommended.generation_backend == pick.generation_backend)
            lines.append(f"Recommended instead: {recommended.describe()}, the fastest layout that fits "
                         f"({recommended.peak_gb:.1f} GB peak, score {recommended.score:.2f}); "
                         + ("it keeps the tree's backends." if same else "it leaves the tree's backends."))
    if recommended is None:
        lines.append(f"Nothing fits: no listed layout stays within {budget_text} with a generator that holds "
                     "the weights. Use more or larger GPUs, a shorter sequence, or a smaller model.")
        return lines
    if recommended.activation_checkpointing:
        lines.append("It fits only with full activation checkpointing (about 25% slower).")
    if not recommended.built:
        built = next((c for c in fitting if c.built), None)
        missing = (f"the {recommended.training_backend} training backend"
                   if recommended.training_backend not in BUILT_TRAINING_BACKENDS
                   else f"the {recommended.generation_backend} generation backend")
        lines.append(f"novarl does not have {missing} yet"
                     + (f"; the fastest built layout that fits is {built.describe()} ({built.peak_gb:.1f} GB)."
                        if built else "; no built layout fits."))
    on_weights = generation_spec(recommended.generation_backend).on_training_weights
    lines.append(f"Placement {recommended.placement}: "
                 + (f"{recommended.generation_backend.capitalize()} generation runs on the training weights."
                    if on_weights else "the rule is colocated below 10B parameters or on one node, dedicated otherwise."))
    if recommended.placement == "colocated" and not on_weights:
        memory = recommended.memory_gb  # weights and optimizer states (gradients are freed), the critic's alike
        own = memory["params"] + memory["optimizer"]
        parked = own * (2 if memory["critic_states"] else 1) + memory["reference_weights"]
        lines.append(f"While the engines generate, the training states wait in page-locked host memory: "
                     f"{parked:.1f} GB a GPU, {parked * context.gpus_per_node:.0f} GB a node.")
    return lines
