"""Custom tensor-parallel plans for tests: a dict plan (with a pattern) and a function."""

from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

CALLS: list[str] = []

MLP_ONLY = {
    "mlp.*_proj": ColwiseParallel(),  # gate_proj and up_proj (down_proj replaced below)
    "mlp.down_proj": RowwiseParallel(),
}


def attention_only(model, tp_mesh):
    for layer in model.model.layers:
        parallelize_module(layer, tp_mesh, {"self_attn.q_proj": ColwiseParallel(),
                                            "self_attn.k_proj": ColwiseParallel(),
                                            "self_attn.v_proj": ColwiseParallel(),
                                            "self_attn.o_proj": RowwiseParallel()})


def torch_styles_sp(model, tp_mesh):
    """novarl's default tensor + sequence parallel split before backends/training/local_tp.py, on torch's DTensor
    styles (the norms' weights tp-Replicate DTensors): what wrote the checkpoints of that layout."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel

    from novarl.backends.training.parallelize import LLAMA_LAYER_PLAN_SP, apply_plan, decoder_layers
    from novarl.models.vocab_parallel import split_vocabulary

    apply_plan(model, tp_mesh, LLAMA_LAYER_PLAN_SP)
    parallelize_module(decoder_layers(model)[0], tp_mesh, PrepareModuleInput(
        input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True))
    parallelize_module(model.model.norm, tp_mesh, SequenceParallel())
    parallelize_module(model.get_output_embeddings(), tp_mesh, PrepareModuleInput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True))
    split_vocabulary(model, tp_mesh)


def _sequence_parallel_plain_norms():
    """LLAMA_LAYER_PLAN_SP with the norms left plain modules (no SequenceParallel style): they run on each rank's
    share of the sequence with their weights whole, so each rank's gradient is its tokens' share."""
    from novarl.backends.training.parallelize import LLAMA_LAYER_PLAN_SP

    return {key: style for key, style in LLAMA_LAYER_PLAN_SP.items() if not key.endswith("layernorm")}


SP_PLAIN_NORMS = _sequence_parallel_plain_norms()
