"""Fixtures every test file may take by name."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
import uuid

import pytest


def pytest_configure(config):
    """This machine's measured communication (nbtrain.profiler.collectives) is cached in a folder of this test
    session: a run never reads or writes the user's ~/.cache/nbtrain, and measures once (subprocesses inherit it)."""
    if "NBTRAIN_CACHE_DIR" not in os.environ:  # else a run that started this one made it, and removes it
        os.environ["NBTRAIN_CACHE_DIR"] = config.made_cache_dir = tempfile.mkdtemp(prefix="nbtrain-test-cache-")
    if config.pluginmanager.hasplugin("xdist") and not hasattr(config, "workerinput") \
            and config.getoption("testrunuid", None) is None:  # the run's id, which names its locks (_the_cores)
        config.option.testrunuid = uuid.uuid4().hex
    # A run far from its prediction says so and, outside tests, measures the links again (20-40 s a process count);
    # tests/test_prediction_check.py turns that on where it is what the test checks
    os.environ.setdefault("NBTRAIN_REMEASURE", "0")


def pytest_unconfigure(config):
    """What the run made in the temporary folder goes with it (the workers' locks once they have stopped)."""
    if hasattr(config, "workerinput"):
        return
    if getattr(config, "made_cache_dir", None):
        shutil.rmtree(config.made_cache_dir, ignore_errors=True)
    if config.pluginmanager.hasplugin("xdist") and config.getoption("testrunuid", None):
        shutil.rmtree(_locks_folder(config.getoption("testrunuid")), ignore_errors=True)


def _locks_folder(run: str) -> str:
    """This run's locks: a pytest that a test starts (the README's command, as a documented example) has its own."""
    return os.path.join(tempfile.gettempdir(), f"nbtrain-test-locks-{run}")


@contextlib.contextmanager
def _the_cores(config, alone: bool):
    """Held while a test runs in one of the suite's workers: shared by the tests of both workers, or the test's
    alone (marker ``alone``: what it asserts rests on the machine's pace, a step's measured time or a page's redraw,
    which the other worker's test would slow down). A test waiting to run alone holds the gate, so the other worker
    starts nothing new meanwhile and the wait ends with the test running there now."""
    run = getattr(config, "workerinput", {}).get("testrunuid")  # a worker of the README's `-n 2` run
    if run is None:
        yield
        return
    folder = _locks_folder(run)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "gate"), "a") as gate, open(os.path.join(folder, "cores"), "a") as cores:
        fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(cores, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(gate, fcntl.LOCK_UN)
        yield  # closing the files lets both go


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test, with the fixtures its setup and teardown start and end (a module's, a session's), holds the cores
    shared, or alone where it or its module is marked ``alone`` (the browser's module times the redraw in a
    module-scoped fixture, set up with its first test)."""
    with _the_cores(item.config, alone=item.get_closest_marker("alone") is not None):
        yield


@pytest.fixture(scope="session")
def shell():
    """IPython's own shell, what a kernel runs, with ``%load_ext nbtrain`` done: cells run as in a notebook."""
    from IPython.core.interactiveshell import InteractiveShell

    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "nbtrain")
    return ip
