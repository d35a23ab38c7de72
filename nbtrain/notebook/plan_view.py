"""What a planned cell shows in HTML: the compared plans as a step-time chart, memory per stage on the budget's scale,
and the static block that a live plan explorer stands in for.

    >>> import nbtrain
    >>> from nbtrain.notebook.plan_view import memory_bars_html, step_time_chart_html
    >>> prof = nbtrain.profile("gpt2", batch_size=1, seq_len=1024)
    >>> cluster = nbtrain.Cluster.from_catalog("H100", num_devices=8)
    >>> best = nbtrain.plan(prof, cluster, global_batch=32, seq_len=1024)
    >>> chart = step_time_chart_html(best, nbtrain.baselines(prof, cluster, global_batch=32, seq_len=1024))
    >>> bars = memory_bars_html(best)                 # one stacked bar per pipeline stage, 100% = the budget

Everything here is plain HTML with its own style (``VIEW_CSS``, and the tables' ``TABLE_CSS``), so it looks the same
in a static output, inside the explorer's widgets and in an exported page, with no script and no outside request.
"""

from __future__ import annotations

import html

from nbtrain.notebook.plots import CATEGORIES, COLORS
from nbtrain.planner.report import compared_plans, executor_cannot_run
from nbtrain.table import TABLE_CSS
from nbtrain.units import format_bytes, format_seconds

VIEW_CSS = (
    # the explorer's HTML parts take the explorer's width (as flex items they would take their content's) and
    # scroll a table wider than that
    ".nbtrain-explorer .widget-html-content{flex:1 1 auto;min-width:0;overflow-x:auto}"
    ".nbtrain-view h4{margin:0.8em 0 0.3em 0;font-size:100%;font-weight:600}"
    # element and class: above JupyterLab's own table rules (a fixed layout, right-aligned cells)
    "table.nbtrain-chart{table-layout:auto;border-collapse:collapse;width:100%;max-width:60em;"
    "font-variant-numeric:tabular-nums}"
    "table.nbtrain-chart td{padding:0.2em 0.6em;border:none;vertical-align:middle;text-align:left}"
    "table.nbtrain-chart td.name{white-space:nowrap;font-weight:600}"
    "table.nbtrain-chart td.strategy{white-space:nowrap;font-family:var(--jp-code-font-family,monospace);"
    "font-size:90%}"
    "table.nbtrain-chart td.track{width:45%;min-width:8em}"
    "table.nbtrain-chart td.num{white-space:nowrap}"
    ".nbtrain-bar{height:0.95em;min-width:2px}"
    ".nbtrain-bar.fits{background:#4c72b0}"
    ".nbtrain-bar.over{background:repeating-linear-gradient(45deg,#c44e52 0 4px,#f0c4c5 4px 8px)}"
    ".nbtrain-bar.first{background:#2a9d5c}"
    ".nbtrain-muted{color:#777;font-style:italic}"
    ".nbtrain-legend{font-size:90%;margin:0.2em 0 0.4em 0}"
    ".nbtrain-legend span.key{display:inline-block;width:0.9em;height:0.9em;vertical-align:-0.1em;"
    "margin:0 0.3em 0 0.9em}"
    ".nbtrain-stack{position:relative;display:flex;height:1em;background:rgba(127,127,127,0.15)}"
    ".nbtrain-stack .overflow{position:absolute;right:-3px;top:-3px;bottom:-3px;border-right:4px solid #c44e52}"
)
"""The charts' style; scoped to nbtrain's own classes, so it changes nothing else on the page."""

STATIC_SWAP_CSS = (
    # a live explorer in the same output area: it is the output, the static block steps aside
    ".jp-OutputArea:has(.nbtrain-explorer) .nbtrain-static{display:none}"
    # no live explorer (a notebook reopened, its kernel gone): the static block stays, and the widget's dead
    # placeholder ("Loading widget...", then "Error displaying widget: model not found") goes; JupyterLab marks every
    # rendered output with its MIME type except a widget's
    ".jp-OutputArea:has(.nbtrain-static):not(:has(.nbtrain-explorer)) .jp-OutputArea-child:has(.jupyter-widgets),"
    ".jp-OutputArea:has(.nbtrain-static):not(:has(.nbtrain-explorer))"
    " .jp-OutputArea-child:has(> .jp-OutputArea-output:not([data-mime-type])){display:none}"
)
"""What makes one output per cell in JupyterLab (and Notebook 7, built on it): the static plan and the explorer are
both in the cell's outputs, and the page shows whichever is alive."""


def styled(body: str) -> str:
    """``body`` with the tables' and the charts' style, in one block. Wrapping is set on the block itself: inside a
    widget, ipywidgets keeps HTML to one unwrapped line, and a plan's summary is longer than a line."""
    return (f'<div class="nbtrain-view" style="white-space:normal;line-height:1.4"><style>{TABLE_CSS}{VIEW_CSS}'
            f"</style>{body}</div>")


def strategy_label(plan, width: int = 40) -> str:
    """The plan as typed when that is short, else its pipeline and its most common layer strategy
    (``pp=1 mb=8 | mostly dp_shard=4 ac=op …``); the whole plan goes in the row's tooltip."""
    from collections import Counter

    text = str(plan)
    if len(text) <= width:
        return text
    common = Counter(plan.layers).most_common(1)[0][0]
    head = text.split("|")[0].strip() + " | " if "|" in text else ""
    return f"{head}mostly {common} …"


def step_time_chart_html(recommended, baselines, label: str = "recommended") -> str:
    """The compared plans as horizontal bars of predicted step time (shorter is faster), the numbers beside each bar:
    solid where the plan fits, hatched where it does not, no bar where it cannot run on this model."""
    rows = compared_plans(recommended, baselines, label)
    longest = max((p.predicted.step_time_s for _, p, _ in rows if p is not None), default=0.0) or 1.0
    best = recommended.predicted.step_time_s or 1.0
    out, footnotes = [], []
    for i, (name, plan, why) in enumerate(rows):
        if plan is None:
            said = "cannot run on this model" if executor_cannot_run(why) else "does not apply"
            out.append(f'<tr title="{html.escape(why)}"><td class="name">{html.escape(name)}</td><td class="strategy">'
                       f'</td><td class="track"></td><td class="num nbtrain-muted">{said}</td></tr>')
            if why:
                footnotes.append(f"<div>{html.escape(name)}: {html.escape(why)}</div>")
            continue
        pred = plan.predicted
        kind = ("first" if i == 0 else "fits") if pred.fits else "over"
        numbers = (f"{format_seconds(pred.step_time_s)} · {pred.step_time_s / best:.2f}× · "
                   f"{format_bytes(pred.memory_bytes)}")
        if not pred.fits:
            numbers += f" · does not fit {format_bytes(pred.budget_bytes)}"
        out.append(f'<tr title="{html.escape(str(plan))}"><td class="name">{html.escape(name)}</td>'
                   f'<td class="strategy">{html.escape(strategy_label(plan))}</td>'
                   f'<td class="track"><div class="nbtrain-bar {kind}" '
                   f'style="width:{100 * pred.step_time_s / longest:.2f}%"></div></td>'
                   f'<td class="num">{numbers}</td></tr>')
    legend = (f'<span class="key" style="background:#2a9d5c"></span>{html.escape(label)}'
              '<span class="key" style="background:#4c72b0"></span>fits'
              '<span class="key nbtrain-bar over"></span>does not fit'
              '<span class="key" style="background:rgba(127,127,127,0.15)"></span>cannot run on this model (no bar)')
    return (f"<h4>step time of the compared plans (predicted; shorter is faster; × = that plan's time over the "
            f"{html.escape(label)} plan's)</h4><table class=\"nbtrain-chart\">{''.join(out)}</table>"
            f'<div class="nbtrain-legend">{legend}</div><div class="nbtrain-notes">{"".join(footnotes)}</div>')


def memory_bars_html(plan) -> str:
    """Memory per device of each stage of ``plan``, stacked by kind, on the budget's scale (the full track is the
    budget; a stage over it fills the track and ends in a red mark)."""
    pred = plan.predicted
    budget = pred.budget_bytes or 1.0
    rows, largest = [], None
    for i, (stage, (start, end)) in enumerate(zip(pred.stages, plan.stage_ranges())):
        total = stage.memory.total
        scale = max(budget, total)  # a stage over budget: its parts in proportion, the track full
        segments = "".join(
            f'<div title="{category} {format_bytes(value)}" style="flex:none;width:{100 * value / scale:.3f}%;'
            f'background:{COLORS[category]}"></div>'
            for category in CATEGORIES if (value := getattr(stage.memory, category)) > 0)
        overflow = '<div class="overflow"></div>' if total > budget else ""
        said = f"{format_bytes(total)} of {format_bytes(budget)} ({100 * total / budget:.0f}%)"
        rows.append(f'<tr><td class="name">stage {i} (layers {start}-{end - 1})</td><td class="track">'
                    f'<div class="nbtrain-stack">{segments}{overflow}</div></td><td class="num">{said}</td></tr>')
        if largest is None or total > largest.total:
            largest = stage.memory
    legend = "".join(f'<span class="key" style="background:{COLORS[c]}"></span>{c} {format_bytes(getattr(largest, c))}'
                     for c in CATEGORIES if largest is not None and getattr(largest, c) > 0)
    return (f"<h4>memory per device by stage (the track is the budget, {format_bytes(budget)})</h4>"
            f'<table class="nbtrain-chart">{"".join(rows)}</table>'
            f'<div class="nbtrain-legend">largest stage:{legend}</div>')


def static_block(tables_html: str, notes: list[str], *, explorer_follows: bool) -> str:
    """The static plan (its tables, the chart, the notes) as one HTML block. ``explorer_follows``: a live explorer is
    shown after it in the same cell, so the block hides while the explorer lives and otherwise says how to get it
    back."""
    notes_html = "".join(f"<div>note: {html.escape(n)}</div>" for n in notes)
    body = tables_html + (f'<div class="nbtrain-notes">{notes_html}</div>' if notes else "")
    if not explorer_follows:
        return styled(body)
    rerun = '<div class="nbtrain-muted">re-run the cell to explore other clusters and budgets</div>'
    return styled(f'<style>{STATIC_SWAP_CSS}</style><div class="nbtrain-static">{body}{rerun}</div>')
