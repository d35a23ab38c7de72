"""The suite runs in two workers (the README's ``-n 2``): a test marked ``alone``, whose assertions rest on this
machine's pace, runs with no test of the other worker beside it (tests/conftest.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

NOTE = '''
import time
import pytest

def note(what):
    with open({log!r}, "a") as log:
        log.write(f"{{time.monotonic()}} {{what}}\\n")
'''

TIMED = NOTE + '''
@pytest.mark.alone
def test_timed():
    note("alone starts")
    time.sleep(1.0)
    note("alone ends")
'''

BESIDE = NOTE + '''
@pytest.mark.parametrize("i", range(12))
def test_other(i):
    note(f"other {{i}} starts")
    time.sleep(0.2)
    note(f"other {{i}} ends")
'''


def test_a_test_marked_alone_runs_while_the_other_worker_runs_nothing(tmp_path):
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    alone: runs with no other test beside it\n")
    log = tmp_path / "log"
    (tmp_path / "test_timed.py").write_text(TIMED.format(log=str(log)))
    (tmp_path / "test_beside.py").write_text(BESIDE.format(log=str(log)))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile", "-p",
                           "no:cacheprovider"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    events = sorted((float(t), what) for t, what in (line.split(" ", 1) for line in log.read_text().splitlines()))
    start = next(t for t, what in events if what == "alone starts")
    end = next(t for t, what in events if what == "alone ends")
    others = {what.split()[1]: [] for _, what in events if what.startswith("other")}
    for t, what in events:
        if what.startswith("other"):
            others[what.split()[1]].append(t)
    assert len(others) == 12 and all(len(ts) == 2 for ts in others.values())
    overlapping = [i for i, (a, b) in others.items() if a < end and b > start]
    assert not overlapping, (overlapping, events)
