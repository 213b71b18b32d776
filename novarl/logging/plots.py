"""Plots people would rather see than read: the reward curve of a run.

`curve_series` turns the records of a run's metrics.jsonl into the series to draw
(pure, tested alone); `draw_reward_curve` draws them; `plot_reward_curve` writes the PNG.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

REWARD_LABEL = "sampled reward (mean over the step's samples)"
ACCURACY_LABEL = "held-out greedy accuracy"
"""The accuracy curve's label when every evaluation was greedy (see `accuracy_label`)."""
MAIN_YLABEL = "reward / accuracy (0-1)"


@dataclass(frozen=True)
class Series:
    """One metric over steps, sorted by step, with missing and non-finite values left out."""

    steps: list[float] = field(default_factory=list)
    values: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class CurveSeries:
    """What the reward-curve figure draws, from one run's records (a resumed run's included)."""

    reward: Series
    """reward_mean of each train step: the mean reward over that step's sampled completions."""
    reward_average: Series
    """Trailing moving average of `reward` over `average_window` logged steps."""
    average_window: int
    """Logged steps per moving average (about 1/25 of the run, at least 1)."""
    accuracy: Series
    """Held-out accuracy in [0, 1] of each eval record: the share of its samples that were correct."""
    accuracy_label: str
    """What `accuracy` is: greedy, or sampled (see `accuracy_label`)."""
    loss: Series
    kl_to_reference: Series
    """Empty when the run logged no KL to a reference, or only zeros (no KL penalty)."""
    completion_length: Series
    """completion_length_mean of each train step, in tokens."""
    entropy: Series
    """approx_entropy of each train step (the policy's entropy per token, in nats, estimated from the
    sampled tokens); empty when the run's loss did not log it."""
    resumed_at: list[float]
    """Steps of the `{"kind": "resume", "step": N}` records, sorted, each once."""


def curve_series(records: list[dict[str, Any]]) -> CurveSeries:
    """The series to draw. When a step is logged twice for a kind (a run resumed from a
    checkpoint older than its last logged step), the later record wins. Records of other
    kinds, without a numeric step, and values that are None or non-finite are skipped."""
    latest: dict[str, dict[float, dict[str, Any]]] = {"train": {}, "eval": {}, "resume": {}}
    for record in records:
        kind, step = record.get("kind"), record.get("step")
        if kind in latest and _finite(step):
            latest[kind][step] = record
    train = [latest["train"][s] for s in sorted(latest["train"])]
    evals = [latest["eval"][s] for s in sorted(latest["eval"])]
    reward = _series(train, "reward_mean")
    window = max(1, len(reward.values) // 25)
    kl = _series(train, "kl_to_reference")
    return CurveSeries(
        reward=reward,
        reward_average=Series(reward.steps, _trailing_mean(reward.values, window)),
        average_window=window,
        accuracy=_series(evals, "accuracy"),
        accuracy_label=accuracy_label(evals),
        loss=_series(train, "loss"),
        kl_to_reference=kl if any(v != 0 for v in kl.values) else Series(),
        completion_length=_series(train, "completion_length_mean"),
        entropy=_series(train, "approx_entropy"),
        resumed_at=sorted(latest["resume"]),
    )


def accuracy_label(evals: list[dict[str, Any]]) -> str:
    """ACCURACY_LABEL when the eval records are greedy ones; else how they sampled, e.g. "held-out
    accuracy (4 samples a prompt)" (a sampled evaluation's record has num_prompts beside num_samples)."""
    sampled = sorted({round(r["num_samples"] / r["num_prompts"]) for r in evals
                      if _finite(r.get("num_prompts")) and r["num_prompts"] > 0 and _finite(r.get("num_samples"))})
    if not sampled:
        return ACCURACY_LABEL
    greedy = ["greedy"] if any(not _finite(r.get("num_prompts")) for r in evals) else []  # a resume changed it
    return f"held-out accuracy ({' or '.join(greedy + [f'{k} samples a prompt' for k in sampled])})"


def main_axis_limits(curves: CurveSeries) -> tuple[float, float]:
    """y-limits of the reward/accuracy panel: 0..1 (with a small margin so points at 0 and 1
    stay visible), widened to cover rewards outside [0, 1] rather than clipping them."""
    low, high = _data_range(curves)
    margin = 0.03 * (high - low)
    return low - margin, high + margin


def main_axis_label(curves: CurveSeries) -> str:
    """y-label of the reward/accuracy panel; says so when the axis was widened past 0-1."""
    low, high = _data_range(curves)
    if low >= 0 and high <= 1:
        return MAIN_YLABEL
    return f"reward / accuracy\n(axis widened from 0-1 to cover\nrewards from {low:.3g} to {high:.3g})"


def _data_range(curves: CurveSeries) -> tuple[float, float]:
    values = curves.reward.values + curves.accuracy.values
    return min(values + [0.0]), max(values + [1.0])


def plot_reward_curve(records: list[dict[str, Any]], path: Path, *, title: str = "GRPO") -> Path:
    """Write the run's reward curve as a PNG at `path`; returns `path`. Any record list,
    empty included, gives a valid image."""
    figure = draw_reward_curve(curve_series(records), title=title)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    return path


def draw_reward_curve(curves: CurveSeries, *, title: str = "GRPO") -> Figure:
    """Panels over a shared step axis: reward and accuracy on one 0-1 axis, then the loss,
    the KL to the reference (only when the run had a KL penalty), the policy's entropy (where
    logged: its collapse is what a GRPO run is watched for) and the response length.
    Drawn on its own Agg canvas, without pyplot, so the caller's backend (a notebook's) is left alone."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    has_kl = bool(curves.kl_to_reference.steps)
    panels = [(curves.loss, "loss", "tab:purple")]
    if has_kl:
        panels.append((curves.kl_to_reference, "KL to reference", "tab:brown"))
    if curves.entropy.steps:
        panels.append((curves.entropy, "entropy\n(nats/token)", "tab:orange"))
    panels.append((curves.completion_length, "response length\n(tokens)", "tab:green"))
    heights = [3.0] + [1.1] * len(panels)
    figure = Figure(figsize=(10, 1.7 * sum(heights)), dpi=110, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(heights), 1, sharex=True, height_ratios=heights)
    figure.suptitle(title, fontsize=14, fontweight="bold")
    _draw_main_panel(axes[0], curves)
    if curves.reward.steps and not has_kl:
        axes[0].set_title("no KL penalty (KL panel left out)", loc="right", fontsize=9, color="dimgray")
    for ax, (series, label, color) in zip(axes[1:], panels):
        _draw_train_panel(ax, series, curves.average_window, label, color)
    for ax in axes:
        ax.grid(alpha=0.3)
        for i, step in enumerate(curves.resumed_at):
            ax.axvline(step, color="black", lw=0.8, ls="--", alpha=0.6,
                       label="resumed" if ax is axes[0] and i == 0 else None)
    for step in curves.resumed_at:
        axes[0].annotate("resumed", (step, 1), xycoords=("data", "axes fraction"), xytext=(3, -3),
                         textcoords="offset points", rotation=90, va="top", fontsize=8, color="dimgray")
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(loc="best", fontsize=9, framealpha=0.9)
    figure.align_ylabels(axes)
    axes[-1].set_xlabel("GRPO step")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))
    low, high = axes[-1].get_xlim()
    if high - low < 2:  # one logged step (or none): a readable span instead of +-0.05
        axes[-1].set_xlim((low + high) / 2 - 1, (low + high) / 2 + 1)
    return figure


def _draw_main_panel(ax: Axes, curves: CurveSeries) -> None:
    if curves.reward.steps:
        averaged = curves.average_window > 1
        ax.plot(curves.reward.steps, curves.reward.values, color="tab:blue", lw=0.8 if averaged else 1.5,
                alpha=0.3 if averaged else 1.0, label=REWARD_LABEL)
        if averaged:
            ax.plot(curves.reward_average.steps, curves.reward_average.values, color="tab:blue", lw=2,
                    label=f"sampled reward, {curves.average_window}-step moving average")
    if curves.accuracy.steps:
        ax.plot(curves.accuracy.steps, curves.accuracy.values, "o-", color="tab:red", lw=1.5, ms=5,
                label=curves.accuracy_label)
    low, high = main_axis_limits(curves)
    ax.set_ylim(low, high)
    ax.set_ylabel(main_axis_label(curves))
    if not curves.reward.steps and not curves.accuracy.steps:
        _no_data(ax, "no train or eval records yet")


def _draw_train_panel(ax: Axes, series: Series, window: int, label: str, color: str) -> None:
    ax.set_ylabel(label)
    if not series.steps:
        _no_data(ax, "not logged")
        return
    averaged = window > 1
    ax.plot(series.steps, series.values, color=color, lw=0.8 if averaged else 1.5, alpha=0.35 if averaged else 1.0)
    if averaged:
        ax.plot(series.steps, _trailing_mean(series.values, window), color=color, lw=1.8)


def _no_data(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="dimgray")
    ax.tick_params(axis="y", left=False, labelleft=False)


def _series(records: list[dict[str, Any]], key: str) -> Series:
    points = [(r["step"], float(r[key])) for r in records if _finite(r.get(key))]
    return Series([s for s, _ in points], [v for _, v in points])


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _trailing_mean(values: list[float], window: int) -> list[float]:
    means, total = [], 0.0
    for i, value in enumerate(values):
        total += value - (values[i - window] if i >= window else 0.0)
        means.append(total / min(i + 1, window))
    return means
