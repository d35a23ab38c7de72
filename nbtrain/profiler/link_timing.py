"""Timing primitives of the link benchmark (:mod:`nbtrain.profiler.link_bench`), run inside spawned gloo workers:
medians of repeats started together after a barrier, the slowest rank's value, and what a wrapped module adds to
a plain one.

    median_seconds(lambda: dist.all_reduce(t), dist.barrier)    # inside a worker of an initialised process group
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

REPEATS = 9


def median_seconds(step, barrier, repeats: int = REPEATS) -> float:
    """Median seconds of ``step`` over ``repeats``, each started together (a barrier first), after a warm-up."""
    step()
    times = []
    for _ in range(repeats):
        barrier()
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def slowest_rank(value: float) -> float:
    """The largest of every rank's ``value``: a collective ends when its slowest member does."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def group_sizes(world: int) -> list[int]:
    """The group sizes measured among ``world`` processes: the powers of two from 2 that divide it."""
    return [k for k in (2, 4, 8, 16) if k <= world and world % k == 0]


def once_seconds(step) -> float:
    """Seconds of one ``step``, every rank started together after a barrier."""
    dist.barrier()
    started = time.perf_counter()
    step()
    return time.perf_counter() - started


def added_seconds(plain, wrapped, x, compute_share: float = 1.0) -> tuple[float, float]:
    """Seconds ``wrapped`` adds to ``plain``'s forward and backward on ``x`` (``plain``'s times × ``compute_share``:
    the part of its compute each rank still does), this rank's median over rounds that time both back to back,
    so that a slow second of a shared machine slows both sides of a difference alike."""
    def forward(model):
        return lambda: model(x)

    def step(model):
        return lambda: model(x).sum().backward()

    for model in (plain, wrapped):  # warm-up: allocation, lazy initialisation, the first gloo connections
        step(model)()
    fwd, bwd = [], []
    for _ in range(REPEATS):
        base_f, base_s = once_seconds(forward(plain)), once_seconds(step(plain))
        f, whole = once_seconds(forward(wrapped)), once_seconds(step(wrapped))
        fwd.append(f - base_f * compute_share)
        bwd.append((whole - f) - (base_s - base_f) * compute_share)
    return max(0.0, statistics.median(fwd)), max(0.0, statistics.median(bwd))
