"""Pipeline stage boundaries, exactly: the partition of the layers into ``pp`` contiguous stages that minimises
``Σᵢ Tᵢ + (m − 1)·maxᵢ Tᵢ`` (GPipe's step, Huang et al. 2019), given every stage's best time over every range.

    >>> T = np.full((2, 4, 4), np.inf); T[0, 0, 1:3] = (1.0, 2.0); T[1, 1:3, 3] = (3.0, 1.0)
    >>> best_partition(T, microbatches=4)
    (9.0, [(0, 2), (2, 3)])

``T[i, a, e]`` is stage ``i``'s best time over layers ``[a, e)`` (``inf``: it cannot hold them). The largest stage
time ``τ`` is fixed at every value it can take and the least sum of stage times with every stage at most ``τ`` found
for all of them at once (vectorised), a block of ``τ`` at a time; the first ``τ`` of the least step wins, and the
boundaries are those of the least sum at that ``τ`` (of equal sums, the earliest boundary).

The same arrays give bounds on what a partition can reach from lower bounds of the stage times
(:func:`partition_bounds`): with them the search prunes ranges and whole sub-problems before pricing them.
"""

from __future__ import annotations

import numpy as np

TAUS_AT_ONCE = 512
"""Values of the largest stage time solved together: (layers + 1)² × this many floats per stage at a time."""


def best_partition(T: np.ndarray, microbatches: int, tau_limit: float = np.inf
                   ) -> tuple[float, list[tuple[int, int]]] | None:
    """(the least step, the stages' layer ranges), or None when no partition has every stage finite.

    ``tau_limit``: no largest stage time above it can be the optimum's (a partition whose step is above a known
    one's), so those values are not tried; the answer is the same."""
    pp, n = T.shape[0], T.shape[1] - 1
    windows = [_window(T[i]) for i in range(pp)]
    if any(w is None for w in windows) or windows[0][0].start != 0 or windows[-1][1].stop != n + 1:
        return None
    taus = np.unique(T[np.isfinite(T)])
    taus = taus[taus <= tau_limit]
    best_value, best_tau = np.inf, None
    for start in range(0, len(taus), TAUS_AT_ONCE):
        chunk = taus[start:start + TAUS_AT_ONCE]
        rows, cols = windows[0]
        best = np.full((n + 1, len(chunk)), np.inf)  # least sum of the stages so far, by where they end
        stage = T[0, 0, cols, None]
        best[cols] = np.where(stage <= chunk[None, :], stage, np.inf)
        for i in range(1, pp):
            rows, cols = windows[i]
            stage = T[i, rows, cols, None]  # (a, e, τ)
            total = best[rows, None, :] + np.where(stage <= chunk[None, None, :], stage, np.inf)
            best = np.full((n + 1, len(chunk)), np.inf)
            best[cols] = np.min(total, axis=0)
        objective = best[n] + (microbatches - 1) * chunk
        j = int(np.argmin(objective))
        if objective[j] < best_value:
            best_value, best_tau = float(objective[j]), chunk[j]
    if best_tau is None:
        return None
    return best_value, _boundaries(T, best_tau, windows)


def _window(stage: np.ndarray) -> tuple[slice, slice] | None:
    """The rows (first layers) and columns (ends) between which a stage's times are finite, or None."""
    finite = np.isfinite(stage)
    rows, cols = np.flatnonzero(finite.any(axis=1)), np.flatnonzero(finite.any(axis=0))
    if len(rows) == 0:
        return None
    return slice(rows[0], rows[-1] + 1), slice(cols[0], cols[-1] + 1)


def _boundaries(T: np.ndarray, tau: float, windows: list) -> list[tuple[int, int]]:
    """The stages' ranges of the least sum of stage times with every stage at most ``tau``: at each stage's end,
    the first start of the least sum."""
    pp, n = T.shape[0], T.shape[1] - 1
    best = np.where(T[0, 0, :] <= tau, T[0, 0, :], np.inf)
    choice = []
    for i in range(1, pp):
        rows, cols = windows[i]
        total = best[rows, None] + np.where(T[i, rows, cols] <= tau, T[i, rows, cols], np.inf)  # (a, e)
        first = np.full(n + 1, -1)
        first[cols] = rows.start + np.argmin(total, axis=0)
        choice.append(first)
        best = np.full(n + 1, np.inf)
        best[cols] = np.min(total, axis=0)
    bounds = [n]
    for i in range(pp - 1, 0, -1):
        bounds.append(int(choice[i - 1][bounds[-1]]))
    bounds.append(0)
    return list(zip(bounds[::-1][:-1], bounds[::-1][1:]))


def partition_bounds(low: np.ndarray, microbatches: int) -> tuple[float, np.ndarray, list[tuple[int, int]] | None]:
    """From ``low[i, a, e]`` ≤ stage ``i``'s best time over ``[a, e)``: (a lower bound on every partition's step,
    a lower bound on the step of any partition that gives stage ``i`` the range ``[a, e)``, for each ``(i, a, e)``,
    and the ranges of the partition with the least largest stage, a good one to price first).

    A step is ``Σ Tᵢ + (m − 1)·max Tᵢ``; the sum is at least the least sum of ``low`` through the range (the best
    stages before it, the range, the best after it) and the largest stage at least the range's own and at least
    the least largest stage of any partition."""
    pp, n = low.shape[0], low.shape[1] - 1
    ahead = np.full((pp, n + 1), np.inf)  # least Σ low of stages 0..i-1 over [0, a)
    ahead[0, 0] = 0.0
    for i in range(1, pp):
        ahead[i] = np.min(ahead[i - 1][:, None] + low[i - 1], axis=0)
    behind = np.full((pp, n + 1), np.inf)  # least Σ low of stages i+1..pp-1 over [e, n)
    behind[pp - 1, n] = 0.0
    for i in range(pp - 2, -1, -1):
        behind[i] = np.min(low[i + 1] + behind[i + 1][None, :], axis=1)
    widest = np.full(n + 1, np.inf)  # least largest low of stages 0..i over [0, e)
    widest[0] = 0.0
    choice = []
    for i in range(pp):
        total = np.maximum(widest[:, None], low[i])
        choice.append(np.argmin(total, axis=0))
        widest = np.min(total, axis=0)
    smallest_max = float(widest[n])
    through = ahead[:, :, None] + low + behind[:, None, :]
    if microbatches > 1:
        through = through + (microbatches - 1) * np.maximum(low, smallest_max)
    overall = max(float(np.min(through[i])) for i in range(pp))  # every partition gives each stage a range
    ranges = None
    if np.isfinite(smallest_max):
        bounds = [n]
        for i in range(pp - 1, 0, -1):
            bounds.append(int(choice[i][bounds[-1]]))
        bounds.append(0)
        ranges = list(zip(bounds[::-1][:-1], bounds[::-1][1:]))
    return overall, through, ranges
