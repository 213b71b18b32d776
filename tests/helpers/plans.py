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
