"""PPO's value model from a Hugging Face causal LM: the same body, a scalar head."""

from __future__ import annotations

import copy

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


def save_critic_hf(path, model_config, state: dict[str, torch.Tensor], tokenizer, fmt=None) -> None:
    """A critic's full state as a Hugging Face token-classification folder with one label (what
    TRL and verl load value models as): `AutoModelForTokenClassification.from_pretrained(path)`
    gives, at each position, the value of the state after that token (novarl reads it as the
    next token's value). The head (lm_head here) is the class's `score`."""
    from novarl.models.loading import save_hf_folder

    config = copy.deepcopy(model_config)
    config.architectures = [a.replace("ForCausalLM", "ForTokenClassification") for a in config.architectures or []]
    config.num_labels, config.tie_word_embeddings = 1, False
    renamed = {("score." + k.removeprefix("lm_head.")) if k.startswith("lm_head.") else k: v for k, v in state.items()}
    save_hf_folder(path, config, renamed, tokenizer, fmt, auto_class="AutoModelForTokenClassification")
