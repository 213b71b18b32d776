"""An engine's requests from several callers, on the engine's process (the Ray actor side of
backends/generation/streams.py RemoteContinuous)."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Any


def takes_requests(engine: Any) -> bool:
    """Whether the engine takes requests while it generates (backends/protocols.py ContinuousEngine,
    which this layer, below the backends, does not import)."""
    return all(callable(getattr(engine, name, None)) for name in ("add", "step", "unfinished"))


class EngineStreams:
    """An engine's requests from several callers (streams), on the engine's process: their keys
    made unique per stream, and the turns finished for other streams kept for their next call."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.held: defaultdict[str, list[tuple[int, Any]]] = defaultdict(list)
        self.open: Counter[str] = Counter()

    def run(self, stream: str, requests: Sequence[tuple[int, Any, Any]], max_steps: int) -> list[tuple[int, Any]]:
        """Add the stream's requests, then step the engine until one of the stream's turns is
        finished (or max_steps steps): the stream's finished turns, under its keys."""
        for key, prompt, sampling in requests:
            self.engine.add((stream, key), prompt, sampling)
            self.open[stream] += 1
        for _ in range(max_steps):
            if self.held[stream] or not self.open[stream]:
                break
            for (owner, key), completion in self.engine.step():  # the keys `add` was given
                self.held[owner].append((key, completion))
                self.open[owner] -= 1
        return self.held.pop(stream, [])
