"""The first ``%%autoparallel`` in a kernel on a fresh machine: planning for this machine measures it first (its
rates, once per kernel; its communication, once per machine), which takes 20-50 s here. The cell says what it
measures and about how long before it does, and ``--no-calibrate`` (or a described cluster) measures nothing.

The measurements themselves are replaced by quick stand-ins (what they return is not under test here: the cell's
words and whether they run are); the kernel's calibration and the link cache start empty, as on a fresh machine."""

from __future__ import annotations

import pytest

from nbtrain.profiler import calibrate as calibration
from nbtrain.profiler import collectives, hardware
from nbtrain.profiler.collectives import Links

TINY = ("import nbtrain\n"
        "model = nbtrain.GPT(nbtrain.GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64, "
        "tie_embeddings=False))\n")


@pytest.fixture
def fresh_machine(monkeypatch, tmp_path):
    """No calibration in this kernel yet and no measured links on this machine; records what gets measured."""
    monkeypatch.setenv("NBTRAIN_NONINTERACTIVE", "1")
    monkeypatch.setattr(hardware, "_CALIBRATED", {})
    monkeypatch.setattr(collectives, "_REMEASURED", {})  # nor links measured again after an earlier run's miss
    monkeypatch.setenv("NBTRAIN_CACHE_DIR", str(tmp_path))
    measured = []
    real_calibrate = calibration.calibrate

    def calibrate(device="cpu", allreduce=False):
        measured.append("rates")
        return real_calibrate(device, allreduce)

    def links(world_size, **kwargs):
        measured.append("links")
        return Links.from_list({})

    monkeypatch.setattr(calibration, "calibrate", calibrate)
    monkeypatch.setattr(collectives, "measure_in_subprocess", links)
    return measured


def test_the_first_cell_says_what_it_measures_and_how_long_before_the_plan(shell, capsys, fresh_machine):
    result = shell.run_cell(f"%%autoparallel --batch 4 --seq 32 -q\n{TINY}")
    assert result.success, result.error_in_exec
    out = capsys.readouterr().out
    rates = out.index("Measuring this machine's compute, copy and CPU AdamW rates, once per kernel (~5 s)")
    links = out.index("Measuring this machine's communication among 2 processes, once per machine (~20 s; kept in")
    assert "--no-calibrate or a described cluster skips it" in out
    assert rates < links < out.index("recommended:")  # before anything else is shown
    assert fresh_machine == ["rates", "links"]


def test_no_calibrate_measures_nothing_and_says_the_predictions_are_rough(shell, capsys, fresh_machine):
    result = shell.run_cell(f"%%autoparallel --batch 4 --seq 32 -q --no-calibrate -o plan\n{TINY}")
    assert result.success, result.error_in_exec
    out = capsys.readouterr().out
    assert fresh_machine == [] and "Measuring" not in out
    assert "note: --no-calibrate: this machine was not measured" in out
    assert shell.user_ns["plan"].predicted.fits


def test_a_described_cluster_measures_nothing(shell, capsys, fresh_machine):
    result = shell.run_cell(f"%%autoparallel --gpus 8 --batch 32 -q\n{TINY}")
    assert result.success, result.error_in_exec
    assert fresh_machine == [] and "Measuring" not in capsys.readouterr().out
