"""PPO's value model from a Hugging Face causal LM: the same body, a scalar head."""

from __future__ import annotations

import torch


def add_value_head(model: torch.nn.Module) -> None:
    """Replace the model's output head, in place, by a linear map from its hidden size to one
    value, weights and bias zero (every value starts at 0, so the first advantages are the
    rewards themselves), untied from the input embeddings. The model's "logits" are then
    [..., 1] values."""
    old = model.get_output_embeddings()
    head = torch.nn.Linear(model.config.hidden_size, 1, bias=True, device=old.weight.device, dtype=old.weight.dtype)
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    model.config.tie_word_embeddings = False
    model.set_output_embeddings(head)
