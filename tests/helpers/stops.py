"""What every engine's stop strings must do (tests/test_stop_strings.py, tests/test_vllm.py)."""

from __future__ import annotations

import pytest

from novarl.backends.generation.stops import stop_string_end


def assert_stopped_like(free, stopped, stop: str, tokenizer) -> None:
    """`stopped` (generated with the stop string) is `free` (without it) cut after the token that
    completes the string, the string kept; unchanged where it never came."""
    for before, after in zip(free, stopped, strict=True):
        end = stop_string_end(before.token_ids, [stop], tokenizer)
        if end is None:
            assert after.token_ids == before.token_ids and after.finish_reason == before.finish_reason
        else:
            assert after.token_ids == before.token_ids[:end] and after.logprobs == pytest.approx(before.logprobs[:end])
            assert after.finish_reason == "stop" and stop in after.text
