"""How many intra-op threads the device side and the CPU update of an offloaded run get: each its share of the
cores this process may use, never more than the cores between them.

    >>> thread_shares(cores=2, processes_here=1, on_gpu=False, forked=False)   # fit(..., num_processes=1) here
    (1, 1)
    >>> thread_shares(cores=16, processes_here=1, on_gpu=True, forked=False)   # one GPU: the CPU updates with 15
    (1, 15)

A kernel runs on the thread that calls it with that thread's OpenMP team. Left alone, a process that computes
on the CPU runs backward with one thread per core and the update thread beside them: 3 threads on 2 cores, each
slower than alone (STACK.md: oversubscribed cores run tens of times slower under busy-waiting OpenMP). So the
process's cores (its affinity, shared by the ranks it holds on this machine) are split: on a CPU "device" half
each, the device's share rounded up; on a GPU the device side needs one thread to launch kernels and the update
takes the rest. Forked workers stay at one thread each (:mod:`nbtrain.run.launch.workers`: after a fork, a team
of more would wait on the parent's OpenMP pool, which the child does not have).
"""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask; the CPU count where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def thread_shares(cores: int, processes_here: int, on_gpu: bool, forked: bool) -> tuple[int, int]:
    """(the device side's intra-op threads, the CPU update's) for one of ``processes_here`` processes sharing
    ``cores`` cores."""
    if forked:
        return 1, 1
    share = max(1, cores // max(1, processes_here))
    if on_gpu:
        return 1, max(1, share - 1)
    update = max(1, share // 2)
    return max(1, share - update), update
