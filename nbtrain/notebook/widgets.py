"""The plan explorer: change the cluster, the memory per device or the batch, and watch the recommendation follow.

    >>> import nbtrain
    >>> from nbtrain.notebook.widgets import explore
    >>> prof = nbtrain.profile("gpt2", batch_size=1, seq_len=1024)
    >>> explore(prof, num_devices=8, device="H100", global_batch=32)      # in Jupyter: controls and live outputs

``explore`` returns None outside a Jupyter kernel or when ``NBTRAIN_NONINTERACTIVE`` is set (CI, papermill), so a
notebook that calls it runs headless unchanged. ipywidgets is imported only when an explorer is built.
"""

from __future__ import annotations

import html
import os
import time

from nbtrain.checks import positive_int
from nbtrain.errors import InvalidArgumentError, NbtrainError
from nbtrain.notebook.plots import CATEGORIES, COLORS
from nbtrain.units import format_bytes, format_seconds

DEVICE_COUNTS = tuple(2**k for k in range(11))  # 1 .. 1024
DEVICES_PER_NODE = (1, 2, 4, 8, 16)


def interactive() -> bool:
    """Whether widgets can be shown: inside a Jupyter kernel, with ipywidgets, and ``NBTRAIN_NONINTERACTIVE`` unset
    (or ``"0"``). A plain IPython terminal has no kernel to render widgets, so it counts as non-interactive."""
    if os.environ.get("NBTRAIN_NONINTERACTIVE", "") not in ("", "0"):
        return False
    try:
        import IPython
    except ImportError:
        return False
    shell = IPython.get_ipython()
    if shell is None or getattr(shell, "kernel", None) is None:
        return False
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return True


def memory_bars_html(plan) -> str:
    """Memory per device of each stage of ``plan`` as stacked HTML bars, the budget as a dashed mark."""
    pred = plan.predicted
    scale = max(pred.budget_bytes, pred.memory_bytes) or 1.0
    rows = []
    for i, (stage, (start, end)) in enumerate(zip(pred.stages, plan.stage_ranges())):
        segments = "".join(
            f'<div title="{category} {format_bytes(value)}" style="flex:none;width:{100 * value / scale:.3f}%;'
            f'background:{COLORS[category]}"></div>'
            for category in CATEGORIES if (value := getattr(stage.memory, category)) > 0)
        budget = (f'<div style="position:absolute;left:{100 * pred.budget_bytes / scale:.3f}%;top:-3px;bottom:-3px;'
                  'border-left:2px dashed black"></div>')
        rows.append(
            f'<tr><td style="white-space:nowrap">stage {i} (layers {start}-{end - 1})</td>'
            f'<td style="width:60%"><div style="position:relative;display:flex;height:14px;background:#eee">'
            f'{segments}{budget}</div></td>'
            f'<td style="text-align:right;white-space:nowrap">{format_bytes(stage.memory.total)} of '
            f'{format_bytes(pred.budget_bytes)}</td></tr>')
    legend = " ".join(f'<span style="color:{COLORS[c]}">&#9632;</span>&nbsp;{c}' for c in CATEGORIES)
    return (f"<div><b>memory per device by stage</b> (dashed: the budget)</div>"
            f'<table style="width:100%">{"".join(rows)}</table><div style="font-size:smaller">{legend}</div>')


def _memory_text(memory) -> str:
    """The memory box's text for the ``memory`` argument: ``None`` → empty (the device's own)."""
    if memory is None:
        return ""
    return memory if isinstance(memory, str) else format_bytes(memory).replace(" ", "")


class PlanExplorer:
    """Controls for the cluster and the batch; below them the recommended plan, its memory per stage and the
    baselines, recomputed whenever a control changes.

        >>> ex = PlanExplorer(prof, num_devices=8, device="A100-40GB", memory="24GiB", global_batch=32)
        >>> ex                                           # the last expression of a cell shows the widget
        >>> ex.controls["devices"].value = 16            # replans at once
        >>> ex.plan.num_devices, ex.error
        (16, None)

    ``controls`` maps ``devices``, ``devices_per_node``, ``device``, ``memory``, ``global_batch`` and ``seq_len`` to
    their widgets. ``plan`` is the recommendation for the controls as they are, or None while they ask for
    something impossible, which ``error`` then explains (it is shown in place of the plan, never raised).
    ``devices_per_node`` starts at most at ``num_devices``.
    """

    def __init__(self, profile, *, num_devices: int = 8, devices_per_node: int = 8, device: str = "H100",
                 memory=None, global_batch: int = 32, seq_len: int | None = None):
        import ipywidgets as w

        from nbtrain.profiler.hardware import CATALOG, lookup
        from nbtrain.profiler.result import ModelProfile

        if not isinstance(profile, ModelProfile):  # a preset name or a module, as nbtrain.plan takes
            from nbtrain.profiler.model import profile as run_profile

            profile = run_profile(profile, batch_size=1, seq_len=seq_len)
        for name, value in (("num_devices", num_devices), ("devices_per_node", devices_per_node)):
            positive_int(value, f"{name} must be a whole number ≥ 1, got {value!r}")
        self.profile = profile
        self.plan = None
        self.error: str | None = None
        self.baselines: list = []
        style = {"description_width": "initial"}
        per_node = min(devices_per_node, num_devices)
        self.controls = {
            "devices": w.Dropdown(options=sorted({*DEVICE_COUNTS, num_devices}), value=num_devices,
                                  description="devices", style=style),
            "devices_per_node": w.Dropdown(options=sorted({*DEVICES_PER_NODE, per_node}), value=per_node,
                                           description="per node", style=style),
            "device": w.Dropdown(options=list(CATALOG), value=lookup(device), description="device", style=style),
            "memory": w.Text(value=_memory_text(memory), placeholder="the device's own, e.g. 24GiB",
                             description="memory/device", continuous_update=False, style=style),
            "global_batch": w.IntText(value=global_batch, description="global batch", style=style),
            "seq_len": w.IntText(value=seq_len or profile.seq_len, description="sequence length", style=style),
        }
        self.status = w.HTML()
        """One line: "planning…" while the planner runs, then the cluster and the time it took, or the error."""
        self.summary = w.HTML()
        """The recommended plan's summary line and its table."""
        self.memory = w.HTML()
        """Memory per device by stage, stacked bars against the budget."""
        self.comparison = w.HTML()
        """The recommended plan beside its alternatives and the baselines (DDP, FSDP, Megatron TP, ...)."""
        c = self.controls
        self.widget = w.VBox([
            w.HTML(f"<b>plan explorer: {html.escape(profile.model)}</b>"),
            w.HBox([c["devices"], c["devices_per_node"], c["device"]]),
            w.HBox([c["memory"], c["global_batch"], c["seq_len"]]),
            self.status, self.summary, self.memory, self.comparison,
        ])
        self._per_node, self._following = devices_per_node, False
        for control in c.values():
            control.observe(self._changed, names="value")
        self.update()

    def _changed(self, change) -> None:
        if self._following:
            return
        per_node = self.controls["devices_per_node"]
        if change["owner"] is per_node:
            self._per_node = change["new"]  # the user's choice, kept while the device count moves
        elif change["owner"] is self.controls["devices"]:
            # devices per node follow the device count: min(the user's choice, devices), so 1 → 2 devices is one
            # node of 2, not two nodes of 1
            wanted = min(self._per_node, change["new"])
            if per_node.value != wanted:
                self._following = True
                try:
                    per_node.options = sorted({*per_node.options, wanted})
                    per_node.value = wanted
                finally:
                    self._following = False
        self.update()

    def _replan(self):
        """(plan, baselines, cluster) for the controls' values; raises what the planner raises."""
        from nbtrain.planner import recommend
        from nbtrain.profiler.hardware import Cluster
        from nbtrain.units import parse_bytes

        v = {name: control.value for name, control in self.controls.items()}
        text = v["memory"].strip()
        memory = parse_bytes(text) if text else None
        if memory is not None and memory <= 0:
            raise InvalidArgumentError(f"memory per device {text!r} is not positive; write it like '24GiB', or "
                                       "leave the box empty for the device's own")
        if v["seq_len"] is None or v["seq_len"] < 1:
            raise InvalidArgumentError(f"the sequence length must be at least 1 token, got {v['seq_len']}")
        cluster = Cluster.from_catalog(v["device"], num_devices=v["devices"], devices_per_node=v["devices_per_node"])
        args = dict(global_batch=v["global_batch"], seq_len=v["seq_len"], memory=memory)
        best = recommend.plan(self.profile, cluster, **args)
        return best, recommend.baselines(self.profile, cluster, **args), cluster

    def update(self):
        """Plan again for the controls' current values; returns the plan, or None (and sets ``error``)."""
        from nbtrain.planner.report import comparison_table

        self.status.value = "<i>planning…</i>"
        started = time.perf_counter()
        try:
            best, baselines, cluster = self._replan()
        except Exception as e:  # a widget callback has nowhere to raise to: show it where the plan would be
            message = str(e) if isinstance(e, NbtrainError) else f"unexpected {type(e).__name__}: {e}"
            self.plan, self.baselines, self.error = None, [], message
            self.status.value = f'<div style="color:#b00020"><b>cannot plan:</b> {html.escape(message)}</div>'
            self.summary.value = self.memory.value = self.comparison.value = ""
            return None
        self.plan, self.baselines, self.error = best, baselines, None
        took = format_seconds(time.perf_counter() - started)
        self.status.value = f"<div>{html.escape(cluster.summary())} · planned in {took}</div>"
        self.summary.value = f"<div><b>{html.escape(best.summary())}</b></div>{best.table()._repr_html_()}"
        self.memory.value = memory_bars_html(best)
        self.comparison.value = comparison_table(best, baselines)._repr_html_()
        return best

    def __repr__(self) -> str:
        shown = self.plan.summary() if self.plan is not None else f"error: {self.error}"
        return f"PlanExplorer({self.profile.model}; {shown})"

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)

    def _repr_mimebundle_(self, include=None, exclude=None, **kwargs):
        return self.widget._repr_mimebundle_(include=include, exclude=exclude, **kwargs)


def explore(profile, **kwargs) -> PlanExplorer | None:
    """A :class:`PlanExplorer` in a Jupyter kernel; None elsewhere (CI, papermill, scripts), where no widget is made.

        >>> explore(nbtrain.profile("gpt2", batch_size=1, seq_len=1024), num_devices=16, memory="40GiB")
    """
    return PlanExplorer(profile, **kwargs) if interactive() else None
