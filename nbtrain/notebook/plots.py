"""Plots of plans and runs: memory per device by pipeline stage, predicted against measured step time, a timeline,
the training and validation loss.

    >>> import nbtrain
    >>> from nbtrain.notebook.plots import loss_plot, memory_plot, step_time_plot, timeline_plot
    >>> prof = nbtrain.profile("gpt2", batch_size=1, seq_len=1024)
    >>> cluster = nbtrain.Cluster.from_catalog("H100", num_devices=8)
    >>> best = nbtrain.plan(prof, cluster, global_batch=32, seq_len=1024)
    >>> memory_plot(best)                                     # one stacked bar per pipeline stage, budget dashed
    >>> memory_plot([best, *nbtrain.baselines(prof, cluster, global_batch=32)])    # side by side with baselines
    >>> model = nbtrain.build_preset("gpt-tiny", device="cpu")               # a small GPT, trained here
    >>> result = nbtrain.fit(model, batches, plan="dp_shard=2", steps=20, num_processes=2,
    ...                      cluster=nbtrain.Cluster.detect())               # batches: (ids, targets) global batches
    >>> step_time_plot(result), timeline_plot(result)
    >>> loss_plot(result)              # the training loss per step; with fit(..., eval_data=), the validation loss
    >>> timeline_plot([("device", "backward 11", 0.0, 0.8), ("cpu", "update 11", 0.5, 1.1)])

Each function draws on ``ax`` when given, else on a new figure, and returns the Figure. They use matplotlib's
object-oriented API (``matplotlib.figure.Figure``), never pyplot's global state, so they run headless under
papermill and in tests, and matplotlib is imported only when a plot is drawn.
"""

from __future__ import annotations

import sys
import textwrap

from nbtrain.errors import InvalidArgumentError
from nbtrain.planner.plan import Plan
from nbtrain.units import format_bytes

GiB = 2**30
CATEGORIES = ("params", "grads", "optimizer", "activations", "transient", "reserve")
"""The fields of :class:`nbtrain.planner.cost.Memory`, bottom to top; the last two are drawn only when non-zero."""
COLORS = {"params": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868", "activations": "#c44e52",
          "transient": "#8172b3", "reserve": "#b0b0b0"}


def _display_in_ipython(figure_type) -> None:
    """A Figure made without pyplot has no notebook display until a backend registers one; register PNG then."""
    if "IPython" not in sys.modules:  # not inside IPython: nothing to register with
        return
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None:
        return
    png = shell.display_formatter.formatters["image/png"]
    try:
        png.lookup_by_type(figure_type)
    except KeyError:
        from IPython.core.pylabtools import print_figure

        png.for_type(figure_type, lambda fig: print_figure(fig, "png"))


def _canvas(ax, size: tuple[float, float]):
    """(figure, axes): ``ax``'s figure, or a new Figure of ``size`` inches with one Axes."""
    if ax is not None:
        return ax.figure, ax
    from matplotlib.figure import Figure

    _display_in_ipython(Figure)
    fig = Figure(figsize=size, layout="constrained")
    return fig, fig.add_subplot()


def _wrap(text: str, width: int) -> str:
    """``textwrap.fill`` line by line, so the line breaks already in ``text`` stay."""
    return "\n".join(textwrap.fill(line, width) for line in text.split("\n"))


def _time_unit(seconds: float) -> tuple[float, str]:
    """(scale, unit) that keeps ``seconds`` readable: s from 1 s, ms from 1 ms, else µs."""
    if seconds >= 1:
        return 1.0, "s"
    return (1e3, "ms") if seconds >= 1e-3 else (1e6, "µs")


# -- memory ------------------------------------------------------------------------------------------------------

def _labelled_plans(plans) -> list[tuple[str, Plan | None]]:
    """A plan, a Baseline, a list of either, or a dict label → plan, as (label, plan) pairs."""
    if isinstance(plans, Plan):
        return [(plans.model or "plan", plans)]
    if isinstance(plans, dict):
        return list(plans.items())
    if hasattr(plans, "plan") and hasattr(plans, "name"):  # one nbtrain.planner.recommend.Baseline
        return [(plans.name, plans.plan)]
    try:
        items = list(plans)
    except TypeError:
        raise InvalidArgumentError(f"cannot plot {plans!r}: give a Plan, a list of plans or baselines, or a dict "
                                   "label → plan") from None
    return [(p.name, p.plan) if hasattr(p, "plan") and hasattr(p, "name") else
            (_short(p) if isinstance(p, Plan) else str(p), p) for p in items]


def _short(plan: Plan) -> str:
    """A label that fits under a bar: the pipeline and the most common layer strategy (``pp=1 · dp_shard=8 …``)."""
    from collections import Counter

    common, count = Counter(plan.layers).most_common(1)[0]
    return f"pp={plan.pp} · {common}" + (" …" if count < plan.num_layers else "")


def _prediction(plan, label: str):
    if not isinstance(plan, Plan):
        raise InvalidArgumentError(f"{label!r} is {plan!r}, not a Plan; memory_plot draws nbtrain plans")
    pred = plan.predicted
    if isinstance(pred, dict):  # a plan read back from JSON without prediction_type
        from nbtrain.planner.cost import Prediction

        pred = Prediction.from_dict(pred)
    if pred is None:
        raise InvalidArgumentError(
            f"the plan '{plan}' has no prediction to plot; estimate it first: "
            "plan = plan.replace(predicted=nbtrain.estimate(plan, profile, cluster)), or get a recommended plan, "
            "prediction included, from nbtrain.plan(profile, cluster, global_batch=...)")
    return pred


def memory_plot(plans, ax=None):
    """Memory per device of each pipeline stage, stacked by what it holds, against the budget (dashed).

        >>> memory_plot(best)                                   # one bar per stage of one plan
        >>> memory_plot([best, *nbtrain.baselines(prof, cluster, global_batch=32)])   # side by side, per plan

    ``plans`` is a Plan with a prediction, a list of plans or baselines, or a dict label → plan. A baseline that
    does not apply (its plan is None) keeps its place, labelled so.
    """
    entries = _labelled_plans(plans)
    if not entries:
        raise InvalidArgumentError("memory_plot got no plans; give a Plan, a list of plans or a dict label → plan")
    single = isinstance(plans, Plan)
    bars, ticks, budgets, x = [], [], set(), 0.0  # bars: (x, StagePrediction)
    for label, plan in entries:
        if plan is None:
            ticks.append((x, f"{label} (does not apply)"))
            x += 1.6
            continue
        pred = _prediction(plan, label)
        budgets.add(pred.budget_bytes)
        for i, (stage, (start, end)) in enumerate(zip(pred.stages, plan.stage_ranges())):
            text = f"stage {i}\nlayers {start}-{end - 1}" if single else \
                label if plan.pp == 1 else f"{label}\nstage {i}"
            bars.append((x, stage))
            ticks.append((x, text))
            x += 1.0
        x += 0.6  # a gap between plans
    if not bars:
        raise InvalidArgumentError("none of the plans applies to this cluster (every one is None): nothing to plot")
    fig, ax = _canvas(ax, (max(6.0, 1.2 * len(ticks) + 2.5), 4.5))
    width = 0.7
    shown = [c for c in CATEGORIES if c in CATEGORIES[:4] or any(getattr(s.memory, c) for _, s in bars)]
    bottoms = [0.0] * len(bars)
    for category in shown:
        heights = [getattr(stage.memory, category) / GiB for _, stage in bars]
        ax.bar([x for x, _ in bars], heights, width, bottom=bottoms, label=category, color=COLORS[category])
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    for budget in sorted(budgets):
        ax.axhline(budget / GiB, linestyle="--", color="black", linewidth=1.2,
                   label=f"budget {format_bytes(budget)}")
    ax.set_xticks([t for t, _ in ticks], labels=[_wrap(s, 16) for _, s in ticks],
                  fontsize="small" if single else "x-small")
    ax.set_xlim(ticks[0][0] - 1, ticks[-1][0] + 1)  # a lone bar keeps a bar's width
    ax.set_ylim(0, 1.15 * max([*bottoms, *(b / GiB for b in budgets)]))
    ax.set_ylabel("memory per device (GiB)")
    if single:
        ax.set_title(textwrap.fill(f"memory per device: {plans.model or 'plan'} on {plans.num_devices} devices: "
                                   f"{plans}", 70), fontsize="medium")
    else:
        ax.set_title("memory per device by pipeline stage", fontsize="medium")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


# -- step time ---------------------------------------------------------------------------------------------------

def _labelled_results(results) -> list[tuple[str, object]]:
    if hasattr(results, "records"):
        return [(_short(results.plan), results)]
    if isinstance(results, dict):
        return list(results.items())
    return [(_short(r.plan), r) for r in results]


def step_time_plot(results, ax=None):
    """Predicted against measured step time per run, the ratio measured / predicted above each pair.

        >>> step_time_plot(nbtrain.fit(model, batches, plan="dp_shard=2", steps=20, num_processes=2, cluster=cluster))
        >>> step_time_plot({"dp_shard=2": a, "tp=2": b})          # several runs, labelled

    ``results`` is a FitResult, a list of them, or a dict label → FitResult. Measured is the median step time after
    the first (``FitResult.measured_step_s``); a run fitted without a cluster has no prediction, only its bar.
    """
    runs = _labelled_results(results)
    if not runs:
        raise InvalidArgumentError("step_time_plot got no runs; give a FitResult, a list of them or a dict")
    for label, run in runs:
        if not getattr(run, "records", None):
            raise InvalidArgumentError(f"run {label!r} has no steps to plot; give the FitResult that nbtrain.fit "
                                       "returned")
    measured = [run.measured_step_s for _, run in runs]
    predicted = [run.predicted_step_s for _, run in runs]
    scale, unit = _time_unit(max([*measured, *(p for p in predicted if p is not None)]))
    fig, ax = _canvas(ax, (max(4.5, 1.5 * len(runs) + 2), 4.2))
    width = 0.38
    pairs = [i for i, p in enumerate(predicted) if p is not None]
    ax.bar([i - width / 2 for i in pairs], [predicted[i] * scale for i in pairs], width, label="predicted",
           color="#8da0cb")
    ax.bar([i + width / 2 if predicted[i] is not None else i for i in range(len(runs))],
           [m * scale for m in measured], width, label="measured", color="#fc8d62")
    for i in pairs:
        top = max(predicted[i], measured[i]) * scale
        ax.text(i, top, f"{measured[i] / predicted[i]:.2f}×", ha="center", va="bottom", fontsize="small")
    labels = [label if predicted[i] is not None else f"{label}\n(no prediction)" for i, (label, _) in enumerate(runs)]
    ax.set_xticks(range(len(runs)), labels=[_wrap(s, 20) for s in labels], fontsize="small")
    ax.set_ylim(0, 1.2 * max([*measured, *(p for p in predicted if p is not None)]) * scale)
    ax.set_ylabel(f"step time ({unit})")
    ax.set_title("step time: predicted vs measured (median after the first step)\n"
                 "above each pair: measured / predicted", fontsize="medium")
    ax.legend(fontsize="small")
    return fig


# -- loss ------------------------------------------------------------------------------------------------------------

def loss_plot(results, ax=None):
    """The training loss of every step and, where the run evaluated (``fit(..., eval_data=)``), the validation loss
    after its step, dashed with markers in the same colour: the curves to tell overfitting from training.

        >>> import torch
        >>> windows = torch.randint(0, 512, (6, 4, 33), generator=torch.Generator().manual_seed(0))
        >>> batches = [(w[:, :-1], w[:, 1:]) for w in windows]
        >>> result = nbtrain.fit(nbtrain.build_preset("gpt-tiny", device="cpu"), batches[:4], plan="dp_shard=2",
        ...                      steps=4, num_processes=2, progress=False, eval_data=batches[4:], eval_every=2)
        >>> fig = loss_plot(result)         # the training loss of steps 1-4, the validation loss after 2 and 4

    ``results`` is a FitResult, a list of them, or a dict label → FitResult: ``loss_plot({"lr 3e-4": a, "lr 1e-3":
    b})`` draws two runs, labelled (one run's curves are "training" and "validation"; several runs' "LABEL:
    training" and "LABEL: validation").
    """
    runs = _labelled_results(results)
    if not runs:
        raise InvalidArgumentError("loss_plot got no runs; give a FitResult, a list of them or a dict")
    for label, run in runs:
        if not getattr(run, "records", None):
            raise InvalidArgumentError(f"run {label!r} has no steps to plot; give the FitResult that nbtrain.fit "
                                       "returned")
    fig, ax = _canvas(ax, (7, 4.2))
    one = len(runs) == 1
    for i, (label, run) in enumerate(runs):
        prefix, color = ("" if one else f"{label}: "), f"C{i % 10}"
        ax.plot([r.step for r in run.records], [r.loss for r in run.records], color=color, linewidth=1.4,
                label=f"{prefix}training")
        held = run.eval_losses
        if held:
            ax.plot(list(held), list(held.values()), color=color, linestyle="--", marker="o", markersize=4,
                    label=f"{prefix}validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    title = f"loss under {runs[0][1].plan}" if one else "loss per step"
    ax.set_title(textwrap.fill(title + (" (validation: held-out batches, eval mode)"
                                        if any(run.eval_losses for _, run in runs) else ""), 80), fontsize="medium")
    ax.legend(fontsize="small")
    return fig


# -- timeline ----------------------------------------------------------------------------------------------------

def _events(trace) -> tuple[list[tuple[str, str, float, float]], str]:
    """(events, title): a FitResult's steps end to end on one row, or the given events as (row, label, start, end)."""
    if hasattr(trace, "records"):
        events, t = [], 0.0
        for r in trace.records:
            events.append(("steps", f"{r.loss:.3f}", t, t + r.seconds))
            t += r.seconds
        return events, f"steps under {trace.plan}, each labelled with its loss"
    events = []
    for e in trace:
        if isinstance(e, (tuple, list)) and len(e) == 4:
            row, label, start, end = e
        elif all(hasattr(e, name) for name in ("row", "label", "start", "end")):
            row, label, start, end = e.row, e.label, e.start, e.end
        else:
            raise InvalidArgumentError(f"cannot read {e!r} as a timeline event; give (row, label, start_s, end_s) "
                                       "tuples or objects with row, label, start and end")
        if end < start:
            raise InvalidArgumentError(f"event {label!r} on row {row!r} ends ({end}) before it starts ({start})")
        events.append((str(row), str(label), float(start), float(end)))
    return events, "timeline"


def timeline_plot(trace, ax=None):
    """What ran when: one row per kind of work, one bar per event, labels inside the bars that have room.

        >>> timeline_plot(result)                  # a FitResult: its steps end to end, labelled with the loss
        >>> timeline_plot([("device", "backward 11", 0.0, 0.8), ("cpu", "update 11", 0.5, 1.1)])

    Events are ``(row, label, start_s, end_s)`` tuples or objects with ``row, label, start, end`` (seconds). Rows
    appear top to bottom in the order first seen, one colour each, so overlapping work shows as stacked bars.
    """
    events, title = _events(trace)
    if not events:
        raise InvalidArgumentError("the timeline has no events to plot")
    rows = list(dict.fromkeys(row for row, *_ in events))
    origin, last = min(e[2] for e in events), max(e[3] for e in events)
    scale, unit = _time_unit(last - origin)
    fig, ax = _canvas(ax, (9, 0.7 * len(rows) + 1.8))
    for i, row in enumerate(rows):
        mine = [e for e in events if e[0] == row]
        ax.barh([i] * len(mine), [(end - start) * scale for _, _, start, end in mine],
                left=[start * scale for _, _, start, _ in mine], height=0.6, color=f"C{i % 10}", label=row,
                edgecolor="white", linewidth=0.5)
    span = max((last - origin) * scale, 1e-12)
    ax.set_xlim(origin * scale, origin * scale + span)
    # A label fits when its width, at ~0.6 em per character, is inside its bar's width on screen.
    axes_px = fig.get_figwidth() * fig.dpi * ax.get_position().width
    char_px, font = 0.6 * 8 * fig.dpi / 72, 8
    for row, label, start, end in events:
        if len(label) * char_px <= (end - start) * scale / span * axes_px:
            ax.text((start + end) / 2 * scale, rows.index(row), label, ha="center", va="center", fontsize=font,
                    color="white", clip_on=True)
    ax.set_yticks(range(len(rows)), labels=rows)
    ax.invert_yaxis()  # the first row seen on top
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(textwrap.fill(title, 100), fontsize="medium")
    return fig
