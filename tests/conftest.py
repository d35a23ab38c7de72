"""Fixtures every test file may take by name."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def shell():
    """IPython's own shell, what a kernel runs, with ``%load_ext nbtrain`` done: cells run as in a notebook."""
    from IPython.core.interactiveshell import InteractiveShell

    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "nbtrain")
    return ip
