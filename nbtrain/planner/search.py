"""Search the hybrid-parallel space for the fastest plan that fits: Galvatron-BMW's search, exact.

    >>> plans = search(profile, cluster, global_batch=64, seq_len=2048)      # best first
    >>> str(plans[0]), plans[0].predicted.step_time_s

For every pipeline degree ``pp`` (powers of two up to the layer count) and micro-batch count ``m`` (the divisors of
the global batch that are powers of two or leave a power of two of sequences per micro-batch: 1, 2, 3, 4, 6, 12
for 12), the per-layer strategies come from the pruned space of
:func:`~nbtrain.planner.strategy.strategy_space` (TP inside a node and dividing the heads, each data-parallel rank
with at least one sequence; CPU update offload at every level the options give, with every axis, TP and offload
mixed in one layer only where nothing fits without the mix). Fewer micro-batches than stages (a global batch of 2 over 4 stages) run GPipe's schedule, which
PyTorch takes with any count, where its ``Schedule1F1B`` refuses them: so a small batch on many devices gets a
plan, as tensor and pipeline parallelism need no sequence per device. A tied embedding and head stay in one stage,
unsplit by TP (as the executor runs them), so those layers are data-parallel over every device and the batch must
split that many ways. Per stage, :mod:`.frontier` finds the fastest strategies under the memory budget
exactly. Stage boundaries are chosen exactly too: ``Σᵢ Tᵢ + (m − 1)·maxᵢ Tᵢ`` is minimised over every partition by
fixing the largest stage time ``τ`` (each candidate at once, vectorised) and minimising the sum of stage times
under it — the balance of time *and* memory that Galvatron-BMW's paper asks for, where its public code splits
evenly. Tasks are visited in order of a lower bound on their step time, tightened as they come up (the blocks'
prices alone, then every layer's, then through the stages: :mod:`.solver`), and skipped once the bound cannot beat
the ``top`` plans found; inside a task, stage ranges whose bound cannot beat a known step are not priced. Every
bound is below what it bounds, so the answer is the exhaustive one (``tests/test_search_exact.py``) and the one the
search gave before it had bounds (``tests/test_plan_speed_same_plans.py``). The layers are priced once per model
and cluster (:mod:`.cost_tables`), shared with the next search; a ``deadline`` stops the search once it has a plan
(:mod:`.anytime`).
"""

from __future__ import annotations

import heapq
from dataclasses import replace

import numpy as np

from nbtrain.planner.anytime import Clock, Found
from nbtrain.planner.cost import UNRUNNABLE, CostModel, CostOptions
from nbtrain.planner.cost_tables import shared_cost_model, twins
from nbtrain.planner.plan import Plan
from nbtrain.planner.reach import cuts_stages, is_tied, keeps_tie_whole, tie_crosses_stages
from nbtrain.planner.search_space import SearchOptions, Task, tasks
from nbtrain.planner.solver import SAFETY, Solver
from nbtrain.profiler.hardware import Cluster
from nbtrain.profiler.result import ModelProfile


def _allowed(profile: ModelProfile, options: SearchOptions) -> SearchOptions:
    """The options as the search applies them: one stage for a model the executor does not cut into stages, or
    whose tied embedding and head it keeps whole; no offload where the executor does not offload the model."""
    if keeps_tie_whole(profile) and not tie_crosses_stages(profile) or not cuts_stages(profile):
        options = replace(options, pp_degrees=(1,))
    if profile.arch.get("no_offload"):
        options = replace(options, offload_levels=(0.0,))
    return options


def _solvers(model: CostModel, options: SearchOptions, budget: float, grid: float,
             mixed: bool = True) -> list[Solver]:
    """One solver per task the search may take; a tied embedding and head get one per strategy they may share
    (no TP: the executor keeps the shared weight whole, in one FSDP group)."""
    profile = model.profile
    kinds = layer_kinds(profile)
    out = []
    for task in tasks(model, _allowed(profile, options), mixed):
        if not is_tied(profile):
            out.append(Solver(model, task, budget, kinds, grid))
            continue
        last = len(profile.layers) - 1
        shared = [j for j, s in enumerate(task.space) if s.tp == 1 or not keeps_tie_whole(profile)]
        candidates = [Solver(model, task, budget, kinds, grid, forced={0: j, last: j}) for j in shared]
        out += [c for c in candidates if c.allowed[c.forced[0]]]  # its offload level must fit the host
    return out


def search(profile: ModelProfile, cluster: Cluster, *, global_batch: int, seq_len: int | None = None,
           memory: float | None = None, top: int = 3, options: SearchOptions = SearchOptions(),
           cost_options: CostOptions = CostOptions(), deadline: float | None = None, progress=None) -> Found:
    """The ``top`` fastest distinct plans that fit, each with ``predicted`` set, best first.

    ``deadline`` (a ``time.monotonic()`` time): stop there once a plan is found, with ``complete`` False on the
    answer (:class:`~nbtrain.planner.anytime.Found`); ``progress`` is called with a
    :class:`~nbtrain.planner.anytime.Progress` after each sub-problem."""
    clock = Clock(deadline, progress)
    model = shared_cost_model(profile, cluster, global_batch=global_batch, seq_len=seq_len, budget_bytes=memory,
                              options=cost_options)
    budget = model.budget - model.reserve
    found: list[tuple[float, Plan]] = []
    kinds = layer_kinds(profile)
    result = Found()
    if budget > 0:  # else the reserve alone fills the budget: nothing fits (recommend.py says so)
        grid = budget / options.memory_grid if options.memory_grid else 0.0
        # offload mixed with TP only where nothing fits without the mix: their union is ~3x the search's work
        for mixed in (False, True):
            if not found:
                result.left = _solve(model, _solvers(model, options, budget, grid, mixed), found, top, kinds,
                                     global_batch, clock)
                result.complete = result.left == 0
    result += [plan for _, plan in found[:top]]
    result.elapsed_s = clock.elapsed()
    return result


def _solve(model: CostModel, solvers: list[Solver], found: list, top: int, kinds: list[int],
           global_batch: int, clock: Clock) -> int:
    """Solve ``solvers``' tasks into ``found`` (step time, plan), fastest first, until no task can beat the ``top``
    found. Tasks wait by a lower bound on their step time (of equal bounds, the first task first), and the least
    is taken: a bound from the blocks' prices alone (:meth:`Solver.partial_bound`), then once the task is priced in
    full the Lagrangian over all its layers (:attr:`Solver.lower_bound`), then the bound through its stages
    (:meth:`Solver.bounds`); a task is solved when its tightest bound is still the least. Every bound is below the
    task's best step, so once the least cannot beat the ``top``-th plan found no task left can, and a task priced
    or bounded no further than needed gives the same plans. Returns the tasks left when the clock ran out (0:
    none)."""
    profile, cluster = model.profile, model.cluster
    waiting = [(solver.partial_bound(), i, 0) for i, solver in enumerate(solvers)]
    heapq.heapify(waiting)
    solved = ruled_out = 0
    while waiting:
        bound, i, step = heapq.heappop(waiting)
        solver = solvers[i]
        if len(found) >= top and bound >= found[top - 1][0]:
            ruled_out += 1 + len(waiting)
            break
        if step < 2 and (step == 0 or solver.prune):  # a tighter bound first: it may wait behind others
            heapq.heappush(waiting, (max(bound, solver.lower_bound if step == 0 else solver.bounds()[0]), i,
                                     step + 1 if solver.prune else 2))
            continue
        if found and clock.out_of_time():
            return 1 + sum(1 for b, _, _ in waiting if len(found) < top or b < found[top - 1][0])
        limit = found[top - 1][0] * (1 + SAFETY) if len(found) >= top else np.inf
        task = solver.task
        solution = solver.solve(limit)
        solved += 1
        if solution is None or solution[0] > limit:  # above the top-th: where it may be inexact, never kept
            clock.report(solved, ruled_out, len(solvers), found[0][0] if found else None)
            continue
        _, ranges, chosen = solution
        chosen = _tidy(chosen, task, kinds, ranges)
        plan = Plan(num_devices=cluster.num_devices, layers=one_expert_degree(profile, [task.space[j] for j in chosen]),
                    pp=task.pp, microbatches=task.microbatches, schedule=task.schedule,
                    stages=tuple(e - a for a, e in ranges), global_batch=global_batch,
                    seq_len=model.seq_len, model=profile.model)
        prediction = model.estimate(plan)
        if not any(plan == other for _, other in found):
            found.append((prediction.step_time_s, plan.replace(predicted=prediction)))
            found.sort(key=lambda x: x[0])
        clock.report(solved, ruled_out, len(solvers), found[0][0])
    clock.report(solved, ruled_out, len(solvers), found[0][0] if found else None)
    return 0


def layer_kinds(profile: ModelProfile) -> list[int]:
    """A small id per layer; two layers share it when their costs are equal under every strategy: the same
    profile (every field but the name and the measured times; the scaling's coefficients), the same input size
    (what TP collectives and re-layouts move) and the same per-layer facts (:func:`~nbtrain.planner.cost_tables.
    twins`), so that a field a profile gains (which of a layer's parameters train, say) tells layers apart."""
    return twins(profile, measured=False)


def one_expert_degree(profile: ModelProfile, layers: list) -> tuple:
    """``layers`` with the layers that hold no experts given the experts' ``ep`` (the most common one), where it
    divides their dp and they run no tensor parallelism, else 1: they run and cost the same under any ``ep``, so the search may return any, and one
    degree throughout reads as one strategy (``dp_shard=8 ep=8``)."""
    per_layer = profile.arch.get("layer_expert_params") or ()
    spread = [s.ep for i, s in enumerate(layers) if i < len(per_layer) and per_layer[i]]
    ep = max(sorted(set(spread)), key=spread.count) if spread else 1
    return tuple(s if i < len(per_layer) and per_layer[i] else
                 replace(s, ep=ep if s.dp % ep == 0 and s.tp == 1 else 1)  # ep runs beside dp only, not tp
                 for i, s in enumerate(layers))


def _tidy(chosen: list[int], task: Task, kinds: list[int], ranges: list[tuple[int, int]]) -> list[int]:
    """Group equal strategies inside runs of identical layers of one stage that share a layout.

    Such layers cost the same whatever their order (no re-layout between them, the same micro-batches in
    flight), so the search may return them interleaved (``ac`` on every other block); sorting them changes no
    cost and gives ranges a person can read.
    """
    out = list(chosen)
    for first, end in ranges:
        start = first
        for i in range(first + 1, end + 1):
            same = i < end and kinds[i] == kinds[start] and \
                task.space[out[i]].layout == task.space[out[start]].layout
            if not same:
                out[start:i] = sorted(out[start:i])
                start = i
    return out


def leanest(profile: ModelProfile, cluster: Cluster, *, global_batch: int, seq_len: int | None = None,
            memory: float | None = None, options: SearchOptions = SearchOptions(),
            cost_options: CostOptions = CostOptions()) -> Plan | None:
    """The plan of least memory per device among those :func:`search` may choose, with its prediction against
    ``memory``; ``None`` when the search may choose no plan at all, whatever the memory: the global batch, the
    heads, the layers or a tied embedding cannot be split over the devices.

    Per task (pp, micro-batches, schedule, space) with its stages split evenly, each stage's memory is
    ``Σ resident + max transient``; it is least for the ``T`` among the transients that minimises ``T`` plus, per
    layer, the least resident bytes of a strategy whose transient is at most ``T``: exact for that split."""
    model = shared_cost_model(profile, cluster, global_batch=global_batch, seq_len=seq_len, budget_bytes=memory,
                              options=cost_options)
    best = None
    for solver in _solvers(model, options, max(model.budget - model.reserve, 1.0), 0.0):
        task = solver.task
        shape = Plan(num_devices=cluster.num_devices, layers=(task.space[0],) * len(profile.layers), pp=task.pp)
        chosen: list[int] = []
        for stage, (start, end) in enumerate(shape.stage_ranges()):
            k = solver.in_flight(stage)
            options_of = [np.array([solver.forced[i]]) if i in solver.forced else np.flatnonzero(solver.allowed)
                          for i in range(start, end)]
            ceilings = np.unique(np.concatenate([solver.transient[solver.kind[i]][c]
                                                 for i, c in zip(range(start, end), options_of)]))
            stage_best = None
            for ceiling in ceilings:
                picks, total = [], float(ceiling)
                for i, c in zip(range(start, end), options_of):
                    kind = solver.kind[i]
                    ok = c[solver.transient[kind][c] <= ceiling]
                    if len(ok) == 0:
                        break
                    j = int(ok[int(np.argmin(solver.resident(kind, k)[ok]))])
                    picks.append(j)
                    total += float(solver.resident(kind, k)[j])
                else:
                    if stage_best is None or total < stage_best[0]:
                        stage_best = total, picks
            if stage_best is None or stage_best[0] >= UNRUNNABLE:  # a layer the executor runs under none of
                break  # the task's strategies (tp on a block its plan does not split)
            chosen += stage_best[1]
        if len(chosen) != len(profile.layers):
            continue
        plan = Plan(num_devices=cluster.num_devices, layers=one_expert_degree(profile, [task.space[j] for j in chosen]),
                    pp=task.pp, microbatches=task.microbatches, schedule=task.schedule, global_batch=global_batch,
                    seq_len=model.seq_len, model=profile.model)
        prediction = model.estimate(plan)
        key = (prediction.memory_bytes, max(stage.host_bytes for stage in prediction.stages))
        if best is None or key < best[0]:
            best = key, plan.replace(predicted=prediction)
    return None if best is None else best[1]
