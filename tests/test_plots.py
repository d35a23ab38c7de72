"""Plots of plans and runs: what each bar, line and label stands for, checked against the numbers it shows.

    .venv/bin/python -m pytest -q tests/test_plots.py          # ~15 s: profiles gpt2 and plans it once
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import pytest
from matplotlib.figure import Figure

import nbtrain
from nbtrain.errors import InvalidArgumentError
from nbtrain.notebook.plots import memory_plot, step_time_plot, timeline_plot
from nbtrain.run.fit_result import FitResult
from nbtrain.run.trainer import StepRecord

GiB = 2**30


@pytest.fixture(scope="module")
def prof():
    return nbtrain.profile("gpt2", batch_size=1, seq_len=1024)


@pytest.fixture(scope="module")
def cluster():
    return nbtrain.Cluster.from_catalog("H100", num_devices=8)


@pytest.fixture(scope="module")
def best(prof, cluster):
    return nbtrain.plan(prof, cluster, global_batch=32, seq_len=1024)


@pytest.fixture(scope="module")
def two_stages(prof, cluster):
    return nbtrain.plan(prof, cluster, global_batch=32, seq_len=1024, strategy="pp=2 mb=4 | dp_shard=4")


def segments(ax) -> dict[str, list[float]]:
    """Bar heights by legend label (one bar container per memory category, or per timeline row)."""
    return {c.get_label(): [bar.get_height() for bar in c] for c in ax.containers}


def tick_labels(axis) -> list[str]:
    return [t.get_text() for t in axis.get_ticklabels()]


def run(plan, seconds, predicted=None, losses=None) -> FitResult:
    """A FitResult as rank 0 reports it, with step times chosen by the test."""
    losses = losses or [5.0 - 0.1 * i for i in range(len(seconds))]
    records = [StepRecord(step=i, loss=loss, seconds=s, tokens_per_s=1000 / s, peak_memory_bytes=GiB)
               for i, (s, loss) in enumerate(zip(seconds, losses))]
    return FitResult(plan=plan, records=records, predicted_step_s=predicted)


# --- memory ------------------------------------------------------------------------------------------------------

def test_memory_plot_stacks_each_category_of_the_prediction_in_gib(best):
    ax = memory_plot(best).axes[0]
    stage = best.predicted.stages[0]
    bars = segments(ax)
    assert {"params", "grads", "optimizer", "activations"} <= set(bars)
    for category, heights in bars.items():
        assert heights == pytest.approx([getattr(stage.memory, category) / GiB])
    # the segments together are the stage's whole memory per device, each starting where the one below ends
    assert sum(h[0] for h in bars.values()) == pytest.approx(stage.memory.total / GiB)
    tops = [c[0].get_y() + c[0].get_height() for c in ax.containers]
    assert [c[0].get_y() for c in ax.containers] == pytest.approx([0.0] + tops[:-1])
    assert "GiB" in ax.get_ylabel() and best.model in ax.get_title()


def test_transient_and_reserve_have_segments_only_when_predicted_non_zero(best):
    memory = best.predicted.stages[0].memory
    labels = set(segments(memory_plot(best).axes[0]))
    assert ("transient" in labels) == (memory.transient > 0) and ("reserve" in labels) == (memory.reserve > 0)


def test_memory_plot_draws_the_budget_as_a_labelled_dashed_line(best):
    ax = memory_plot(best).axes[0]
    (line,) = [line for line in ax.lines if line.get_label().startswith("budget")]
    assert list(line.get_ydata()) == pytest.approx([best.predicted.budget_bytes / GiB] * 2)  # across the axes
    assert line.get_linestyle() == "--"
    assert line.get_label() in [t.get_text() for t in ax.get_legend().get_texts()]


def test_a_two_stage_plan_gets_one_bar_per_stage(two_stages):
    ax = memory_plot(two_stages).axes[0]
    stages = two_stages.predicted.stages
    assert len(stages) == 2
    for category, heights in segments(ax).items():
        assert heights == pytest.approx([getattr(s.memory, category) / GiB for s in stages])
    assert [label.split("\n")[0] for label in tick_labels(ax.xaxis)] == ["stage 0", "stage 1"]


def test_several_plans_stand_side_by_side_under_their_labels(prof, cluster, best, two_stages):
    ax = memory_plot({"recommended": best, "pipeline": two_stages}).axes[0]
    assert len(ax.containers[0]) == 1 + 2  # one bar per stage of each plan
    labels = tick_labels(ax.xaxis)
    assert labels[0] == "recommended" and all(label.startswith("pipeline") for label in labels[1:])

    base = nbtrain.baselines(prof, cluster, global_batch=32, seq_len=1024)
    ax = memory_plot([best, *base]).axes[0]
    shown = " ".join(tick_labels(ax.xaxis)).replace("\n", " ")
    assert all(b.name in shown for b in base)
    assert len(ax.containers[0]) == 1 + sum(b.plan.pp for b in base if b.plan is not None)


def test_a_plan_without_prediction_says_to_estimate_it_first(best):
    bare = best.replace()  # replace drops the prediction: it described the old plan
    assert bare.predicted is None
    with pytest.raises(InvalidArgumentError, match=r"no prediction.*nbtrain\.estimate\(plan, profile, cluster\)"):
        memory_plot(bare)


def test_memory_plot_draws_on_the_axes_it_is_given(best):
    fig = Figure()
    ax = fig.add_subplot(1, 2, 2)
    assert memory_plot(best, ax=ax) is fig and ax.containers


# --- step time ---------------------------------------------------------------------------------------------------

def test_step_time_plot_puts_the_measured_median_beside_the_prediction_with_their_ratio(best):
    # measured: the median after the warm-up step, of 0.20, 0.30, 0.25 s = 0.25 s; predicted 0.20 s
    ax = step_time_plot(run(best, [0.9, 0.2, 0.3, 0.25], predicted=0.2)).axes[0]
    assert "ms" in ax.get_ylabel()
    assert segments(ax) == {"predicted": pytest.approx([200.0]), "measured": pytest.approx([250.0])}
    assert [t.get_text() for t in ax.texts] == ["1.25×"]


def test_a_run_without_prediction_shows_only_its_measured_bar_and_says_so(best, two_stages):
    ax = step_time_plot({"fast": run(best, [3.0, 1.0, 1.0], predicted=0.5),
                         "slow": run(two_stages, [4.0, 2.0, 1.0, 1.5])}).axes[0]
    assert "(s)" in ax.get_ylabel()  # seconds, since the steps take seconds
    assert segments(ax) == {"predicted": pytest.approx([0.5]), "measured": pytest.approx([1.0, 1.5])}
    assert [t.get_text() for t in ax.texts] == ["2.00×"]
    labels = tick_labels(ax.xaxis)
    assert labels[0] == "fast" and "slow" in labels[1] and "no prediction" in labels[1]


# --- timeline ----------------------------------------------------------------------------------------------------

@dataclass
class Event:
    row: str
    label: str
    start: float
    end: float


def test_timeline_rows_appear_in_first_seen_order_with_bars_from_start_to_end():
    events = [("device", "backward 2", 0.0, 0.5), ("cpu", "update 2", 0.5, 1.25),
              Event("device", "backward 1", 0.5, 1.0), Event("cpu", "update 1", 1.25, 2.0)]
    ax = timeline_plot(events).axes[0]
    assert tick_labels(ax.yaxis) == ["device", "cpu"] and ax.yaxis_inverted()  # the first row on top
    assert "(s)" in ax.get_xlabel()
    extents = {c.get_label(): [(bar.get_x(), bar.get_x() + bar.get_width()) for bar in c] for c in ax.containers}
    assert extents == {"device": [(0.0, 0.5), (0.5, 1.0)], "cpu": [(0.5, 1.25), (1.25, 2.0)]}
    device, cpu = ax.containers
    assert device[0].get_facecolor() != cpu[0].get_facecolor()
    assert {t.get_text() for t in ax.texts} == {"backward 2", "backward 1", "update 2", "update 1"}


def test_timeline_of_a_run_lays_its_steps_end_to_end_labelled_with_the_loss(best):
    result = run(best, [0.3, 0.2, 0.2], losses=[4.5, 4.25, 4.0])
    ax = timeline_plot(result).axes[0]
    assert tick_labels(ax.yaxis) == ["steps"] and "ms" in ax.get_xlabel()
    (steps,) = ax.containers
    assert [edge for b in steps for edge in (b.get_x(), b.get_x() + b.get_width())] == \
        pytest.approx([0.0, 300.0, 300.0, 500.0, 500.0, 700.0])
    assert [t.get_text() for t in ax.texts] == ["4.500", "4.250", "4.000"]


def test_a_label_wider_than_its_bar_is_left_out():
    ax = timeline_plot([("device", "a label far too long for its bar", 0.0, 0.01), ("device", "wide", 0.01, 1.0)]
                       ).axes[0]
    assert [t.get_text() for t in ax.texts] == ["wide"]


def test_timeline_rejects_what_is_not_an_event():
    with pytest.raises(InvalidArgumentError, match=r"\(row, label, start_s, end_s\)"):
        timeline_plot([("device", 0.0, 1.0)])
    with pytest.raises(InvalidArgumentError, match="ends .* before it starts"):
        timeline_plot([("device", "backward", 1.0, 0.5)])


# --- headless ----------------------------------------------------------------------------------------------------

def test_figures_render_to_png_without_pyplot(best):
    for fig in (memory_plot(best), step_time_plot(run(best, [0.2, 0.1])), timeline_plot([("cpu", "x", 0, 1)])):
        assert fig.canvas.manager is None  # not registered with pyplot: nothing piles up in a long notebook
        png = io.BytesIO()
        fig.savefig(png, format="png")
        assert png.getvalue().startswith(b"\x89PNG")
