"""Small models made from the bundled one, for layouts the bundled one cannot split."""

from __future__ import annotations

from pathlib import Path


def two_kv_head_copy(folder: Path) -> Path:
    """tiny-arith with its one key/value head duplicated into two, saved in `folder`: the same
    function (each query head reads an identical copy), but tensor parallelism can split it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from novarl.models.loading import resolve_model_path

    source = resolve_model_path("tiny-arith")
    model = AutoModelForCausalLM.from_pretrained(source)
    config = model.config
    config.num_key_value_heads = 2
    widened = AutoModelForCausalLM.from_config(config)
    state = model.state_dict()
    for key in list(state):
        if key.endswith(("k_proj.weight", "v_proj.weight")):
            state[key] = torch.cat([state[key], state[key]])
    widened.load_state_dict(state)
    widened.save_pretrained(folder)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    return folder
