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
    explorer.controls["memory"].value = "512MiB"
    assert explorer.plan is None
    # the plan's own need beside the reserve, then the total the budget must hold: more than 512 MiB
    need = re.search(r"(\d+(?:\.\d+)? [KMGT]iB) per device in all", explorer.error) or \
        re.search(r"needs (\d+(?:\.\d+)? [KMGT]iB) per device", explorer.error)
    assert need and parse_bytes(need.group(1).replace(" ", "")) > parse_bytes("512MiB"), explorer.error
    assert html.escape(explorer.error) in shown(explorer.widget)

    explorer.controls["memory"].value = ""  # the device's own memory again
    assert explorer.plan is not None and explorer.error is None
    assert "cannot plan" not in shown(explorer.widget)


@pytest.mark.parametrize("control, value, says", [
    ("memory", "lots", "cannot read 'lots' as a size"),
    ("devices_per_node", 4, "do not fill nodes of 4"),
    ("global_batch", 0, "global batch must be a positive integer"),
    ("seq_len", 0, "sequence length must be at least 1"),
])
def test_an_impossible_setting_shows_the_error_in_place_of_the_plan(explorer, control, value, says):
    explorer.controls[control].value = value
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
    explorer.controls["global_batch"].value = 16
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
