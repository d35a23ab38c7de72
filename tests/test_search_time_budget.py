"""A search in a time budget: the best plan found so far, said to be that; a progress line on a terminal; a preset's
profile kept for the next ``nbtrain plan`` (issue 46).

    .venv/bin/python -m pytest -q tests/test_search_time_budget.py        # ~20 s
"""

from __future__ import annotations

import io
import json
import time

import pytest

import nbtrain
from nbtrain.cli import ProgressLine, main
from nbtrain.planner import cost_tables
from nbtrain.planner.anytime import PROVISIONAL, Progress
from nbtrain.planner.recommend import plan, provisional
from nbtrain.planner.search import search
from nbtrain.profiler import profile_cache
from nbtrain.profiler.hardware import Cluster

from tests.plan_cases import profiles, recorded_from

GPT2 = profiles(recorded_from())["gpt2"]


@pytest.fixture(autouse=True)
def fresh_tables():
    cost_tables.forget()  # a search remembered from another test would finish in no time
    yield
    cost_tables.forget()


def test_a_search_past_its_deadline_returns_the_first_plan_it_found_marked_incomplete():
    cluster = Cluster.from_catalog("H100", num_devices=4)
    seen: list[Progress] = []
    found = search(GPT2, cluster, global_batch=32, memory=3 * 2**30, deadline=time.monotonic(), progress=seen.append)
    assert len(found) == 1 and not found.complete and found.left > 0
    assert found[0].predicted.fits
    assert seen and seen[-1].best_s == found[0].predicted.step_time_s  # it stopped at its first plan
    assert all(p.best_s is None for p in seen[:-1]) and [p.solved for p in seen] == list(range(1, len(seen) + 1))
    assert str(seen[-1]).startswith(f"searching: {len(seen)} of {seen[-1].tasks} sub-problems solved")
    whole = search(GPT2, cluster, global_batch=32, memory=3 * 2**30)
    assert whole.complete and whole.left == 0
    assert whole[0].predicted.step_time_s <= found[0].predicted.step_time_s


def test_a_recommendation_cut_short_says_so_first_and_one_in_time_does_not():
    cluster = Cluster.from_catalog("H100", num_devices=4)
    rushed = plan(GPT2, cluster, global_batch=32, memory="3GiB", search_seconds=1e-9)
    assert provisional(rushed) and rushed.notes[0].startswith(f"{PROVISIONAL}: the search stopped at its")
    assert "sub-problems left; a faster plan may exist" in rushed.notes[0]
    calm = plan(GPT2, cluster, global_batch=32, memory="3GiB", search_seconds=600)
    assert not provisional(calm) and calm == plan(GPT2, cluster, global_batch=32, memory="3GiB")


def test_the_command_takes_a_search_budget_and_says_when_it_ran_out(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("NBTRAIN_CACHE_DIR", str(tmp_path))
    args = ["plan", "gpt2", "--gpus", "4", "--gpu", "H100", "--memory", "3GiB", "--batch", "32", "--seq", "1024"]
    assert main([*args, "--search-seconds", "0.000001"]) == 0
    out, err = capsys.readouterr()
    assert f"note: {PROVISIONAL}: the search stopped at its" in out and err == ""  # no terminal: no progress line
    assert main([*args, "--search-seconds", "600", "--json"]) == 0
    assert not any(n.startswith(PROVISIONAL) for n in json.loads(capsys.readouterr().out)["notes"])


def test_the_command_refuses_a_budget_that_is_not_a_positive_number(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "gpt-tiny", "--gpus", "2", "--batch", "8", "--search-seconds", "soon"])
    assert "--search-seconds: 'soon' is not a number" in capsys.readouterr().err


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_progress_line_shows_on_a_terminal_after_a_second_and_is_cleared_at_the_end():
    screen = Terminal()
    line = ProgressLine(screen, after_s=1.0)
    line(Progress(1, 0, 91, None, 0.4))
    assert screen.getvalue() == ""  # a quick search shows nothing
    line(Progress(4, 60, 91, 6.79, 1.2))
    assert screen.getvalue() == "\rsearching: 4 of 91 sub-problems solved, 60 ruled out by their bounds · best 6.79 s/step · " \
        "1.20 s\033[K"
    line.close()
    assert screen.getvalue().endswith("\r\033[K")
    piped = io.StringIO()
    ProgressLine(piped)(Progress(4, 60, 91, 6.79, 5.0))
    assert piped.getvalue() == ""


def test_a_presets_profile_is_kept_for_the_next_plan_and_a_users_model_is_not(tmp_path, monkeypatch):
    import nbtrain.profiler.model as profiler

    monkeypatch.setenv("NBTRAIN_CACHE_DIR", str(tmp_path))
    first = profile_cache.preset_profile("gpt-tiny", seq_len=64)
    assert len(list((tmp_path / "profiles").iterdir())) == 1
    calls = []
    monkeypatch.setattr(profiler, "profile", lambda *a, **k: calls.append(a) or first)
    again = profile_cache.preset_profile("gpt-tiny", seq_len=64)
    assert calls == [] and again.to_json() == first.to_json()
    cluster = Cluster.from_catalog("H100", num_devices=2)
    assert nbtrain.plan(again, cluster, global_batch=8) == nbtrain.plan(first, cluster, global_batch=8)
    profile_cache.preset_profile("gpt-tiny", seq_len=128)  # other arguments: profiled, kept beside
    profile_cache.preset_profile("mypkg.models:build", seq_len=64)  # the user's code, which may change
    profile_cache.preset_profile("mypkg.models:build", seq_len=64)
    assert len(calls) == 3 and len(list((tmp_path / "profiles").iterdir())) == 2
