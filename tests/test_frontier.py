"""The frontier's fast step keeps exactly the partial plans, in exactly the order, of the rule it replaced.

    .venv/bin/python -m pytest -q tests/test_frontier.py          # a few seconds

``Frontier.extend`` once built every (partial plan × strategy), found the fastest of each memory cell with a
sort and ``np.minimum.at``, and dropped the dominated with a sweep per layout and transient. It now finds the same
cells and the same dominance on a dense grid with linear-time sorts (issue 46). Since the grid merges plans, what
it keeps decides what the next layer sees: the search answers as before only if every step keeps the same points
in the same order. The old rule is written out here, unchanged, and both run on random frontiers built to tie:
small integer memories, times and transients, several layouts, a grid fine enough to merge and coarse enough to
collide.
"""

from __future__ import annotations

import numpy as np
import pytest

from nbtrain.planner import frontier
from nbtrain.planner.frontier import Frontier


# --- the rule as it was (nbtrain/planner/frontier.py at 9ed82b0) -------------------------------------------------

def reference_extend(self, resident, transient, time, layout, relayout, budget, grid=0.0, ids=None, limit=4096):
    n, s = len(self), len(time)
    mem = (self.memory[:, None] + resident[None, :]).ravel()
    peak = np.maximum(self.transient[:, None], transient[None, :]).ravel()
    switch = relayout[self.layout][:, layout] if self.previous is not None else np.zeros((n, s))
    t = (self.time[:, None] + time[None, :] + switch).ravel()
    lay = np.broadcast_to(layout[None, :], (n, s)).ravel()
    ids = np.arange(s) if ids is None else ids
    strat = np.broadcast_to(ids[None, :], (n, s)).ravel()
    parent = np.broadcast_to(np.arange(n)[:, None], (n, s)).ravel()
    idx = np.flatnonzero(mem + peak <= budget)
    if grid > 0 and len(idx) > limit:
        idx = idx[reference_fastest_per_cell(mem[idx], peak[idx], t[idx], lay[idx], grid)]
    idx = idx[reference_non_dominated(mem[idx], peak[idx], t[idx], lay[idx])]
    return mem[idx], peak[idx], t[idx], lay[idx], strat[idx], parent[idx]


def reference_fastest_per_cell(mem, peak, t, lay, grid):
    _, peak_id = np.unique(peak, return_inverse=True)
    cells = np.floor(mem / grid).astype(np.int64)
    key = (lay.astype(np.int64) * (peak_id.max() + 1) + peak_id) * (cells.max() + 1) + cells
    best = np.full(int(key.max()) + 1, np.inf)
    np.minimum.at(best, key, t)
    winners = np.flatnonzero(t == best[key])
    _, first = np.unique(key[winners], return_index=True)
    return winners[first]


def reference_non_dominated(mem, peak, t, lay):
    if len(t) == 0:
        return np.zeros(0, dtype=int)
    order = np.lexsort((t, mem, peak, lay))
    keep = []
    bounds = np.flatnonzero(np.diff(lay[order])) + 1
    for group in np.split(order, bounds):
        stair_mem, stair_time = np.zeros(0), np.zeros(0)
        for sub in np.split(group, np.flatnonzero(np.diff(peak[group])) + 1):
            m, tt = mem[sub], t[sub]
            if len(stair_mem):
                pos = np.searchsorted(stair_mem, m, side="right") - 1
                best = np.where(pos >= 0, stair_time[np.maximum(pos, 0)], np.inf)
                alive = tt < best
                sub, m, tt = sub[alive], m[alive], tt[alive]
            if len(sub) == 0:
                continue
            running = np.minimum.accumulate(tt)
            first = np.ones(len(tt), dtype=bool)
            first[1:] = tt[1:] < running[:-1]
            sub, m, tt = sub[first], m[first], tt[first]
            keep.append(sub)
            m_all, t_all = np.concatenate([stair_mem, m]), np.concatenate([stair_time, tt])
            o = np.lexsort((t_all, m_all))
            m_all, t_all = m_all[o], t_all[o]
            r = np.minimum.accumulate(t_all)
            f = np.ones(len(t_all), dtype=bool)
            f[1:] = t_all[1:] < r[:-1]
            stair_mem, stair_time = m_all[f], t_all[f]
    return np.concatenate(keep) if keep else np.zeros(0, dtype=int)


# --- random frontiers that tie -------------------------------------------------------------------------------------

def random_step(rng: np.random.Generator):
    n, s, layouts = int(rng.integers(1, 60)), int(rng.integers(1, 40)), int(rng.integers(1, 5))
    scale = float(rng.choice([1.0, 0.37, 1e9]))  # whole numbers tie; other scales round

    def values(size, high):
        return rng.integers(0, high, size).astype(float) * scale

    previous = None if rng.random() < 0.1 else Frontier.start()
    prev = Frontier(values(n, 40), values(n, 8), values(n, 30), rng.integers(0, layouts, n), np.zeros(n, int),
                    np.zeros(n, int), previous)
    layout = rng.integers(0, layouts, s)
    relayout = values((layouts, layouts), 4)
    np.fill_diagonal(relayout, 0.0)
    budget = float(rng.integers(20, 120)) * scale
    grid = budget / float(rng.choice([4, 16, 64]))
    ids = rng.permutation(100)[:s]
    return prev, (values(s, 40), values(s, 12), values(s, 30), layout, relayout, budget, grid, ids)


@pytest.mark.parametrize("limit", [0, 40, 4096])
def test_a_step_keeps_the_points_of_the_old_rule_in_its_order(monkeypatch, limit):
    """``limit`` 0 and 40 merge cells on almost every step, 4096 (the search's) never here: both regimes."""
    monkeypatch.setattr(frontier, "EXACT_LIMIT", limit)
    rng = np.random.default_rng(limit)
    merged = 0
    for trial in range(400):
        prev, args = random_step(rng)
        want = reference_extend(prev, *args, limit=limit)
        got = prev.extend(*args)
        for name, w, g in zip(("memory", "transient", "time", "layout", "strategy", "parent"), want,
                              (got.memory, got.transient, got.time, got.layout, got.strategy, got.parent)):
            assert np.array_equal(w, g), f"trial {trial}: {name} differs:\n{w}\n{g}"
        merged += len(want[0]) > 0 and np.count_nonzero(prev.memory[:, None] + args[0][None, :] +
                                                        np.maximum(prev.transient[:, None], args[1][None, :])
                                                        <= args[5]) > limit
    if limit < 4096:
        assert merged > 200, "the grid merged too rarely to test it"


def test_the_fastest_plan_per_last_layout_is_the_least_time_of_each():
    f = Frontier(np.zeros(4), np.zeros(4), np.array([3.0, 1.0, 2.0, 5.0]), np.array([0, 0, 2, 2]), np.zeros(4, int),
                 np.zeros(4, int), Frontier.start())
    assert list(f.fastest_by_layout(4)) == [1.0, np.inf, 2.0, np.inf]
