"""A tiny Qwen2 model folder built from a config, with a byte tokenizer that has Qwen's
ChatML special tokens and chat template: what a user's own Hugging Face folder looks like,
at test size (random weights; nothing downloaded)."""

from __future__ import annotations

from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""Qwen2's ChatML layout (its system-prompt default left out)."""

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_tiny_chatml_qwen2(folder: Path, *, hidden_size: int = 64, num_attention_heads: int = 4,
                            num_key_value_heads: int = 2, max_position_embeddings: int = 256) -> Path:
    """Write the folder (config.json, safetensors weights, tokenizer files) and return it.

    The defaults give head_dim 16, which vLLM's CPU attention refuses: hidden_size=128 with
    num_attention_heads=2 gives 64, which it runs."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

    # Qwen's byte-level BPE with no merges: one token a byte (transformers rebuilds Qwen2's
    # pre-tokenizer from the vocabulary and merges, so the vocabulary is the byte-level alphabet)
    vocab = {token: i for i, token in enumerate(SPECIAL + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        additional_special_tokens=SPECIAL[1:])
    tokenizer.chat_template = CHATML_TEMPLATE
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(
        vocab_size=len(vocab), hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=2,
        num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=True,
        eos_token_id=vocab["<|im_end|>"], pad_token_id=vocab["<|endoftext|>"], bos_token_id=None))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
