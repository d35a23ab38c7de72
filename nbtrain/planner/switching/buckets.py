"""Hot switching, planned: one strategy per sequence-length bucket of a step (HotSPa), and which buckets to merge.

    >>> prof = nbtrain.profile("llama-7b", batch_size=1, seq_len=4096)
    >>> hot = plan_buckets(prof, Cluster.from_catalog("A100", num_devices=8), [(4096, 48), (16384, 6), (32768, 2)])
    >>> print(hot.summary())
    hot switching: 3 buckets · 3 strategies · home tp=8 · fits ...
    >>> hot.strategies()            # bound → strategy, what nbtrain.run.switching.hot.HotSwitching takes
    >>> print(hot)                  # one row per bucket, the switches, the static plan, the speed-up

A bucket ``(bound, rows)`` is ``rows`` rows of ``bound`` tokens per step (what packing the step's documents of that
length gives). The longest bucket's strategy is the *home*: its layout holds the master weights and the optimizer.

**Step time.** A bucket runs under one strategy for every layer, each rank's rows in ``m`` micro-batches of ``r``
rows (their gradients accumulated; HotSPa too sizes micro-batches per bucket): ``r`` all the rows, or 1, 2, 4, ...
64, whichever is fastest among those that fit the memory beside the home layout, so a short bucket of many rows runs
in slices as small as one long row. Every data-parallel rank runs the same number of rows, so under ``dp`` ranks
the bucket is padded with empty rows to a multiple of ``dp``, and each rank's rows to a multiple of ``r``; empty
rows cost as much as full ones (they are computed, as :mod:`nbtrain.run.switching.hot` runs them): the cost model
at ``global_batch=dp × m × r, seq_len=bound`` and ``m`` micro-batches, Σ over layers of
``compute + tp_comm + zero3_comm`` (FSDP2's gathers once per micro-batch). Its tokens are still the real ones,
``bound × rows``. Buckets
sharing a strategy run back to back (grouped by strategy, in the order of their shortest bucket, the home last, as
:mod:`nbtrain.run.switching.hot` runs them) and synchronise their gradients once, in that layout, overlapped with the
backward of the group's last (longest) bucket: the cost model's ``dp_comm`` at that bucket. Each strategy other than
the home pays two switches per step (:mod:`nbtrain.planner.switching.bucket_search`): the compute copy of the weights home → it
(``profile.dtype_bytes`` per parameter) and the accumulated gradients back (``CostOptions.grad_reduce_bytes``, fp32).
Then one update in the home layout (the cost model's ``Time.update``, non-zero where it knows the device's own rate).

**Memory per device.** All step long the home layout holds its compute copy, gradients and optimizer state (Σ over
layers of the cost model's ``params + grads + optimizer``). A bucket under the home strategy adds its activations
of one micro-batch (``r`` rows) and the largest transient of its layers: exactly
``CostModel.estimate`` of that uniform plan. A bucket under another strategy adds that layout's compute copy and
gradients (its ``params + grads``), its activations and its largest transient: as in HotSPa,
:mod:`nbtrain.run.switching.hot` frees a layout's copy and gradients when the step leaves it, so no two away layouts
are resident at once. Plus the cost model's reserve. Every bucket fits.

**Pipelines and offload** (issue 47). A bucket may also run in a pipeline, HotSPa's ``(dp, tp, pp)``: its strategy
on each stage's ``N / pp`` devices, the stages cut evenly by layer count, 1F1B over its own micro-batches (GPipe
when there are fewer of them than stages). Such a bucket is priced by ``CostModel.estimate`` of that uniform
pipelined plan: each stage's layers, the bubble ``Σᵢ Tᵢ + (m − 1) · maxᵢ Tᵢ`` (the stages' imbalance included), the
sends between stages and its gradient sync (a pipeline syncs after each of its buckets); its memory per stage, the
micro-batches in flight on it at the step that fills the bucket most (a step may put all its tokens in one bucket:
more micro-batches of the same rows; the time is the mean step's); its switches move only the layers of each rank's
stage (:mod:`nbtrain.planner.switching.switch_cost`). The home alone may offload its update to the CPU
(``BucketOptions.offload_levels``): its optimizer state then stays on the device for the rest only, and the update's
CPU time beyond its last bucket's backward is paid (CoTrain's overlap). ``BucketPlan.why`` says, for each pipelined
bucket, what its pipeline costs beside the fastest strategy without one
(:mod:`nbtrain.planner.switching.pipeline_note`).

**Search.** For each way to merge adjacent buckets (a merged bucket has the larger bound and
``ceil(tokens / bound)`` rows: the shorter rows packed into longer ones, attention then paid over whole rows) and
each home strategy that fits the longest bucket, the other buckets are partitioned into groups, each group under its
best strategy (a dynamic program over subsets: exact). Strategies come from ``strategy_space`` (power-of-two
degrees, tp inside a node and dividing the heads, no tp with a tied embedding), with and without a pipeline of
each power-of-two ``pp`` up to the layers (``BucketOptions.max_pp``), whatever the rows. Up to 6
buckets every merging is tried; beyond (up to 12), adjacent buckets are first merged greedily, the fastest merge
first, until 6 remain, and the buckets as given are tried too. The *static plan* is the best single strategy for
every bucket (no switch), with the better of two packings: the buckets as given, or every document in rows of the
longest bound (one bucket, as a static system packs); both are among the plans searched, so hot switching is never
slower.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator

import numpy as np

from nbtrain.errors import InvalidArgumentError, NoFeasiblePlanError
from nbtrain.planner.switching.bucket_result import Bucket, BucketOptions, BucketPlan, StaticPlan
from nbtrain.planner.switching.bucket_search import (Assignment, SwitchingCostModel, fastest, fastest_single_strategy,
                                                    layout)
from nbtrain.planner.switching.bucket_strategy import parse_bucket_strategy, pp_of
from nbtrain.planner.switching.pipeline_note import pipeline_notes
from nbtrain.profiler.hardware import Cluster
from nbtrain.profiler.result import ModelProfile
from nbtrain.units import format_bytes, parse_bytes

__all__ = ["Bucket", "BucketOptions", "BucketPlan", "StaticPlan", "plan_buckets", "price_buckets", "merged_rows"]

MAX_EXHAUSTIVE = 6
"""Buckets up to which every way of merging adjacent ones is tried (2^(n−1) of them)."""
MAX_BUCKETS = 12
"""Buckets the search takes at most (its dynamic program has 3^(n−1) steps)."""


def plan_buckets(profile: ModelProfile, cluster: Cluster, buckets, *, memory=None,
                 options: BucketOptions | None = None) -> BucketPlan:
    """The fastest hot-switching plan for ``buckets`` — ``[(bound, rows), ...]``, shortest first — within
    ``memory`` per device (bytes or ``"40GiB"``; default: the device's), beside the best static plan. Raises
    :class:`NoFeasiblePlanError` when nothing fits, :class:`InvalidArgumentError` for buckets it cannot read.

        >>> hot = plan_buckets(prof, Cluster.from_catalog("A100", num_devices=16), [(4096, 48), (32768, 2)],
        ...                    memory="40GiB")
        >>> {bound: str(s) for bound, s in hot.strategies().items()}   # the home's update half on the CPU
        {4096: 'dp_replicate=2 dp_shard=8', 32768: 'dp_shard=2 zero=2 tp=8 ac=op offload=0.5'}
    """
    options = options or BucketOptions()
    if not isinstance(profile, ModelProfile):
        raise InvalidArgumentError(f"plan_buckets needs a ModelProfile, got {type(profile).__name__}; profile the "
                                   "model first: nbtrain.profile('llama-7b', batch_size=1, seq_len=4096)")
    given = _checked(buckets)
    if len(given) > MAX_BUCKETS:
        raise InvalidArgumentError(f"{len(given)} buckets are more than the search takes ({MAX_BUCKETS}); use "
                                   "coarser bounds, e.g. powers of 4 (256, 1K, 4K, 16K, 64K)")
    costs = SwitchingCostModel(profile, cluster, parse_bytes(memory) if memory is not None else None, options,
                               step_tokens=step_tokens(given))
    as_given = [[b] for b in given]
    parts, notes = as_given, ()
    while options.merge and len(parts) > MAX_EXHAUSTIVE:  # greedily: the merge that gives the fastest step
        parts = min((parts[:i] + [parts[i] + parts[i + 1]] + parts[i + 2:] for i in range(len(parts) - 1)),
                    key=lambda grouping: _fastest_grouping(costs, grouping)[0].seconds)
        notes = (f"{len(given)} buckets: adjacent ones were merged greedily (the fastest merge first) down to "
                 f"{MAX_EXHAUSTIVE}, then every merging of those was tried, beside the buckets as given",)
    candidates = (([as_given] if parts is not as_given else []) + _mergings(parts)) if options.merge else [as_given]
    best = min((_fastest_grouping(costs, grouping) for grouping in candidates), key=lambda x: x[0].seconds)
    if not math.isfinite(best[0].seconds):
        raise NoFeasiblePlanError(_no_fit(costs, given))
    return _plan(costs, given, *best, notes=notes)


def price_buckets(profile: ModelProfile, cluster: Cluster, buckets, strategies, *, memory=None,
                  options: BucketOptions | None = None) -> BucketPlan:
    """The predicted step of given strategies — ``{bound: strategy}`` (a Strategy, a BucketStrategy or their text,
    ``"pp=2 tp=2"``), one per bucket of ``buckets`` — priced as :func:`plan_buckets` prices its own (each bucket in
    the fewest micro-batches that fit, or in those that need the least memory when none does), beside the best
    static plan.

        >>> given = price_buckets(prof, cluster, [(512, 24), (4096, 2)], {512: Strategy(dp_replicate=2),
        ...                                                                4096: Strategy(tp=2)}, memory="4GiB")
        >>> str(given.home), given.micro_rows()
        ('tp=2', {512: 12, 4096: 2})
    """
    options = options or BucketOptions()
    given = _checked(buckets)
    if sorted(strategies) != [bound for bound, _ in given]:
        raise InvalidArgumentError(f"strategies are given for bounds {sorted(strategies)} but the buckets have "
                                   f"{[bound for bound, _ in given]}; give one strategy per bucket")
    strategies = {b: parse_bucket_strategy(s, cluster.num_devices) for b, s in strategies.items()}
    costs = SwitchingCostModel(profile, cluster, parse_bytes(memory) if memory is not None else None, options,
                               extra=tuple(strategies.values()), step_tokens=step_tokens(given))
    piped = [str(s) for s in strategies.values() if pp_of(s) > 1]
    if piped and costs.no_pp:
        raise InvalidArgumentError(f"cannot run {', '.join(piped)}: pipelines are ruled out for this model "
                                   f"({costs.no_pp}); give strategies without pp")
    chosen = [costs.space.index(strategies[b]) for b, _ in given]
    found = Assignment(math.nan, chosen[-1], chosen)
    return _plan(costs, given, found, [[b] for b in given], [costs.bucket(b, r) for b, r in given], ())


def step_tokens(buckets: list[tuple[int, int]]) -> int:
    """The tokens of a step of ``buckets``, ``(bound, rows)`` pairs: ``step_tokens([(512, 8), (4096, 1)]) == 8192``,
    the most one bucket may get in a step (a pipelined bucket's memory is priced at it)."""
    return sum(bound * rows for bound, rows in buckets)


def _fastest_grouping(costs: SwitchingCostModel, grouping: list) -> tuple[Assignment, list, list]:
    """The fastest assignment for a grouping of the given buckets (infinitely slow when nothing fits)."""
    merged = [costs.bucket(group[-1][0], merged_rows(group)) for group in grouping]
    found = fastest(costs, merged) or Assignment(math.inf, -1, [])
    return found, grouping, merged


def _checked(buckets) -> list[tuple[int, int]]:
    example = "e.g. [(4096, 48), (16384, 6), (32768, 2)]"
    try:
        given = [tuple(b) for b in buckets]
    except TypeError:
        raise InvalidArgumentError(f"buckets must be (bound, rows) pairs, shortest first, {example}; got "
                                   f"{buckets!r}") from None
    if not given:
        raise InvalidArgumentError(f"no buckets: give at least one (bound, rows) pair, {example}")
    out = []
    for b in given:
        try:
            bound, rows = (operator.index(x) for x in b)
        except (TypeError, ValueError):
            bound = rows = 0
        if len(b) != 2 or bound < 1 or rows < 1:
            raise InvalidArgumentError(f"bucket {b!r} is not (bound, rows) with positive whole numbers: bound is "
                                       f"the tokens per row, rows the rows of that length per step; {example}")
        out.append((bound, rows))
    for (a, _), (b, _) in zip(out, out[1:]):
        if b <= a:
            what = "two buckets have" if a == b else "bounds must increase, shortest first, but"
            raise InvalidArgumentError(f"{what} bound {a} then {b}: sort the buckets by bound and add up the rows "
                                       f"of equal bounds, {example}")
    return out


def merged_rows(buckets: list[tuple[int, int]]) -> int:
    """Rows of the longest bound that hold the tokens of ``buckets`` (adjacent, shortest first), rounded up:
    ``merged_rows([(4096, 6), (16384, 2)]) == 4``."""
    bound = buckets[-1][0]
    return -(-sum(b * r for b, r in buckets) // bound)


def _mergings(parts: list) -> list:
    """Every way to merge adjacent parts, fewest merges first (on equal step times the buckets stay as given)."""
    n = len(parts)
    out = []
    for merges in range(n):
        for cuts in itertools.combinations(range(1, n), n - 1 - merges):
            edges = [0, *cuts, n]
            out.append([sum(parts[a:b], []) for a, b in zip(edges, edges[1:])])
    return out


def _plan(costs: SwitchingCostModel, given, found, grouping, merged, notes) -> BucketPlan:
    space, home, where = costs.space, found.home, costs.layout_index
    last_of = {where[j]: k for k, j in enumerate(found.strategies)}  # each layout syncs after its last bucket
    buckets, choices, lower = [], [], 0
    for k, (group, b, j) in enumerate(zip(grouping, merged, found.strategies)):
        c = costs.choice(b, home, j, as_home=k == len(merged) - 1)
        if c is None:  # given strategies that do not fit: priced in the micro-batches that need the least
            c = int(np.argmin(costs.away_memory(b)[:, home, j]))
        seconds = b.passes[c, j] + (b.sync[c, j] if last_of[where[j]] == k else 0.0)
        buckets.append(Bucket(lower, b.bound, b.rows, space[j], float(seconds), costs.bucket_memory(b, home, j, c),
                              merged=len(group), microbatches=int(b.microbatches[c, j]),
                              micro_rows=int(b.micro_rows[c, j])))
        choices.append(c)
        lower = b.bound
    away = {where[j]: j for j in reversed(found.strategies) if where[j] != where[home]}  # a variant per layout
    order = [away[L] for L in dict.fromkeys(where[j] for j in found.strategies) if L in away]  # as they run
    switches = tuple(x for j in order for x in costs.switches(layout(space[home]), layout(space[j])))
    update = float(merged[-1].update[choices[-1], home])  # the home's, with its offload's excess over its backward
    step = sum(b.time_s for b in buckets) + sum(s.seconds for s in switches) + update
    why = pipeline_notes(costs, merged, found.strategies, home, choices)
    return BucketPlan(costs.profile.model, costs.cluster.num_devices, tuple(buckets), switches, update, step,
                      sum(bound * rows for bound, rows in given), costs.budget, _static(costs, given), notes, why)


def _static(costs: SwitchingCostModel, given) -> StaticPlan | None:
    """The best single strategy (module docstring), with the better of the two packings."""
    alone = None
    one_bucket = [(given[-1][0], merged_rows(given))]
    for packing in (given, one_bucket) if len(given) > 1 else (given,):
        priced = [costs.bucket(bound, rows) for bound, rows in packing]
        found_static = fastest_single_strategy(costs, priced)
        if found_static is not None and (alone is None or found_static[0] < alone.step_time_s):
            seconds, j = found_static
            chosen = [costs.choice(b, j, j, as_home=b is priced[-1]) for b in priced]
            need = max(float(costs.home_memory(b)[c, j]) for b, c in zip(priced, chosen))
            times = tuple(float(b.passes[c, j] + (b.sync[c, j] if b is priced[-1] else 0.0))
                          for b, c in zip(priced, chosen))
            alone = StaticPlan(costs.space[j], seconds, need, tuple(bound for bound, _ in packing), times,
                               tuple(int(b.micro_rows[c, j]) for b, c in zip(priced, chosen)))
    return alone


def _no_fit(costs: SwitchingCostModel, given) -> str:
    """Why nothing fits, and what to change."""
    c = costs.cluster
    bound, rows = given[-1]
    need = costs.home_memory(costs.bucket(bound, rows)).min(axis=0)  # with the most micro-batches
    j = int(np.argmin(need))
    where = f"no bucket plan fits {format_bytes(costs.budget)} per device on {c.num_devices} × {c.device}"
    if need[j] > costs.budget:
        why = f" (tensor parallelism is ruled out: {costs.no_tp})" if costs.no_tp else ""
        return (f"{where}: the longest bucket ({_rows(rows)} of {bound} tokens) needs {format_bytes(need[j])} "
                f"under its leanest strategy '{costs.space[j]}'{why}; use devices with more memory, more devices, or "
                "a shorter longest bound")
    return (f"{where}: the longest bucket fits under '{costs.space[j]}' ({format_bytes(need[j])}), but the other "
            "buckets fit neither in the home layout nor beside its model states; use devices with more memory, or "
            "fewer rows in the shorter buckets")


def _rows(n: int) -> str:
    return f"{n} row{'s' * (n != 1)}"
