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
import threading
import time

from nbtrain.checks import positive_int
from nbtrain.errors import InvalidArgumentError, NbtrainError
from nbtrain.notebook.plan_view import memory_bars_html, step_time_chart_html, styled
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


def _memory_text(memory) -> str:
    """The memory box's text for the ``memory`` argument: ``None`` → empty (the device's own)."""
    if memory is None:
        return ""
    return memory if isinstance(memory, str) else format_bytes(memory).replace(" ", "")


class PlanExplorer:
    """Controls for the cluster and the batch; below them the recommended plan, its memory per stage and a chart of
    the compared plans' step times, recomputed whenever a control changes.

        >>> ex = PlanExplorer(prof, num_devices=8, device="A100-40GB", memory="24GiB", global_batch=32)
        >>> ex                                           # the last expression of a cell shows the widget
        >>> ex.controls["devices"].value = 4             # a choice from a list replans at once
        >>> ex.plan.num_devices, ex.error
        (4, None)
        >>> ex.controls["memory"].value = "40GiB"        # typed: replans once typing pauses (debounce_s)
        >>> ex.settle().predicted.budget_bytes / 2**30
        40.0

    ``controls`` maps ``devices``, ``devices_per_node``, ``device``, ``memory``, ``global_batch`` and ``seq_len`` to
    their widgets. ``plan`` is the recommendation for the controls as they are, or None while they ask for
    something impossible, which ``error`` then explains (it is shown in place of the plan, never raised).
    ``devices_per_node`` starts at most at ``num_devices``. ``opening=(plan, baselines, cluster)`` shows a plan
    already made (the cell's) until a control changes, instead of planning again.

    A replan that has searched ``search_seconds`` (default 3 s) shows the best plan found so far, says so in the
    status line, and searches on in the background; the explorer shows the best plan when that search ends, unless
    a control changed meanwhile (then the stale search stops). ``settle()`` waits for it too. The layers' prices
    are kept between replans (:mod:`nbtrain.planner.cost_tables`), so a change prices only what it has not seen.
    """

    TYPED = ("memory", "global_batch", "seq_len")
    """The boxes a person types into: they update as typed, and replan ``debounce_s`` after the last keystroke."""

    def __init__(self, profile, *, num_devices: int = 8, devices_per_node: int = 8, device: str = "H100",
                 memory=None, global_batch: int = 32, seq_len: int | None = None, opening=None,
                 debounce_s: float = 0.6, search_seconds: float | None = 3.0):
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
        self.debounce_s = debounce_s
        self.search_seconds = search_seconds
        self._timer: threading.Timer | None = None
        self._planning = threading.Lock()
        self._generation = 0  # one more at every replan: a search in the background shows its plan only if current
        self._searching: threading.Thread | None = None
        style = {"description_width": "initial"}
        per_node = min(devices_per_node, num_devices)
        self.controls = {
            "devices": w.Dropdown(options=sorted({*DEVICE_COUNTS, num_devices}), value=num_devices,
                                  description="devices", style=style),
            "devices_per_node": w.Dropdown(options=sorted({*DEVICES_PER_NODE, per_node}), value=per_node,
                                           description="per node", style=style),
            "device": w.Dropdown(options=list(CATALOG), value=lookup(device), description="device", style=style),
            "memory": w.Text(value=_memory_text(memory), placeholder="the device's own",
                             description="memory per device", continuous_update=True, style=style),
            "global_batch": w.IntText(value=global_batch, description="global batch", continuous_update=True,
                                      style=style, layout=w.Layout(width="12em")),
            "seq_len": w.IntText(value=seq_len or profile.seq_len, description="sequence length",
                                 continuous_update=True, style=style, layout=w.Layout(width="14em")),
        }
        self.status = w.HTML()
        """One line: "planning…" while the planner runs, then the cluster, the budget in force and the time it
        took, or the error."""
        self.summary = w.HTML()
        """The recommended plan's summary line and its table."""
        self.memory = w.HTML()
        """Memory per device by stage, stacked by kind, on the budget's scale."""
        self.comparison = w.HTML()
        """The recommended plan beside its alternatives and the baselines (DDP, FSDP, Megatron TP, ...): a chart of
        their step times."""
        c = self.controls
        unit = lambda text: w.HTML(f'<span style="color:#777;white-space:nowrap">{text}</span>')  # noqa: E731
        self.widget = w.VBox([
            w.HTML(f"<b>plan explorer: {html.escape(profile.model)}</b>"),
            w.HBox([c["devices"], c["devices_per_node"], c["device"]]),
            w.HBox([c["memory"], unit("e.g. 24GiB, 512MiB, 80GB"), c["global_batch"], unit("sequences")]),
            w.HBox([c["seq_len"], unit("tokens per sequence")]),
            self.status, self.summary, self.memory, self.comparison,
        ])
        self.widget.add_class("nbtrain-explorer")  # the static plan above steps aside while this is on the page
        for name, part in (*c.items(), ("status", self.status), ("summary", self.summary),
                           ("memory_bars", self.memory), ("comparison", self.comparison)):
            part.add_class(f"nbtrain-{name.replace('_', '-')}")  # a page (or a test in a browser) can find each
        self._per_node, self._following = devices_per_node, False
        for control in c.values():
            control.observe(self._changed, names="value")
        if opening is not None:
            self._show(*opening, took=None)
        else:
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
        typed = any(change["owner"] is self.controls[name] for name in self.TYPED)
        if typed and self.debounce_s > 0:
            self._later()
        else:
            self._cancel()
            self.update()

    def _later(self) -> None:
        """Replan ``debounce_s`` after the last keystroke: "24GiB" typed is one plan, not five."""
        self._cancel()
        self.status.value = "<i>waiting for typing to pause…</i>"
        self._timer = threading.Timer(self.debounce_s, self.update)
        self._timer.daemon = True
        self._timer.start()

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def settle(self):
        """Wait for a pending (debounced) replan and the search it leaves in the background, and return the plan,
        as :meth:`update` does."""
        timer = self._timer
        if timer is not None:
            timer.join()
        searching = self._searching
        if searching is not None:
            searching.join()
        with self._planning:
            return self.plan

    def _replan(self, search_seconds: float | None = None, progress=None):
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
        best = recommend.plan(self.profile, cluster, **args, search_seconds=search_seconds, progress=progress)
        return best, recommend.baselines(self.profile, cluster, **args), cluster

    def update(self):
        """Plan again for the controls' current values; returns the plan, or None (and sets ``error``)."""
        from nbtrain.planner.recommend import provisional

        with self._planning:
            self._timer = None
            self._generation += 1
            self.status.value = "<i>planning…</i>"
            started = time.perf_counter()
            try:
                best, baselines, cluster = self._replan(self.search_seconds)
            except Exception as e:  # a widget callback has nowhere to raise to: show it where the plan would be
                self._show_error(e)
                return None
            searching_on = provisional(best)
            self._show(best, baselines, cluster, took=time.perf_counter() - started, searching_on=searching_on)
            if searching_on:
                self._search_on(self._generation, started)
            return best

    def _search_on(self, generation: int, started: float) -> None:
        """Finish the search in a thread and show its plan, unless the controls change first: then it stops at
        its next sub-problem, and a newer replan shows its own."""

        def superseded(_progress) -> None:
            if self._generation != generation:
                raise _Superseded

        def search() -> None:
            try:
                found = self._replan(None, progress=superseded)
            except _Superseded:
                return
            except Exception as e:  # shown as update() shows it, if still current
                found = e
            with self._planning:
                if self._generation != generation:
                    return
                if isinstance(found, Exception):
                    self._show_error(found)
                else:
                    self._show(*found, took=time.perf_counter() - started)

        self._searching = threading.Thread(target=search, name="nbtrain-explorer-search", daemon=True)
        self._searching.start()

    def _show_error(self, e: Exception) -> None:
        message = str(e) if isinstance(e, NbtrainError) else f"unexpected {type(e).__name__}: {e}"
        self.plan, self.baselines, self.error = None, [], message
        self.status.value = f'<div style="color:#b00020"><b>cannot plan:</b> {html.escape(message)}</div>'
        self.summary.value = self.memory.value = self.comparison.value = ""

    def _show(self, best, baselines, cluster, *, took: float | None, searching_on: bool = False) -> None:
        self.plan, self.baselines, self.error = best, baselines, None
        self.status.value = f"<div>{html.escape(_status(best, cluster, took, searching_on))}</div>"
        self.summary.value = styled(f"<div><b>{html.escape(best.summary())}</b></div>{best.table()._repr_html_()}")
        self.memory.value = styled(memory_bars_html(best))
        self.comparison.value = styled(step_time_chart_html(best, baselines))

    def __repr__(self) -> str:
        shown = self.plan.summary() if self.plan is not None else f"error: {self.error}"
        return f"PlanExplorer({self.profile.model}; {shown})"

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)

    def _repr_mimebundle_(self, include=None, exclude=None, **kwargs):
        return self.widget._repr_mimebundle_(include=include, exclude=exclude, **kwargs)


class _Superseded(Exception):
    """A search in the background whose controls have changed since it began."""


def _status(plan, cluster, took: float | None, searching_on: bool = False) -> str:
    """The cluster and the budget in force, e.g. "8 × H100 in 1 node · memory budget 1.50 GiB per device (the
    device has 80.00 GiB) · planned in 1.2 s" (or "best found so far in 3.0 s, searching on…")."""
    nodes = f"{cluster.num_nodes} node" + ("s" if cluster.num_nodes > 1 else "")
    budget = plan.predicted.budget_bytes
    own = ("the device's own" if budget >= cluster.device_memory
           else f"the device has {format_bytes(cluster.device_memory)}")
    when = f"planned in {format_seconds(took)}" if took is not None else "the cell's plan"
    if searching_on:
        when = f"best found so far in {format_seconds(took)}, searching on…"
    return (f"{cluster.num_devices} × {cluster.device} in {nodes} · memory budget {format_bytes(budget)} per device "
            f"({own}) · {when}")


def explore(profile, **kwargs) -> PlanExplorer | None:
    """A :class:`PlanExplorer` in a Jupyter kernel; None elsewhere (CI, papermill, scripts), where no widget is made.

        >>> explore(nbtrain.profile("gpt2", batch_size=1, seq_len=1024), num_devices=16, memory="40GiB")
    """
    return PlanExplorer(profile, **kwargs) if interactive() else None
