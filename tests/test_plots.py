"""The reward-curve figure: the data it draws (deduped, gaps skipped, resumes marked) and the
figure itself (one honest 0-1 axis for reward and accuracy, panels, a valid PNG for any records)."""

import math
import struct
import subprocess
import sys

import pytest

from novarl.logging.plots import (ACCURACY_LABEL, MAIN_YLABEL, REWARD_LABEL, curve_series, draw_reward_curve,
                                  main_axis_label, main_axis_limits, plot_reward_curve)


def train(step, reward, **extra):
    record = {"kind": "train", "step": step, "reward_mean": reward, "loss": 0.01 * (step % 7 - 3),
              "grad_norm": 1.0, "completion_length_mean": 200.0 - step / 3, "lr": 1e-6, "clip_fraction": 0.02,
              "kl_to_reference": 0.0, "time_step": 2.5}
    return {**record, **extra}


def evaluation(step, accuracy):
    return {"kind": "eval", "step": step, "accuracy": accuracy, "reward": accuracy, "num_samples": 100.0}


def run_records(num_steps=300, *, kl=True, eval_every=50):
    """A run whose sampled reward rises 0.1 -> 0.3 and whose greedy accuracy rises 0.3 -> 0.49."""
    records = [evaluation(0, 0.30)]
    for step in range(1, num_steps + 1):
        kl_value = 1e-3 * step / 50 if kl else 0.0
        records.append(train(step, 0.1 + 0.2 * step / num_steps + 0.03 * math.sin(step), kl_to_reference=kl_value))
        if step % eval_every == 0:
            records.append(evaluation(step, 0.30 + 0.19 * step / num_steps))
    return records


def line(ax, label):
    [found] = [line for line in ax.get_lines() if line.get_label() == label]
    return found


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def test_resumed_run_later_record_for_a_step_wins_and_resume_is_marked():
    first = [train(s, 0.1) for s in range(1, 11)] + [evaluation(10, 0.2)]
    # Resumed from the step-6 checkpoint: steps 7-10 are logged again, then the run goes on to 14.
    second = [{"kind": "resume", "step": 6}] + [train(s, 0.5) for s in range(7, 15)] + [evaluation(10, 0.4)]
    curves = curve_series(first + second)
    assert curves.reward.steps == list(range(1, 15))
    assert curves.reward.values == [0.1] * 6 + [0.5] * 8
    assert curves.accuracy.steps == [10] and curves.accuracy.values == [0.4]
    assert curves.resumed_at == [6]


def test_none_and_non_finite_values_are_skipped_per_series():
    records = [train(1, 0.2), train(2, None), train(3, 0.4, loss=None), train(4, float("nan")),
               {"kind": "eval", "step": 5, "accuracy": None}, evaluation(6, 0.5),
               {"kind": "checkpoint", "step": 3}, {"kind": "train", "reward_mean": 0.9}]
    curves = curve_series(records)
    assert curves.reward.steps == [1, 3] and curves.reward.values == [0.2, 0.4]
    assert curves.loss.steps == [1, 2, 4]
    assert curves.completion_length.steps == [1, 2, 3, 4]
    assert curves.accuracy.steps == [6]
    assert curves.resumed_at == []


@pytest.mark.parametrize("kl_values, expected_steps", [
    ([0.0, 0.0, 0.0], []),          # no KL penalty: the loss logs zeros
    ([None, None, None], []),
    ([0.0, 0.002, 0.003], [1, 2, 3]),
])
def test_kl_series_is_empty_without_a_kl_penalty(kl_values, expected_steps):
    records = [train(step, 0.2, kl_to_reference=kl) for step, kl in enumerate(kl_values, start=1)]
    assert curve_series(records).kl_to_reference.steps == expected_steps
    without_key = [{k: v for k, v in r.items() if k != "kl_to_reference"} for r in records]
    assert curve_series(without_key).kl_to_reference.steps == []


def test_reward_moving_average_is_trailing_over_the_window():
    records = [train(step, float(step % 2)) for step in range(1, 101)]  # 1, 0, 1, 0, ...
    curves = curve_series(records)
    assert curves.average_window == 4
    assert curves.reward_average.values[:3] == pytest.approx([1.0, 0.5, 2 / 3])
    assert curves.reward_average.values[3:] == pytest.approx([0.5] * 97)


def test_reward_and_accuracy_share_one_unit_axis():
    curves = curve_series(run_records())
    figure = draw_reward_curve(curves)
    main = figure.axes[0]
    low, high = main.get_ylim()
    assert -0.05 <= low <= 0 and 1 <= high <= 1.05
    assert main.get_ylabel() == MAIN_YLABEL
    # Accuracy is a fraction on the reward's axis: 0.49, not 49 on a twin axis.
    assert line(main, ACCURACY_LABEL).get_ydata()[-1] == pytest.approx(0.49)
    assert max(line(main, REWARD_LABEL).get_ydata()) < 0.35
    legend = [text.get_text() for text in main.get_legend().get_texts()]
    assert legend[0] == REWARD_LABEL and ACCURACY_LABEL in legend
    # main, loss, KL, response length: no twin axes.
    assert [ax.get_ylabel() for ax in figure.axes[1:]] == ["loss", "KL to reference", "response length\n(tokens)"]
    assert all(ax.get_shared_x_axes().joined(main, ax) for ax in figure.axes[1:])


def test_without_kl_penalty_the_kl_panel_is_left_out_and_said_so():
    figure = draw_reward_curve(curve_series(run_records(kl=False)))
    assert [ax.get_ylabel() for ax in figure.axes[1:]] == ["loss", "response length\n(tokens)"]
    assert "no KL penalty" in figure.axes[0].get_title(loc="right")


def test_the_policys_entropy_gets_a_panel_where_the_run_logged_it():
    records = [r if r["kind"] != "train" else {**r, "approx_entropy": 1.5 - r["step"] / 300}
               for r in run_records(kl=False)]
    figure = draw_reward_curve(curve_series(records))
    assert [ax.get_ylabel() for ax in figure.axes[1:]] == ["loss", "entropy\n(nats/token)", "response length\n(tokens)"]
    assert figure.axes[2].get_lines()[0].get_ydata()[-1] == pytest.approx(0.5)


def test_rewards_outside_unit_interval_widen_the_axis_and_say_so():
    records = run_records(60) + [train(61, 3.5), train(62, -2.0)]
    curves = curve_series(records)
    low, high = main_axis_limits(curves)
    assert low < -2.0 and high > 3.5
    assert "widened" in main_axis_label(curves) and "-2" in main_axis_label(curves)
    assert draw_reward_curve(curves).axes[0].get_ylim() == pytest.approx((low, high))


def test_resume_marker_is_a_dashed_line_in_every_panel():
    records = run_records(200)
    records += [{"kind": "resume", "step": 120}] + [train(s, 0.4) for s in range(121, 160)]
    figure = draw_reward_curve(curve_series(records))
    for ax in figure.axes:
        dashed = [ln for ln in ax.get_lines() if ln.get_linestyle() == "--"]
        assert [ln.get_xdata()[0] for ln in dashed] == [120]
    main = figure.axes[0]
    assert "resumed" in [text.get_text() for text in main.get_legend().get_texts()]
    assert "resumed" in [text.get_text() for text in main.texts]


@pytest.mark.parametrize("name, records", [
    ("run", run_records()),
    ("resumed_with_gaps", run_records(100) + [{"kind": "resume", "step": 80}, train(81, None), train(82, 0.3)]),
    ("empty", []),
    ("eval_only", [evaluation(0, 0.3)]),
    ("one_step", [train(1, 0.2)]),
])
def test_png_is_written_for_any_records(tmp_path, name, records):
    path = plot_reward_curve(records, tmp_path / "plots" / f"{name}.png", title="GRPO on tiny-model")
    width, height = png_size(path)
    assert width >= 1000 and height >= 900
    assert path.stat().st_size > 20_000


def test_importing_plots_does_not_import_matplotlib():
    code = "import sys, novarl.logging.plots; assert 'matplotlib' not in sys.modules, 'matplotlib imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
