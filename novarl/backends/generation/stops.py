"""Stop strings, the same for every engine: a completion ends with the token whose decoding first
completes one of them. Engines generate as they do for stop tokens and cut after (vLLM's own stop
strings work on text it is told not to make here, `detokenize=False`)."""

from __future__ import annotations

from collections.abc import Sequence


def stop_string_end(tokens: Sequence[int], stop_strings: Sequence[str], tokenizer) -> int | None:
    """The number of tokens up to and including the one that completes the first stop string in
    their decoded text (special tokens skipped), or None when none occurs. A binary search over
    prefixes: a prefix's text holds a stop string from that token on."""
    if not stop_strings or not tokens:
        return None

    def stopped(count: int) -> bool:
        text = tokenizer.decode(list(tokens[:count]), skip_special_tokens=True)
        return any(stop in text for stop in stop_strings)

    if not stopped(len(tokens)):
        return None
    low, high = 1, len(tokens)  # stopped(high) holds; find the smallest such count
    while low < high:
        middle = (low + high) // 2
        if stopped(middle):
            high = middle
        else:
            low = middle + 1
    return low


class StopOnStrings:
    """A transformers stopping criterion: a row is done once the text of its last tokens holds a stop
    string (a window of tokens wide enough for the longest one, so each step decodes a few tokens per
    row, whatever the length). transformers' own StopStringCriteria needs a tokenizer whose every
    token it can render alone, which small custom vocabularies are not."""

    def __init__(self, stop_strings: Sequence[str], tokenizer, prompt_width: int) -> None:
        self.stop_strings, self.tokenizer, self.prompt_width = tuple(stop_strings), tokenizer, prompt_width
        self.window = 2 * max(len(stop) for stop in self.stop_strings) + 4

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        new = input_ids[:, self.prompt_width:]
        done = [any(stop in self.tokenizer.decode(row[-self.window:].tolist(), skip_special_tokens=True)
                    for stop in self.stop_strings) for row in new]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)
