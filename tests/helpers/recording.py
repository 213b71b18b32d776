"""A generation backend that keeps what its engine was given and sampled, for tests that check the
tokens a run trains on against them."""

from __future__ import annotations

from novarl.backends.generation.engines import LocalGeneration


class Recording(LocalGeneration):
    """The engine's completions of every submission: turns[i] is the i-th submission's (prompt token
    ids, completion) pairs."""

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.turns: list[list] = []

    def submit(self, prompts, sampling):
        ready = super().submit(prompts, sampling)
        self.turns.append([(list(p.token_ids), c) for p, c in zip(prompts, ready.result())])
        return ready
