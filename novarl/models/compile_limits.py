"""How many graphs torch.compile may keep for one compiled function: novarl's compiled layers need more than
dynamo's default before it gives up on them.

One decoder layer's compiled forward is one function for every layer of the policy, the KL reference and a
critic (the same code), and its graphs multiply over what its guards tell apart: grad mode (the training pass
against the logprob and reference passes), the parameters' requires_grad (a frozen reference's), the attention's
path (padded rows, packed rows through the varlen kernel, shared prompts, alike pieces side by side: different
keyword arguments) and the shapes (static first, dynamic once they change). A GRPO step with a KL reference on
packed rows made more than 8 graphs of the layer on tiny-arith (bf16, CPU), dynamo's default recompile limit:
past it dynamo runs the layer eagerly for the rest of the process, saying so once in torch's own log (a
warning on the rank's stderr, nothing in the step's metrics). Each graph compiles once, so a higher limit costs compile time at the first steps only."""

from __future__ import annotations

RECOMPILE_LIMIT = 64
"""Graphs a compiled function may have (dynamo's default: 8)."""


def allow_recompiles() -> None:
    """Raise dynamo's per-function recompile limit to RECOMPILE_LIMIT (never lower it): called where novarl
    compiles its layers and head."""
    import torch._dynamo

    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # (before torch 2.7)
    setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))
