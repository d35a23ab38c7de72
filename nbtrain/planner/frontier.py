"""Exact dynamic programming over the layers of one pipeline stage (Galvatron-BMW's recurrence, without a grid).

Galvatron computes ``f[i][v][s] = min_s' f[i−1][v − m_i(s)][s'] + switch(s'→s) + t_i(s)`` over a memory grid. Here
the memory axis is not discretised: after each layer we keep, for every (layout of the last layer, largest
transient so far), the Pareto set of (resident memory, time) of partial plans. A partial plan is dropped only
when another one with the same last layout is at least as good in time, resident memory and transient peak — so
the optimum under the cost model survives exactly, and no plan over the budget is ever kept.

The numbers come in as arrays over the strategy space ``j``: ``resident[j]`` (bytes with the stage's micro-batches
in flight), ``transient[j]``, ``time[j]`` (seconds per micro-batch), ``layout[j]`` (index of its (dp, tp) layout)
and a ``relayout[c_prev, c]`` matrix of seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Frontier:
    """Partial plans after some layers: flat arrays, one entry per kept partial plan."""

    memory: np.ndarray
    """Resident bytes so far."""
    transient: np.ndarray
    """Largest transient bytes of the layers so far."""
    time: np.ndarray
    """Seconds per micro-batch so far."""
    layout: np.ndarray
    """Layout index of the last layer's strategy."""
    strategy: np.ndarray
    """Strategy index chosen for the last layer."""
    parent: np.ndarray
    """Index of the partial plan this one extends, in ``previous``."""
    previous: "Frontier | None"

    @classmethod
    def start(cls) -> "Frontier":
        empty = np.zeros(1)
        return cls(empty, empty.copy(), empty.copy(), np.full(1, -1), np.full(1, -1), np.full(1, -1), None)

    def __len__(self) -> int:
        return len(self.time)

    def extend(self, resident, transient, time, layout, relayout, budget: float, grid: float = 0.0,
               ids: np.ndarray | None = None) -> "Frontier":
        """Add one layer: every kept partial plan × every strategy, then drop the dominated and the over-budget.

        With ``grid > 0`` and more than :data:`EXACT_LIMIT` partial plans, plans of one layout and transient whose
        resident memory falls in the same ``grid``-byte cell are merged, keeping the fastest with its true memory:
        never over the budget, and within one cell of memory of the exact optimum.
        """
        n, s = len(self), len(time)
        mem = (self.memory[:, None] + resident[None, :]).ravel()
        peak = np.maximum(self.transient[:, None], transient[None, :]).ravel()
        switch = relayout[self.layout][:, layout] if self.previous is not None else np.zeros((n, s))
        t = (self.time[:, None] + time[None, :] + switch).ravel()
        lay = np.broadcast_to(layout[None, :], (n, s)).ravel()
        ids = np.arange(s) if ids is None else ids  # the strategy index recorded for each column
        strat = np.broadcast_to(ids[None, :], (n, s)).ravel()
        parent = np.broadcast_to(np.arange(n)[:, None], (n, s)).ravel()
        ok = mem + peak <= budget
        idx = np.flatnonzero(ok)
        if grid > 0 and len(idx) > EXACT_LIMIT:
            idx = idx[_fastest_per_cell(mem[idx], peak[idx], t[idx], lay[idx], grid)]
        idx = idx[_non_dominated(mem[idx], peak[idx], t[idx], lay[idx])]
        return Frontier(mem[idx], peak[idx], t[idx], lay[idx], strat[idx], parent[idx], self)

    def strategies(self, index: int) -> list[int]:
        """The strategy index of every layer of the partial plan ``index``, first layer first."""
        chosen, node = [], self
        while node.previous is not None:
            chosen.append(int(node.strategy[index]))
            index = int(node.parent[index])
            node = node.previous
        return chosen[::-1]


EXACT_LIMIT = 4096
"""Up to this many candidate partial plans per layer the frontier is exact; beyond it the memory grid applies."""


def _fastest_per_cell(mem, peak, t, lay, grid: float) -> np.ndarray:
    """Index of the fastest point in each (layout, transient, memory // grid) cell."""
    _, peak_id = np.unique(peak, return_inverse=True)
    cells = np.floor(mem / grid).astype(np.int64)
    key = (lay.astype(np.int64) * (peak_id.max() + 1) + peak_id) * (cells.max() + 1) + cells
    best = np.full(int(key.max()) + 1, np.inf)
    np.minimum.at(best, key, t)
    winners = np.flatnonzero(t == best[key])
    _, first = np.unique(key[winners], return_index=True)  # one per cell when times tie
    return winners[first]


def _non_dominated(mem: np.ndarray, peak: np.ndarray, t: np.ndarray, lay: np.ndarray) -> np.ndarray:
    """Indices of the points no other point with the same layout beats in memory, transient and time.

    For one layout, process points by increasing transient, then memory, then time; a point survives if no earlier
    point (transient and memory not larger) has a time not larger. Equal points keep the first.
    """
    if len(t) == 0:
        return np.zeros(0, dtype=int)
    order = np.lexsort((t, mem, peak, lay))
    keep = []
    lay_sorted = lay[order]
    bounds = np.flatnonzero(np.diff(lay_sorted)) + 1
    for group in np.split(order, bounds):
        # 2D Pareto staircase of (memory → best time) built from points of smaller transient first
        stair_mem = np.zeros(0)
        stair_time = np.zeros(0)
        gp = peak[group]
        for sub in np.split(group, np.flatnonzero(np.diff(gp)) + 1):
            m, tt = mem[sub], t[sub]
            if len(stair_mem):
                pos = np.searchsorted(stair_mem, m, side="right") - 1
                best = np.where(pos >= 0, stair_time[np.maximum(pos, 0)], np.inf)
                alive = tt < best
                sub, m, tt = sub[alive], m[alive], tt[alive]
            if len(sub) == 0:
                continue
            # within the sub-group (sorted by memory, then time): strictly improving times only
            running = np.minimum.accumulate(tt)
            first = np.ones(len(tt), dtype=bool)
            first[1:] = tt[1:] < running[:-1]
            sub, m, tt = sub[first], m[first], tt[first]
            keep.append(sub)
            stair_mem, stair_time = _merge_staircase(stair_mem, stair_time, m, tt)
    return np.concatenate(keep) if keep else np.zeros(0, dtype=int)


def _merge_staircase(m1, t1, m2, t2):
    """The Pareto staircase (memory ascending, time strictly descending) of two staircases together."""
    m = np.concatenate([m1, m2])
    t = np.concatenate([t1, t2])
    order = np.lexsort((t, m))
    m, t = m[order], t[order]
    running = np.minimum.accumulate(t)
    first = np.ones(len(t), dtype=bool)
    first[1:] = t[1:] < running[:-1]
    return m[first], t[first]
