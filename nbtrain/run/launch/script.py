"""The entry of ``nbtrain run train.py --plan plan.json``: each rank runs the script as ``__main__``, and the
script reads the plan it was given.

    >>> plan = current_plan()     # in a script started by `nbtrain run train.py --plan plan.json`
"""

from __future__ import annotations

import os
import sys

from nbtrain.planner.plan_file import read_plan


def run_script(path: str, argv: list[str]) -> None:
    """Run a Python file as ``__main__`` with ``sys.argv = [path, *argv]`` (what ``nbtrain run`` does per rank).

    A ``sys.exit(...)`` in the script raises ``SystemExit`` out of here, as running it with ``python`` would end it;
    :func:`launch` takes ``sys.exit(0)`` as the rank finishing and ``sys.exit(N)``, N not 0, as its failure."""
    import runpy

    saved = sys.argv
    sys.argv = [path, *argv]
    try:
        runpy.run_path(path, run_name="__main__")
    finally:
        sys.argv = saved


def current_plan():
    """The plan ``nbtrain run --plan plan.json`` was given (``NBTRAIN_PLAN``), or None."""
    path = os.environ.get("NBTRAIN_PLAN")
    return read_plan(path) if path else None
