"""Metric sinks: one JSON object per line, appended and flushed every step; the same records
go to the experiment trackers the config enables (novarl/logging/trackers.py)."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any


class JsonlSink:
    def __init__(self, path: Path, trackers: list | None = None) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._handle = path.open("a", encoding="utf-8")
        self._written: Counter[str] = Counter()
        self.trackers = list(trackers or [])

    def write(self, record: dict[str, Any]) -> None:
        self._append([record])
        self._written[str(record.get("kind"))] += 1

    def write_history(self, records: list[dict[str, Any]]) -> None:
        """Records of the run this one resumes, written as they were (not counted by `count`)."""
        self._append(records)

    def log_image(self, path: Path, name: str) -> None:
        for tracker in self.trackers:
            tracker.log_image(path, name)

    def count(self, kind: str) -> int:
        """How many records of `kind` this run wrote with `write`."""
        return self._written[kind]

    def _append(self, records: list[dict[str, Any]]) -> None:
        from novarl.logging.trackers import record_metrics

        for record in records:
            clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
            self._handle.write(json.dumps(clean) + "\n")
            taken = record_metrics(record) if self.trackers else None
            for tracker in self.trackers if taken else ():
                tracker.log_metrics(*taken)
        self._handle.flush()

    def close(self) -> None:
        """Close the file and the trackers (again: nothing)."""
        self._handle.close()
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            tracker.close()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]
