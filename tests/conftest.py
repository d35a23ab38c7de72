"""Fixtures every test file may take by name."""

from __future__ import annotations

import os
import tempfile

import pytest


def pytest_configure(config):
    """This machine's measured communication (nbtrain.profiler.collectives) is cached in a folder of this test
    session: a run never reads or writes the user's ~/.cache/nbtrain, and measures once (subprocesses inherit it)."""
    os.environ.setdefault("NBTRAIN_CACHE_DIR", tempfile.mkdtemp(prefix="nbtrain-test-cache-"))
    # A run far from its prediction says so and, outside tests, measures the links again (20-40 s a process count);
    # tests/test_prediction_check.py turns that on where it is what the test checks
    os.environ.setdefault("NBTRAIN_REMEASURE", "0")


@pytest.fixture(scope="session")
def shell():
    """IPython's own shell, what a kernel runs, with ``%load_ext nbtrain`` done: cells run as in a notebook."""
    from IPython.core.interactiveshell import InteractiveShell

    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "nbtrain")
    return ip
