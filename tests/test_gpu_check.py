"""bench/gpu_check.py, the check a GPU machine runs first, here with ``--device cpu``: what its user relies on is an
exit status that says whether everything passed, one markdown table with a row for every part, and the same table in
$OUT. It runs as on the GPU machine, where the notebook packages are not installed: they cannot be imported."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_check.py"
PARTS = ["1", "2", "3", "4", "5", "6"]
ABSENT = "ipywidgets,nbformat,papermill,matplotlib,IPython,ipykernel"
"""Not on the GPU machine (only torch, accelerate, transformers and their dependencies are)."""

# Runs the script with the ABSENT packages not found by any importer, as on a machine without them (a None in
# sys.modules would differ: `"IPython" in sys.modules` would be true, and accelerate reads it).
WITHOUT_PACKAGES = """
import runpy, sys
absent = set(sys.argv[1].split(","))

class Absent:
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in absent or not hasattr(self.finder, "find_spec"):
            return None
        return self.finder.find_spec(name, path, target)

    def __getattr__(self, name):
        return getattr(self.finder, name)

sys.meta_path[:] = [Absent(finder) for finder in sys.meta_path]
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_gpu_check(out: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """The script in a fresh process, as the GPU machine runs it (``PYTHONPATH=. python bench/gpu_check.py``)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NBTRAIN_NONINTERACTIVE": "1", "OUT": str(out)}
    # bounded: a hung launch fails the test instead of stalling CI (the script bounds each fit and verify itself)
    return subprocess.run([sys.executable, "-c", WITHOUT_PACKAGES, ABSENT, str(SCRIPT), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def table_rows(markdown: str) -> list[list[str]]:
    """The cells of a markdown table's rows, header and rule left out; any other line is an error."""
    lines = markdown.strip().splitlines()
    assert lines[:2] == ["| part | what | measured | predicted | ratio | status |", "|---|---|---|---|---|---|"], \
        markdown
    assert all(line.startswith("| ") and line.endswith(" |") for line in lines[2:]), markdown
    return [[cell.strip() for cell in line[2:-2].split(" | ")] for line in lines[2:]]


@pytest.mark.slow
def test_gpu_check_on_the_cpu_passes_every_part_and_writes_the_same_table_to_out(tmp_path):
    proc = run_gpu_check(tmp_path / "out", "--device", "cpu")
    report = f"stdout:\n{proc.stdout}\nstderr (end):\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, report
    rows = table_rows(proc.stdout)  # stdout is the table alone: progress and launch lines went to stderr
    assert sorted({row[0] for row in rows}) == PARTS, report
    assert [row for row in rows if row[5].startswith("FAILED")] == [], report
    assert all(row[5] == "PASS" or row[5].startswith("SKIPPED: ") for row in rows), report
    assert {row[1] for row in rows if row[0] == "3"} >= {"fit no parallelism (dp_replicate=1, fp32)",
                                                       "fit offload=0.5 (offload=0.5, fp32)"}
    assert all("tok/s" in row[2] and "MFU" in row[2] and "time" in row[4] for row in rows if row[0] == "3"), report
    assert [row[1] for row in rows if row[0] == "6"] == ["verify DDP: dp_replicate=2 (2 processes)",
                                                         "verify FSDP2: dp_shard=2 (2 processes)"]
    assert "part 5: fit matches plain loop" in proc.stderr  # progress is shown as it goes
    assert (tmp_path / "out" / "gpu_check.md").read_text() == proc.stdout
    saved = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert [[row[k] for k in ("part", "what", "measured", "predicted", "ratio", "status")] for row in saved] == \
        [[cell.replace("\\|", "|") for cell in row] for row in rows]


@pytest.fixture
def gpu_check(monkeypatch):
    """The script as a module (``main`` not called); the environment defaults its top level sets are undone after
    the test."""
    for name, value in (("NBTRAIN_NONINTERACTIVE", "1"), ("OMP_WAIT_POLICY", "PASSIVE")):
        monkeypatch.setenv(name, os.environ.get(name, value))
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", module)  # where its dataclasses look up their annotations
    spec.loader.exec_module(module)
    return module


def test_a_part_that_raises_is_one_failed_row_the_others_still_run_and_the_exit_status_is_1(gpu_check, tmp_path,
                                                                                           monkeypatch, capfd):
    def broken(setup):
        raise RuntimeError("calibration broke\nsecond line")

    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setitem(gpu_check.PARTS, "2", broken)
    assert gpu_check.main(["--device", "cpu", "--parts", "1,2"]) == 1
    rows = table_rows(capfd.readouterr().out)
    assert [row[5] for row in rows if row[0] == "2"] == ["FAILED: RuntimeError: calibration broke"]
    assert [row[1] for row in rows if row[0] == "1"] == ["torch", "CUDA", "devices", "NCCL", "date"]
    assert "FAILED: RuntimeError" in (tmp_path / "gpu_check.md").read_text()


def test_a_skipped_row_passes_only_with_its_reason(gpu_check):
    Row = gpu_check.Row
    assert Row("6", "plans", status="SKIPPED: 1 GPU present, these need 2+").ok
    assert not Row("6", "plans", status="SKIPPED").ok and not Row("6", "plans", status="SKIPPED: ").ok
    assert not Row("3", "fit", status="FAILED: CheckFailed: losses [nan]").ok
