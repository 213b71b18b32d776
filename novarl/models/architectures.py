"""Facts about Hugging Face architectures that several layers read (torch-free, so that the
planner and `validate` stay light)."""

PLAIN_CAUSAL = ("llama", "qwen2", "qwen3", "mistral")
"""Architectures whose attention is plain causal softmax attention (when no sliding window is
active) and whose logits are the output head's as is: what novarl's varlen and context-parallel
attention and its logprob head compute exactly (models/attention.py, models/logprob_head.py)."""

PLAIN_HEAD = (*PLAIN_CAUSAL, "mixtral", "qwen2_moe", "qwen3_moe", "olmo2", "phi3", "gemma")
"""Architectures whose logits are the output head's as is (no final soft-capping or scaling, as Gemma 2 and 3
and Granite have): what novarl's picking head computes exactly (models/logprob_head.py)."""

HEAD_CHUNK_BYTES = 1 << 30
"""The float32 logits novarl's picking output heads compute at once (models/logprob_head.py): 1 GiB (1,766
rows of a 151,936-entry vocabulary)."""

HEAD_SAVE_LOGITS_BYTES = 4 << 30
"""A picking head's call keeps its logits (in the weight's dtype) for the backward where they take at most
this (4 GiB: a micro-batch of 8,192 tokens of a 151,936-entry vocabulary in bf16 takes 2.5 GB); larger calls
recompute each chunk's there (models/logprob_head.py)."""
