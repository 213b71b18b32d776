"""Facts about Hugging Face architectures that several layers read (torch-free, so that the
planner and `validate` stay light)."""

PLAIN_CAUSAL = ("llama", "qwen2", "qwen3", "mistral")
"""Architectures whose attention is plain causal softmax attention (when no sliding window is
active) and whose logits are the output head's as is: what novarl's varlen and context-parallel
attention and its logprob head compute exactly (models/attention.py, models/logprob_head.py)."""

PLAIN_HEAD = (*PLAIN_CAUSAL, "mixtral", "qwen2_moe", "qwen3_moe", "olmo2", "phi3", "gemma")
"""Architectures whose logits are the output head's as is (no final scaling, as Granite's): what novarl's
picking head computes exactly (models/logprob_head.py); Gemma 2's and 3's where their config sets no final
soft-capping (plain_head)."""

SOFT_CAPPED_HEAD = {"gemma2": 30.0, "gemma3": None, "gemma3_text": None}
"""Architectures that soft-cap the head's logits by `final_logit_softcapping` where it is set, and its
default in transformers' config classes (a config.json may leave it out)."""


def plain_head(model_type: str, final_logit_softcapping: float | None) -> bool:
    """Whether a model's logits are its output head's as is (PLAIN_HEAD, or a SOFT_CAPPED_HEAD without a cap)."""
    return model_type in PLAIN_HEAD or (model_type in SOFT_CAPPED_HEAD and final_logit_softcapping is None)

HEAD_CHUNK_BYTES = 1 << 30
"""The float32 logits novarl's picking output heads compute at once (models/logprob_head.py): 1 GiB (1,766
rows of a 151,936-entry vocabulary)."""

HEAD_SAVE_LOGITS_BYTES = 4 << 30
"""A picking head's call keeps its logits (in the weight's dtype) for the backward where they take at most
this (4 GiB: a micro-batch of 8,192 tokens of a 151,936-entry vocabulary in bf16 takes 2.5 GB); larger calls
recompute each chunk's there (models/logprob_head.py)."""
