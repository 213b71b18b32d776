"""Plots people would rather see than read: the reward curve of a run."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_reward_curve(records: list[dict[str, Any]], path: Path, *, title: str = "GRPO") -> Path:
    """Training reward per step (and its moving average) with held-out accuracy on a second axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    if train:
        steps = [r["step"] for r in train]
        rewards = [r["reward_mean"] for r in train]
        window = max(1, len(rewards) // 25)
        smooth = [sum(rewards[max(0, i - window + 1):i + 1]) / len(rewards[max(0, i - window + 1):i + 1])
                  for i in range(len(rewards))]
        ax.plot(steps, rewards, color="tab:blue", alpha=0.3, lw=0.8, label="train reward (per step)")
        ax.plot(steps, smooth, color="tab:blue", lw=2, label=f"train reward ({window}-step mean)")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("mean reward")
    ax.grid(alpha=0.3)
    if evals:
        ax2 = ax.twinx()
        ax2.plot([r["step"] for r in evals], [100 * r["accuracy"] for r in evals], "o-",
                 color="tab:red", label="held-out greedy accuracy")
        ax2.set_ylabel("held-out greedy accuracy (%)")
        ax2.set_ylim(0, 100)
        ax2.legend(loc="lower right")
    ax.legend(loc="upper left")
    ax.set_title(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
