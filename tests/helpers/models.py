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


def tiny_moe(model_type: str, **overrides):
    """A random 2-layer Mixture-of-Experts model of the bundled vocabulary: 4 experts, top 2, GQA;
    `model_type` mixtral, qwen2_moe (qkv biases, a gated shared expert; softmax over every expert,
    top 2 kept) or qwen3_moe (query/key norms; top-2 weights renormalised)."""
    import torch
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    shape = dict(vocab_size=19, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, num_experts_per_tok=2, max_position_embeddings=64, tie_word_embeddings=False,
                 bos_token_id=1, eos_token_id=2, pad_token_id=0)
    configs = {"mixtral": lambda: MixtralConfig(intermediate_size=96, num_local_experts=4, **shape),
               "qwen2_moe": lambda: Qwen2MoeConfig(intermediate_size=96, moe_intermediate_size=48, num_experts=4,
                                                   shared_expert_intermediate_size=80, norm_topk_prob=False, **shape),
               "qwen3_moe": lambda: Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=48, num_experts=4,
                                                   norm_topk_prob=True, **shape)}
    config = configs[model_type]()
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # routers far from ties, so that rounding never changes an expert's choice
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.mul_(20)
    return model


def tiny_qwen3(folder: Path) -> Path:
    """A random 2-layer Qwen3 (query/key norms of head_dim, 4 heads, 2 key/value heads: tensor parallelism
    splits it) of the bundled vocabulary, its norms' weights away from 1, saved in `folder`."""
    from transformers import Qwen3Config

    return _with_uneven_norms(folder, Qwen3Config)


def tiny_gemma2(folder: Path) -> Path:
    """The same shape as a Gemma 2 (four norms a layer: before and after the attention and the MLP)."""
    from transformers import Gemma2Config

    return _with_uneven_norms(folder, Gemma2Config)


def _with_uneven_norms(folder: Path, config_class) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from novarl.models.loading import resolve_model_path

    torch.manual_seed(0)
    config = config_class(vocab_size=19, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                          tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.3)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(resolve_model_path("tiny-arith")).save_pretrained(folder)
    return folder
