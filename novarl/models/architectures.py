"""Facts about Hugging Face architectures that several layers read (torch-free, so that the
planner and `validate` stay light)."""

PLAIN_CAUSAL = ("llama", "qwen2", "qwen3", "mistral")
"""Architectures whose attention is plain causal softmax attention (when no sliding window is
active) and whose logits are the output head's as is: what novarl's varlen and context-parallel
attention and its logprob head compute exactly (models/attention.py, models/logprob_head.py)."""
