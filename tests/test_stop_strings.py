"""policy.generation.stop_strings: a completion ends with the token that completes the first stop
string in its text, the string kept (NeMo RL's sliding puzzle reads its '</action>')."""

from __future__ import annotations

import pytest
import torch

from novarl.backends.generation.hf import HFGeneration
from novarl.backends.generation.stops import stop_string_end
from novarl.models.loading import load_tokenizer, resolve_model_path
from novarl.types import Prompt, SamplingConfig
from tests.helpers.stops import assert_stopped_like


@pytest.fixture(scope="module")
def engine():
    path = resolve_model_path("tiny-arith")
    tokenizer = load_tokenizer(path)
    return HFGeneration(path, tokenizer, torch.device("cpu"), max_seq_length=64), tokenizer


def test_the_end_is_the_token_that_completes_the_string(engine):
    _, tokenizer = engine
    tokens = tokenizer("12+34=46 and 7", add_special_tokens=False)["input_ids"]
    end = stop_string_end(tokens, ["46"], tokenizer)
    assert "46" in tokenizer.decode(tokens[:end]) and "46" not in tokenizer.decode(tokens[:end - 1])
    assert stop_string_end(tokens, ["99", " and"], tokenizer) == stop_string_end(tokens, [" and"], tokenizer)
    assert stop_string_end(tokens, ["zz"], tokenizer) is None and stop_string_end(tokens, [], tokenizer) is None


def test_the_engine_stops_on_a_string_and_keeps_it(engine):
    hf, tokenizer = engine
    prompts = [Prompt(t, tokenizer(t)["input_ids"]) for t in ("12+34=", "5+7=")]
    free = hf.generate(prompts, SamplingConfig(max_new_tokens=6, temperature=0.0))
    assert all(len(c.token_ids) >= 2 for c in free)
    stop = tokenizer.decode(free[0].token_ids[:2], skip_special_tokens=True)[-1]  # the 2nd token's last character
    stopped = hf.generate(prompts, SamplingConfig(max_new_tokens=6, temperature=0.0, stop_strings=(stop,)))
    assert_stopped_like(free, stopped, stop, tokenizer)
    assert len(stopped[0].token_ids) <= 2  # its stop string is in its first two tokens
