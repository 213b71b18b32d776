"""What a user sees while a run goes: a progress bar with live metrics and
per-step lines with the time split into generation / logprobs / training /
weight sync. Lines go to stderr with the bar so they never tear it."""

from __future__ import annotations

import sys
from typing import Any

TIMERS = ("generation", "logprobs", "training", "weight_sync")


def info(message: str) -> None:
    from tqdm import tqdm

    tqdm.write(f"[novarl] {message}", file=sys.stderr)


class Progress:
    def __init__(self, total_steps: int, *, enabled: bool, print_every: int, initial: int = 0) -> None:
        from tqdm import tqdm

        self.print_every = print_every
        self.bar = tqdm(total=total_steps, initial=initial, desc="GRPO", unit="step", disable=not enabled,
                        file=sys.stderr, dynamic_ncols=True)
        self.accuracy: float | None = None

    def step(self, step: int, metrics: dict[str, Any]) -> None:
        postfix = {"reward": f"{metrics['reward_mean']:.3f}"}
        if self.accuracy is not None:
            postfix["held-out acc"] = f"{100 * self.accuracy:.1f}%"
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(1)
        if step % self.print_every == 0 or step == 1:
            info(step_line(step, metrics))

    def evaluated(self, step: int, accuracy: float) -> None:
        self.accuracy = accuracy
        info(f"step {step}: held-out greedy accuracy {100 * accuracy:.1f}%")

    def close(self) -> None:
        self.bar.close()


def step_line(step: int, m: dict[str, Any]) -> str:
    times = " ".join(f"{name}={m[f'time_{name}']:.3f}s" for name in TIMERS)
    return (f"step {step}: reward={m['reward_mean']:.3f} loss={m['loss']:+.4f} "
            f"grad_norm={m['grad_norm']:.3f} clip={m['clip_fraction']:.3f} "
            f"len={m['completion_length_mean']:.1f} | {times} total={m['time_step']:.3f}s")
