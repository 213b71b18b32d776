"""Environments for the tests, named by import path as a user's are (env.<name>.actor_class_fqn)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from novarl.rollout.environment import EnvStep


class AskAgain:
    """Answers each of the model's turns with " again:" until `turns` turns (cfg), then ends; the
    reward of the last turn is 1 when the answer holds the example's answer, 0.1 a turn before."""

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        self.turns = int(cfg.get("turns", 2))

    def step(self, conversation, metadata: Mapping[str, Any]) -> EnvStep:
        turns = sum(m["role"] == "assistant" for m in conversation)
        if turns < self.turns:
            return EnvStep(reward=0.1, done=False, observation={"role": "user", "content": " again:"})
        return EnvStep(reward=float(str(metadata.get("answer", "")) in conversation[-1]["content"]), done=True)


class NoStep:
    def __init__(self, cfg) -> None:
        pass


class Refuses:
    def __init__(self, cfg) -> None:
        raise ValueError("no board size given")


class Breaks:
    """Raises on the second turn."""

    def __init__(self, cfg) -> None:
        pass

    def step(self, conversation, metadata) -> EnvStep:
        if sum(m["role"] == "assistant" for m in conversation) > 1:
            raise KeyError("board")
        return EnvStep(reward=0.0, done=False, observation={"role": "user", "content": " again:"})


class BreaksOnOdd:
    """Raises when the example's answer is odd: about half the episodes fail."""

    def __init__(self, cfg) -> None:
        pass

    def step(self, conversation, metadata) -> EnvStep:
        if int(metadata["answer"]) % 2:
            raise ValueError("odd")
        return EnvStep(reward=float(metadata["answer"] in conversation[-1]["content"]), done=True)


class UnevenTurns:
    """Episodes of uneven length: an example's episode asks " again:" until its turn count (the row's
    "turns", else 1 + its answer modulo cfg max_turns), each step taking cfg delay_s seconds (a
    tool's latency); every turn rewards 0.25, the last one 1 more when the answer is in it."""

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        self.max_turns, self.delay_s = int(cfg.get("max_turns", 3)), float(cfg.get("delay_s", 0.0))

    def step(self, conversation, metadata: Mapping[str, Any]) -> EnvStep:
        import time

        time.sleep(self.delay_s)
        turns = sum(m["role"] == "assistant" for m in conversation)
        wanted = int(metadata.get("turns") or 1 + int(metadata.get("answer") or 0) % self.max_turns)
        if turns < wanted:
            return EnvStep(reward=0.25, done=False, observation={"role": "user", "content": " again:"})
        return EnvStep(reward=0.25 + float(str(metadata.get("answer", "")) in conversation[-1]["content"]), done=True)
