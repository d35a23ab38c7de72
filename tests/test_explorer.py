"""The plan explorer: its controls replan, impossible settings show why instead of raising, and it stays away
from CI and papermill. Widgets are built and their values set without a kernel, as a notebook front end would.

    .venv/bin/python -m pytest -q tests/test_explorer.py       # ~6 s: profiles gpt-tiny, plans on 1-2 devices
"""

from __future__ import annotations

import html
import re
from types import SimpleNamespace

import IPython
import pytest

import nbtrain
from nbtrain.notebook import widgets
from nbtrain.notebook.widgets import PlanExplorer, explore, interactive
from nbtrain.planner import recommend
from nbtrain.units import parse_bytes


@pytest.fixture(scope="module")
def prof():
    return nbtrain.profile("gpt-tiny", batch_size=1, seq_len=64)


@pytest.fixture
def explorer(prof):
    return PlanExplorer(prof, num_devices=1, device="H100", global_batch=8, seq_len=64)


def set_control(explorer, name, value):
    """What a person does: set a control, and wait for the explorer to replan (a typed box waits for typing to
    pause, a list replans at once)."""
    explorer.controls[name].value = value
    return explorer.settle()


def shown(widget) -> str:
    """All the HTML a user sees in ``widget`` and the widgets inside it."""
    own = widget.value if type(widget).__name__ == "HTML" else ""
    return own + "".join(shown(child) for child in getattr(widget, "children", ()))


def test_changing_the_device_count_replans_and_shows_the_new_plan(prof, explorer):
    assert explorer.plan.num_devices == 1 and explorer.error is None
    explorer.controls["devices"].value = 2
    assert explorer.plan.num_devices == 2
    page = shown(explorer.widget)
    assert html.escape(explorer.plan.summary()) in page
    assert "DDP" in page and "FSDP" in page  # the baseline comparison follows too
    # what the explorer recommends is what nbtrain.plan recommends for the same cluster
    cluster = nbtrain.Cluster.from_catalog("H100", num_devices=2, devices_per_node=2)  # per node followed
    assert explorer.plan == nbtrain.plan(prof, cluster, global_batch=8, seq_len=64)


def test_memory_too_small_for_any_plan_names_the_memory_needed_and_does_not_raise(explorer):
    assert set_control(explorer, "memory", "512MiB") is None
    # the plan's own need beside the reserve, then the total the budget must hold: more than 512 MiB
    need = re.search(r"(\d+(?:\.\d+)? [KMGT]iB) per device in all", explorer.error) or \
        re.search(r"needs (\d+(?:\.\d+)? [KMGT]iB) per device", explorer.error)
    assert need and parse_bytes(need.group(1).replace(" ", "")) > parse_bytes("512MiB"), explorer.error
    assert html.escape(explorer.error) in shown(explorer.widget)

    assert set_control(explorer, "memory", "") is not None  # the device's own memory again
    assert explorer.plan is not None and explorer.error is None
    assert "cannot plan" not in shown(explorer.widget)


@pytest.mark.parametrize("control, value, says", [
    ("memory", "lots", "cannot read 'lots' as a size"),
    ("devices_per_node", 4, "do not fill nodes of 4"),
    ("global_batch", 0, "global batch must be a positive integer"),
    ("seq_len", 0, "sequence length must be at least 1"),
])
def test_an_impossible_setting_shows_the_error_in_place_of_the_plan(explorer, control, value, says):
    set_control(explorer, control, value)
    assert explorer.plan is None and says in explorer.error
    assert html.escape(explorer.error) in shown(explorer.widget)
    assert "recommended:" not in shown(explorer.widget)  # no stale plan beside the error


def test_a_planning_line_shows_while_the_planner_runs(explorer, monkeypatch):
    seen = []
    real = recommend.plan

    def watched(*args, **kwargs):
        seen.append(explorer.status.value)
        return real(*args, **kwargs)

    monkeypatch.setattr(recommend, "plan", watched)
    set_control(explorer, "global_batch", 16)
    assert len(seen) == 1 and "planning…" in seen[0]
    assert "planning…" not in explorer.status.value and explorer.plan.global_batch == 16


def test_the_explorer_displays_as_its_widget(explorer):
    bundle = explorer._repr_mimebundle_()
    assert bundle["application/vnd.jupyter.widget-view+json"]["model_id"] == explorer.widget.model_id


def test_explore_makes_no_widget_with_nbtrain_noninteractive_set(prof, monkeypatch):
    monkeypatch.setattr(IPython, "get_ipython", lambda: SimpleNamespace(kernel=object()))  # as in Jupyter
    monkeypatch.setenv("NBTRAIN_NONINTERACTIVE", "1")
    assert not interactive() and explore(prof) is None
    monkeypatch.setenv("NBTRAIN_NONINTERACTIVE", "0")  # "0" switches it off again
    assert interactive()


def test_explore_makes_no_widget_outside_a_kernel(prof, monkeypatch):
    monkeypatch.delenv("NBTRAIN_NONINTERACTIVE", raising=False)
    monkeypatch.setattr(IPython, "get_ipython", lambda: None)  # plain Python (other tests start an IPython shell)
    assert not interactive() and explore(prof) is None
    monkeypatch.setattr(IPython, "get_ipython", lambda: SimpleNamespace())  # a terminal IPython: no kernel
    assert not interactive()


def test_explore_in_a_kernel_returns_a_live_explorer(prof, monkeypatch):
    monkeypatch.delenv("NBTRAIN_NONINTERACTIVE", raising=False)
    monkeypatch.setattr(IPython, "get_ipython", lambda: SimpleNamespace(kernel=object()))
    ex = explore(prof, num_devices=1, global_batch=8)
    assert isinstance(ex, widgets.PlanExplorer) and ex.plan.num_devices == 1


def test_devices_per_node_follow_the_device_count_up_to_the_users_choice(prof):
    explorer = PlanExplorer(prof, num_devices=1, devices_per_node=8, global_batch=8, seq_len=64)
    explorer.controls["devices"].value = 2
    assert explorer.controls["devices_per_node"].value == 2  # one node of two, not two nodes of one
    assert explorer.plan.num_devices == 2
    explorer.controls["devices_per_node"].value = 1
    explorer.controls["devices"].value = 4
    assert explorer.controls["devices_per_node"].value == 1  # the user chose one per node: kept


# -- what a person sees: typing, the budget in force, the chart, one output per cell ----------------------------------

def test_typing_a_budget_replans_once_when_typing_pauses(explorer, monkeypatch):
    planned = []
    real = recommend.plan
    monkeypatch.setattr(recommend, "plan", lambda *a, **k: planned.append(k["memory"]) or real(*a, **k))
    for typed in ("4", "4G", "4Gi", "4GiB"):  # each keystroke, as the box sends it
        explorer.controls["memory"].value = typed
    assert "waiting for typing to pause" in explorer.status.value and planned == []
    assert explorer.settle().predicted.budget_bytes == 4 * 2**30
    assert planned == [4 * 2**30]  # "4" alone (refused: no unit) was never planned


def test_a_choice_from_a_list_replans_at_once(explorer):
    explorer.controls["devices"].value = 2
    assert explorer._timer is None and explorer.plan.num_devices == 2


def test_the_status_line_names_the_budget_in_force(explorer):
    assert "memory budget 80.00 GiB per device (the device's own)" in html.unescape(explorer.status.value)
    set_control(explorer, "memory", "1.5GiB")
    status = html.unescape(explorer.status.value)
    assert "memory budget 1.50 GiB per device (the device has 80.00 GiB)" in status
    assert "80.00 GiB per device" not in status


def bar_widths(html_text: str, css_class: str) -> list[float]:
    return [float(w) for w in re.findall(rf'class="{css_class}[^"]*"[^>]*style="width:([0-9.]+)%', html_text)]


def test_the_chart_draws_each_compared_plan_by_its_step_time(explorer):
    set_control(explorer, "devices", 4)
    chart = explorer.comparison.value
    times = [p.predicted.step_time_s for p in [explorer.plan, *explorer.plan.alternatives]]
    times += [b.plan.predicted.step_time_s for b in explorer.baselines if b.plan is not None]
    widths = bar_widths(chart, "nbtrain-bar")
    assert widths == pytest.approx([100 * t / max(times) for t in times], abs=0.01)  # the longest fills the track
    for b in explorer.baselines:
        if b.plan is None:  # no bar, and why, in the chart's own words and the baseline's note
            assert "cannot run on this model" in chart or "does not apply" in chart
            assert html.escape(b.note) in chart


def test_a_plan_that_does_not_fit_is_hatched_and_says_so():
    from nbtrain.notebook.plan_view import step_time_chart_html

    prof = nbtrain.profile("gpt-tiny", batch_size=1, seq_len=64)
    cluster = nbtrain.Cluster.from_catalog("H100", num_devices=1)
    fits = recommend.plan(prof, cluster, global_batch=64, seq_len=64)
    tight = 560 * 2**20  # the CUDA context's 512 MiB, its headroom and the model's few MiB do not fit
    over = recommend.plan(prof, cluster, global_batch=64, seq_len=64, strategy=str(fits), memory=tight)
    assert not over.predicted.fits
    chart = step_time_chart_html(fits, [recommend.Baseline("DDP", over)])
    assert len(bar_widths(chart, "nbtrain-bar over")) == 1 and "does not fit" in chart


def test_memory_bars_are_drawn_on_the_budgets_scale(explorer):
    plan = set_control(explorer, "memory", "2GiB")
    widths = [float(w) for w in re.findall(r"width:([0-9.]+)%;background", explorer.memory.value)]  # its parts
    stage = plan.predicted.stages[0].memory
    assert sum(widths) == pytest.approx(100 * stage.total / (2 * 2**30), abs=0.01)
    assert "the track is the budget, 2.00 GiB" in explorer.memory.value


def test_the_explorer_opens_on_a_plan_it_is_given_without_planning_again(prof, monkeypatch):
    cluster = nbtrain.Cluster.from_catalog("H100", num_devices=2, devices_per_node=2)
    best = nbtrain.plan(prof, cluster, global_batch=8, seq_len=64)
    shown_baselines = nbtrain.baselines(prof, cluster, global_batch=8, seq_len=64)
    monkeypatch.setattr(recommend, "plan", lambda *a, **k: pytest.fail("planned again"))
    ex = PlanExplorer(prof, num_devices=2, global_batch=8, seq_len=64, opening=(best, shown_baselines, cluster))
    assert ex.plan is best and "the cell's plan" in html.unescape(ex.status.value)
    assert html.escape(best.summary()) in shown(ex.widget)


def test_in_a_live_notebook_the_explorer_is_the_cells_output_and_the_static_plan_its_fallback(shell, monkeypatch):
    from IPython.utils.capture import capture_output

    monkeypatch.setattr(widgets, "interactive", lambda: True)  # as in a kernel with a page attached
    with capture_output() as out:
        assert shell.run_cell("%%autoparallel --gpus 2 --gpu H100 --batch 8 --seq 64 -o live_plan\n"
                              "import nbtrain\nmodel = nbtrain.build_preset('gpt-tiny', device='meta')").success
    assert out.stdout.startswith("recommended:") and "note:" not in out.stdout  # notes live in the plan's block
    static, explorer = out.outputs
    assert "application/vnd.jupyter.widget-view+json" in explorer.data  # the live explorer, after the static block
    page, text = static.data["text/html"], static.data["text/plain"]
    assert 'class="nbtrain-static"' in page and "re-run the cell to explore" in page
    assert "step time of the compared plans" in page  # the chart, for an exported page
    plan = shell.user_ns["live_plan"]
    assert str(plan.table()) in text  # papermill's text view keeps the tables


# -- a search past its time budget: the best so far, marked, then the best ----------------------------------------------

@pytest.fixture
def gated(monkeypatch):
    """Holds every search without a time budget (the explorer's search in the background) until ``.set()``."""
    import threading

    release = threading.Event()
    real = recommend.plan

    def plan(*args, **kwargs):
        if kwargs.get("search_seconds", 0) is None:
            assert release.wait(60), "the test never released the background search"
        return real(*args, **kwargs)

    monkeypatch.setattr(recommend, "plan", plan)
    yield release
    release.set()


def test_a_replan_past_its_search_budget_shows_the_best_so_far_then_the_best(prof, gated):
    ex = PlanExplorer(prof, num_devices=4, global_batch=8, seq_len=64, search_seconds=1e-9)
    assert recommend.provisional(ex.plan)
    assert "best found so far in" in html.unescape(ex.status.value) and "searching on" in ex.status.value
    assert html.escape(ex.plan.summary()) in shown(ex.widget)  # the best so far is shown meanwhile
    gated.set()
    best = ex.settle()
    cluster = nbtrain.Cluster.from_catalog("H100", num_devices=4, devices_per_node=4)
    assert best == nbtrain.plan(prof, cluster, global_batch=8, seq_len=64) and not recommend.provisional(best)
    assert "planned in" in ex.status.value and "searching on" not in ex.status.value
    assert html.escape(best.summary()) in shown(ex.widget)


def test_a_change_while_it_searches_on_stops_that_search_and_shows_the_new_plan(prof, gated):
    ex = PlanExplorer(prof, num_devices=4, global_batch=8, seq_len=64, search_seconds=1e-9)
    stale = ex._searching
    ex.controls["devices"].value = 2  # a new replan, past its budget too: a second search in the background
    gated.set()
    stale.join(60)
    best = ex.settle()
    assert best.num_devices == 2 and ex.plan is best and not recommend.provisional(best)
    assert "2 × H100" in ex.status.value and "planned in" in ex.status.value
