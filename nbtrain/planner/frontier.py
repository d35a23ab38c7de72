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

from dataclasses import dataclass, field

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
    _fastest: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)

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
        never over the budget, and within one cell of memory of the exact optimum (:func:`_merged`).
        """
        s = len(time)
        ids = np.arange(s) if ids is None else ids  # the strategy index recorded for each column
        mem = self.memory[:, None] + resident[None, :]
        peak = np.maximum(self.transient[:, None], transient[None, :])
        ok = mem + peak <= budget
        if grid > 0 and np.count_nonzero(ok) > EXACT_LIMIT:
            t = self.time[:, None] + time[None, :]
            if self.previous is not None:
                t = t + relayout[self.layout][:, layout]
            ranks = np.unique(np.concatenate([self.transient, transient]))  # the transients, by rank
            peak_rank = np.maximum(np.searchsorted(ranks, self.transient).astype(np.int32)[:, None],
                                   np.searchsorted(ranks, transient).astype(np.int32)[None, :])
            keep = _merged(mem, t, layout, peak_rank, ok, len(ranks), grid, budget)
            parent, column = np.divmod(keep, s)
            return Frontier(mem.ravel()[keep], peak.ravel()[keep], t.ravel()[keep], layout[column], ids[column],
                            parent, self)
        idx = np.flatnonzero(ok)
        parent, column = np.divmod(idx, s)
        mem, peak = mem.ravel()[idx], peak.ravel()[idx]
        t = self.time[parent] + time[column]
        if self.previous is not None:
            t = t + relayout[self.layout[parent], layout[column]]
        lay = layout[column]
        keep = _non_dominated(mem, peak, t, lay)
        return Frontier(mem[keep], peak[keep], t[keep], lay[keep], ids[column[keep]], parent[keep], self)

    def fastest_by_layout(self, layouts: int) -> np.ndarray:
        """The least time of a partial plan ending in each layout (``inf`` where none does), computed once."""
        if self._fastest is None:
            fastest = np.full(layouts, np.inf)
            if self.previous is not None and len(self):
                np.minimum.at(fastest, self.layout, self.time)
            self._fastest = fastest
        return self._fastest

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


def _merged(mem, t, layout, peak_rank, ok, peaks: int, grid: float, budget: float) -> np.ndarray:
    """The flat indices of the partial plans kept of ``mem``, ``t`` (previous plan × strategy) in the grid: the
    fastest of each (layout, transient, memory cell) among those within the budget (``ok``; ties: the first), less
    any other winner of its layout with no larger transient beats: one of a lower memory cell with a time not
    larger (its memory is lower), or one of its own cell with memory and time not larger. Winners are distinct
    cells, so no two are equal, and in (layout, transient, cell) order they are in (layout, transient, memory,
    time) order: the points and order of the exhaustive rule (``_fastest_per_cell`` then :func:`_non_dominated`,
    ``tests/test_frontier.py``), with no comparison sort of the candidates.
    """
    cells = int(np.floor(budget / grid)) + 1  # a plan within the budget is in a cell below this
    shape = (int(layout.max()) + 1, peaks, cells)
    past = int(np.prod(shape))  # the key of the plans over the budget: one cell past the others, dropped
    cell = mem / grid
    np.floor(cell, out=cell)
    np.minimum(cell, cells - 1, out=cell)
    key = ((layout.astype(np.int32) * peaks)[None, :] + peak_rank) * cells  # int32: a (layout, transient) row
    key += cell.astype(np.int32)
    key[~ok] = past
    key = key.ravel()
    order = _stable_order(key, past)
    sorted_key = key[order]
    within = np.searchsorted(sorted_key, past)  # those within the budget, by cell
    order, sorted_key = order[:within], sorted_key[:within]
    sorted_t = t.ravel()[order]
    starts = np.flatnonzero(np.r_[True, sorted_key[1:] != sorted_key[:-1]])
    fastest = np.minimum.reduceat(sorted_t, starts)
    sizes = np.diff(np.r_[starts, len(order)])
    first = np.where(sorted_t == np.repeat(fastest, sizes), np.arange(len(order)), len(order))
    winners = order[np.minimum.reduceat(first, starts)]  # the first fastest of each cell, by cell
    w_lay, w_peak, w_cell = np.unravel_index(sorted_key[starts], shape)
    w_t, w_mem = fastest, mem.ravel()[winners]
    # a winner of a lower cell and no larger transient, with a time not larger
    grid_t = np.full(shape, np.inf)
    grid_t[w_lay, w_peak, w_cell] = w_t
    below = np.minimum.accumulate(np.minimum.accumulate(grid_t, axis=1), axis=2)
    below = np.concatenate([np.full(shape[:2] + (1,), np.inf), below[:, :, :-1]], axis=2)
    dominated = below[w_lay, w_peak, w_cell] <= w_t
    # a winner of the same cell and a lower transient, with memory and time not larger
    column = np.ravel_multi_index((w_lay, w_cell), (shape[0], shape[2]))
    by_column = np.lexsort((w_peak, column))
    col_sorted = column[by_column]
    heads = np.flatnonzero(np.r_[True, col_sorted[1:] != col_sorted[:-1]])
    head_of = np.repeat(heads, np.diff(np.r_[heads, len(by_column)]))
    before = np.arange(len(by_column)) - head_of  # winners of the same cell ahead of each, by transient
    if before.sum():
        later = np.repeat(np.arange(len(by_column)), before)
        ahead = np.arange(len(later)) - np.repeat(np.cumsum(before) - before, before) + head_of[later]
        j, q = by_column[later], by_column[ahead]
        beaten = (w_mem[q] <= w_mem[j]) & (w_t[q] <= w_t[j])
        dominated[j[beaten]] = True
    return winners[~dominated]


def _stable_order(key: np.ndarray, largest: int) -> np.ndarray:
    """``np.argsort(key, kind="stable")`` for keys from 0 to ``largest`` < 2³², by radix sorts of 16 bits (numpy's
    stable sort of 16-bit integers: linear time)."""
    if largest < 2**16:
        return np.argsort(key.astype(np.uint16), kind="stable")
    low = np.argsort((key & 0xFFFF).astype(np.uint16), kind="stable")
    return low[np.argsort((key[low] >> 16).astype(np.uint16), kind="stable")]


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
