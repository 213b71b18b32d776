"""What a user sees while a run goes: a progress bar with live metrics and
per-step lines with the time split into generation / logprobs / training /
weight sync. Lines go to stderr with the bar so they never tear it."""

from __future__ import annotations

import sys
from typing import Any

TIMERS = ("generation", "rollout_wait", "generator_idle", "logprobs", "training", "weight_sync")
"""The step's timings a log line shows, those the step has (the asynchronous ones: see rollout/async_rollouts.py)."""


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
        self.reward: float | None = None

    def step(self, step: int, metrics: dict[str, Any]) -> None:
        self.reward = metrics["reward_mean"]
        self._postfix(refresh=False)
        self.bar.update(1)
        if step % self.print_every == 0 or step == 1:
            info(step_line(step, metrics))

    def evaluated(self, step: int, accuracy: float, result: str) -> None:
        """An evaluation's accuracy on the bar, and its result in words (`result`: how it sampled
        included, e.g. "held-out accuracy 35.0% (greedy)") in a line."""
        self.accuracy = accuracy
        self._postfix(refresh=True)
        info(f"step {step}: {result}")

    def _postfix(self, *, refresh: bool) -> None:
        postfix = {}
        if self.reward is not None:
            postfix["reward"] = f"{self.reward:.3f}"
        if self.accuracy is not None:
            postfix["acc"] = f"{100 * self.accuracy:.1f}%"
        self.bar.set_postfix(postfix, refresh=refresh)

    def stopped_early(self, why: str) -> None:
        """The run ends before its last step (a time budget, an evaluation metric reached): the bar and
        the log say so."""
        self.bar.set_description_str("GRPO (stopped early)", refresh=True)
        info(why)

    def close(self) -> None:
        self.bar.close()


def step_line(step: int, m: dict[str, Any]) -> str:
    times = " ".join(f"{name}={m[f'time_{name}']:.3f}s" for name in TIMERS if f"time_{name}" in m)
    policy = (f"loss={m['loss']:+.4f} grad_norm={m['grad_norm']:.3f} clip={m['clip_fraction']:.3f} " if "loss" in m
              else "policy not trained (critic warm-up) ")
    if "loss" in m and "approx_entropy" in m:  # a loss of the user's own may not measure it
        policy += f"entropy={m['approx_entropy']:.3f} "
    critic = f"value_loss={m['critic/value_loss']:.4f} " if "critic/value_loss" in m else ""
    return (f"step {step}: reward={m['reward_mean']:.3f} {policy}{critic}"
            f"len={m['completion_length_mean']:.1f} | {times} total={m['time_step']:.3f}s")
