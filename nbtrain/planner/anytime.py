"""A search that answers in time: where it stands (:class:`Progress`), and what it found when its time ran out
(:class:`Found`, marked incomplete)::

    found = search(profile, cluster, global_batch=2048, deadline=time.monotonic() + 3,
                   progress=lambda p: print(p, end="\\r"))
    # searching: 4 of 91 sub-problems solved, 60 ruled out by their bounds · best 6.79 s/step · 1.20 s
    found.complete, found.left       # (False, 27): the best found in 3 s, 27 sub-problems unsolved

The search visits its sub-problems best bound first, so the plans found first are the likeliest to stay; once the
deadline passes with at least one plan found it stops, and the plans it has are the best found so far, not
necessarily the best there is (``nbtrain.plan`` says so in a note: :data:`PROVISIONAL`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from nbtrain.units import format_seconds

PROVISIONAL = "best found so far"
"""How the note of a plan found by a search cut short by its time budget begins."""


@dataclass(frozen=True)
class Progress:
    """Where a search stands: a sub-problem is a pipeline degree, micro-batch count, schedule and strategy space."""

    solved: int
    """Sub-problems solved."""
    ruled_out: int
    """Sub-problems a bound showed cannot beat the plans found (not solved, nothing lost)."""
    tasks: int
    """Sub-problems in all."""
    best_s: float | None
    """The fastest step found so far, in seconds (None before the first plan)."""
    elapsed_s: float
    """Seconds since the search began."""

    def __str__(self) -> str:
        best = f" · best {format_seconds(self.best_s)}/step" if self.best_s is not None else ""
        return (f"searching: {self.solved} of {self.tasks} sub-problems solved, {self.ruled_out} ruled out by their "
                f"bounds{best} · {format_seconds(self.elapsed_s)}")


class Found(list):
    """The plans a search found, best first (a list), and whether it finished."""

    complete: bool = True
    """False when its deadline passed first: the plans are the best found so far."""
    left: int = 0
    """Sub-problems neither solved nor ruled out when it stopped."""
    elapsed_s: float = 0.0
    """Seconds it took."""


class Clock:
    """A search's start and deadline (``time.monotonic()`` seconds; None: none), and its progress reports."""

    def __init__(self, deadline: float | None = None, progress=None):
        self.started, self.deadline, self.progress = time.monotonic(), deadline, progress

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def out_of_time(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def report(self, solved: int, ruled_out: int, tasks: int, best_s: float | None) -> None:
        if self.progress is not None:
            self.progress(Progress(solved, ruled_out, tasks, best_s, self.elapsed()))


def provisional_note(found: Found, seconds: float | None) -> str:
    """The note of a recommendation made from ``found`` when its search was cut short ("" when it was not)."""
    if found.complete:
        return ""
    budget = f"its {format_seconds(seconds)} budget" if seconds is not None else "its deadline"
    return (f"{PROVISIONAL}: the search stopped at {budget} (--search-seconds) with {found.left} sub-problems "
            "left; a faster plan may exist")
