"""The space the search walks: what it may choose (:class:`SearchOptions`), the micro-batch counts and schedules it
tries, and the tasks (one pipeline degree, micro-batch count, schedule and strategy space each) it solves.

    >>> microbatch_counts(12)
    (1, 2, 3, 4, 6, 12)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from nbtrain.planner.cost import CostModel
from nbtrain.planner.strategy import Strategy, strategy_space


@dataclass(frozen=True)
class SearchOptions:
    """What the search may choose."""

    schedules: tuple[str, ...] = ("1f1b",)
    """Pipeline schedules. GPipe keeps all micro-batches in flight for the same bubble, so under this cost model it
    never beats 1F1B; add ``"gpipe"`` to search it anyway. With fewer micro-batches than stages, which 1F1B cannot
    run, GPipe is searched whatever this says."""
    offload_levels: tuple[float, ...] = (0.0, 0.5, 1.0)
    """Fractions of a layer's optimizer update that may run on the CPU."""
    allow_ac: bool = True
    zero_levels: tuple[int, ...] = (2, 3)
    max_tp: int | None = None
    allow_sp: bool = True
    """Offer sequence parallelism (``sp``) beside plain TP wherever tp > 1 (and the model's blocks allow it)."""
    pp_degrees: tuple[int, ...] | None = None
    """Pipeline degrees to try (default: every power of two up to the devices and the layers)."""
    microbatches: tuple[int, ...] | None = None
    """Micro-batch counts to try (default: :func:`microbatch_counts`); counts below ``pp`` run GPipe."""
    allow_ep: bool = True
    """Offer expert parallelism (``ep``, every power of two dividing the experts and dp) on the layers with experts,
    for a mixture of experts whose experts the executor can spread."""
    memory_grid: int = 64
    """Cells the memory budget is cut into when a stage's frontier grows large (0: always exact)."""


@dataclass
class Task:
    """One sub-problem of the search: a pipeline degree, micro-batch count and schedule, and the strategies its
    layers may take (with their (dp, tp, sp) layouts, for the relayout costs)."""

    pp: int
    microbatches: int
    schedule: str
    space: list[Strategy]
    layouts: list[tuple[int, int, bool]]
    layout_of: np.ndarray
    tables: dict = field(default_factory=dict)


def microbatch_counts(global_batch: int) -> tuple[int, ...]:
    """The micro-batch counts the search tries: divisors of the global batch that are a power of two, or that leave
    a power of two of sequences per micro-batch (which power-of-two data-parallel degrees split), ascending.

        >>> microbatch_counts(12), microbatch_counts(3), microbatch_counts(64)[-1]
        ((1, 2, 3, 4, 6, 12), (1, 3), 64)
    """
    powers = [2**k for k in range(global_batch.bit_length())]
    return tuple(sorted({m for m in powers if global_batch % m == 0} |
                        {global_batch // b for b in powers if global_batch % b == 0}))


def schedules_for(pp: int, microbatches: int, opts: SearchOptions) -> tuple[str, ...]:
    """1F1B needs at least as many micro-batches as stages (PyTorch's Schedule1F1B raises otherwise); GPipe runs
    any count, and with ``m < pp`` it is the only schedule the executor can run."""
    if pp == 1 or microbatches >= pp:
        return opts.schedules
    return ("gpipe",)


def tasks(model: CostModel, opts: SearchOptions, mixed: bool = True) -> list[Task]:
    """The sub-problems of the search. ``mixed=False``: offload and TP in two spaces (TP without offload; offload
    with tp=1), each much smaller than their union; the search tries them first and the union (``mixed``) only when
    nothing fits in them."""
    profile, cluster, batch = model.profile, model.cluster, model.global_batch
    n = len(profile.layers)
    heads = profile.arch.get("n_kv_head") or profile.arch.get("n_head")
    max_tp = 1 if profile.arch.get("no_tensor_parallel") else opts.max_tp
    unit = profile.arch.get("tp_unit")  # every split dimension divides by tp (nbtrain.models.description)
    traced = profile.arch.get("traced_stages")  # traced stages hold the full head count: no tp inside them
    # sequence parallelism where the executor can run it on this model's blocks (nbtrain.models.description)
    allow_sp = opts.allow_sp and not profile.arch.get("no_sequence_parallel")
    experts = profile.arch.get("experts") or 0
    spreads = opts.allow_ep and experts > 1 and not profile.arch.get("no_expert_parallel")
    expert_degrees = tuple(2**k for k in range(1, experts.bit_length()) if experts % 2**k == 0) if spreads else ()
    pps = opts.pp_degrees or tuple(p for p in (2**k for k in range(16)) if p <= min(cluster.num_devices, n))
    tasks = []
    for pp in pps:
        if cluster.num_devices % pp or pp > n:
            continue
        counts = opts.microbatches or microbatch_counts(batch)
        for m in counts:
            if batch % m:
                continue
            space = [s for s in strategy_space(cluster.num_devices // pp, devices_per_node=cluster.devices_per_node,
                                               max_tp=1 if pp > 1 and traced else max_tp, max_dp=batch // m,
                                               offload_levels=opts.offload_levels,
                                               allow_ac=opts.allow_ac,
                                               zero_levels=opts.zero_levels, allow_sp=allow_sp,
                                               expert_degrees=expert_degrees)
                     if batch % (m * s.dp) == 0 and (s.tp == 1 or not heads or heads % s.tp == 0)
                     and (s.tp == 1 or not unit or unit % s.tp == 0) and (not s.sp or model.seq_len % s.tp == 0)]
            spaces = [space] if mixed or not any(s.offload for s in space) else \
                [[s for s in space if not s.offload], [s for s in space if s.tp == 1]]
            for part in spaces:
                if not part:
                    continue
                layouts = sorted({s.layout for s in part})
                layout_of = np.array([layouts.index(s.layout) for s in part])
                for schedule in schedules_for(pp, m, opts):
                    tasks.append(Task(pp, m, schedule, part, layouts, layout_of))
    return tasks
