"""A character-level tokenizer saved as a standard Hugging Face `tokenizer.json`.

Ids: ``<pad>``=0, ``<s>``=1, ``</s>``=2, ``<unk>``=3, then one token per
character of the alphabet in order. Every encoded text starts with ``<s>``
(a template post-processor); decoding concatenates characters with nothing in
between. The result loads back with ``AutoTokenizer.from_pretrained(folder)``,
without custom code.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, processors
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
DEFAULT_ALPHABET = "0123456789+-*= "


def build_char_tokenizer(alphabet: str = DEFAULT_ALPHABET) -> PreTrainedTokenizerFast:
    """A fast tokenizer with one token per character of `alphabet` (no duplicates allowed)."""
    if len(set(alphabet)) != len(alphabet):
        raise ValueError(f"The alphabet {alphabet!r} repeats a character.")
    if not alphabet:
        raise ValueError("The alphabet is empty.")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: len(SPECIAL_TOKENS) + i for i, ch in enumerate(alphabet)})
    # BPE with no merges and no pre-tokenizer: the text is split into single
    # characters, each looked up in the vocabulary (unknown ones -> <unk>).
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)])
    tokenizer.decoder = decoders.Fuse()  # join tokens with no separator
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        clean_up_tokenization_spaces=False,
        model_input_names=["input_ids", "attention_mask"],  # no token_type_ids (transformers 4)
    )
