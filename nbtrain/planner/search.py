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
evenly. Tasks are visited in order of a lower bound on their step time and skipped once the bound cannot beat
the ``top`` plans found.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from nbtrain.planner.cost import CostModel, CostOptions
from nbtrain.planner.frontier import Frontier
from nbtrain.planner.plan import Plan
from nbtrain.planner.reach import cuts_stages, is_tied, keeps_tie_whole, tie_crosses_stages
from nbtrain.planner.search_space import SearchOptions, Task, tasks
from nbtrain.profiler.hardware import Cluster
from nbtrain.profiler.result import QUANTITIES, ModelProfile


class _Solver:
    """Everything one task needs: per-layer cost arrays, cached stage frontiers, the partition."""

    def __init__(self, model: CostModel, task: Task, budget: float, kinds: list[int], grid: float,
                 forced: dict[int, int] | None = None):
        self.model, self.task, self.budget, self.grid = model, task, budget, grid
        self.forced = forced or {}
        """Layer index → the one strategy index it must take (a tied embedding and head share one)."""
        self.profile = model.profile
        self.kind = kinds  # layers of equal kind cost the same: they share tables and cached frontiers
        reps = {k: kinds.index(k) for k in sorted(set(kinds))}
        m = task.microbatches
        self.costs = {k: [model.layer(i, s, m, task.pp) for s in task.space] for k, i in reps.items()}
        layouts = [task.space[list(task.layout_of).index(c)] for c in range(len(task.layouts))]
        self.relayout = {k: np.array([[model.relayout(i, a, b, m) for b in layouts] for a in layouts])
                         for k, i in reps.items()}
        self.p2p = {k: np.array([[model.p2p(i, s, m, task.pp, stage) for s in layouts] for stage in range(task.pp)])
                    for k, i in reps.items()}
        self.time = {k: np.array([c.time.total for c in v]) for k, v in self.costs.items()}
        self.transient = {k: np.array([c.transient for c in v]) for k, v in self.costs.items()}
        self.allowed = self._host_fits()
        self.useful = {k: self._undominated(k) for k in self.costs}
        self.lower_bound = self._lower_bound()
        self._cache: dict = {}

    def _lower_bound(self) -> float:
        """A bound no plan of this task can beat: Lagrangian relaxation of the memory limit.

        Dropping re-layouts, transfers and transients (all ≥ 0) and replacing each stage's memory limit by one on
        the total (≤ pp × budget, with one micro-batch in flight) only enlarges the set of plans; for any λ ≥ 0,
        ``Σ_layers min_j (t_j + λ·m_j) − λ·pp·budget`` then bounds the sum of stage times from below.
        """
        lambdas = np.concatenate([[0.0], np.geomspace(1e-15, 1e-6, 40)])  # seconds per byte
        bound = np.full(len(lambdas), -lambdas * self.task.pp * self.budget)
        best = {}
        for i, k in enumerate(self.kind):
            res, time = self.resident(k, 1), self.time[k]
            if i in self.forced:  # a layer with one allowed strategy contributes exactly that strategy
                j = self.forced[i]
                bound += time[j] + lambdas * res[j]
                continue
            if k not in best:
                best[k] = np.min(time[None, :] + lambdas[:, None] * res[None, :], axis=1)
            bound += best[k]
        per_microbatch = max(float(bound.max()), 0.0)
        return per_microbatch * (1 + (self.task.microbatches - 1) / self.task.pp)

    def _host_fits(self) -> np.ndarray:
        """Strategies that fit the host memory even in the worst case.

        Offloaded optimizer state adds up over a stage's layers in host memory. Rather than carry host memory as a
        third resource through the frontier, strategies are admitted from the least host-hungry up (by host bytes
        per byte of optimizer state: the offloaded fraction over the shard degree, 0 without offload) while every
        layer taking its most host-hungry admitted strategy still fits: exact whenever the host is not the limit
        (hosts have far more memory than devices), and never a plan over the host's memory when it is. (Admitting
        a whole offload level at once, as before, refused ZeRO-3 offload over 8 devices because DDP's unsharded
        offload at that level would not fit.)
        """
        host = {k: np.array([c.host_bytes for c in v]) for k, v in self.costs.items()}
        share = np.array([s.offload / s.dp_shard for s in self.task.space])
        allowed = share == 0
        for t in np.unique(share[share > 0]):
            admitted = share <= t
            worst = sum(float(host[k][admitted].max()) for k in self.kind)
            if worst > self.model.host_budget:
                break
            allowed = admitted
        return allowed

    def _undominated(self, kind: int) -> np.ndarray:
        """Strategies of a layer kind that no other strategy of the same layout beats in every cost (resident
        memory, activations, transient, time); removing the others cannot change the optimum."""
        costs = self.costs[kind]
        crit = np.array([[c.memory.total - c.activations, c.activations, c.transient, c.time.total] for c in costs])
        lay = self.task.layout_of
        keep = []
        for j in np.flatnonzero(self.allowed):
            no_worse = self.allowed & (lay == lay[j]) & np.all(crit <= crit[j], axis=1)
            better = np.any(crit < crit[j], axis=1) | (np.arange(len(costs)) < j)  # ties: keep the first
            if not np.any(no_worse & better):
                keep.append(j)
        return np.array(keep)

    def resident(self, kind, in_flight: int) -> np.ndarray:
        key = (kind, in_flight)
        if key not in self.task.tables:
            self.task.tables[key] = np.array([c.resident(in_flight) for c in self.costs[kind]])
        return self.task.tables[key]

    def frontier(self, start: int, end: int, in_flight: int) -> Frontier:
        """Pareto frontier of the stage holding layers ``[start, end)``, cached by the layers' kinds."""
        key = (tuple(self.kind[start:end]), in_flight)
        if key in self._cache:
            return self._cache[key]
        prev = Frontier.start() if end - start == 0 else self.frontier(start, end - 1, in_flight)
        if end - start == 0:
            self._cache[key] = prev
            return prev
        k = self.kind[end - 1]
        use = np.array([self.forced[end - 1]]) if end - 1 in self.forced else self.useful[k]
        result = prev.extend(self.resident(k, in_flight)[use], self.transient[k][use], self.time[k][use],
                             self.task.layout_of[use], self.relayout[k], self.budget, self.grid, use)
        self._cache[key] = result
        return result

    def stage_best(self, start: int, end: int, stage: int) -> tuple[float, int]:
        """(time per micro-batch, point index) of the fastest fitting plan for ``stage`` over layers
        ``[start, end)``, or (inf, -1)."""
        f = self.frontier(start, end, self.in_flight(stage))
        if len(f) == 0 or f.previous is None:
            return np.inf, -1
        last = stage == self.task.pp - 1
        t = f.time + (0.0 if last else self.p2p[self.kind[end - 1]][stage][f.layout]) + \
            (self.model.schedule_overhead() if self.task.pp > 1 else 0.0)
        i = int(np.argmin(t))
        return float(t[i]), i

    def in_flight(self, stage: int) -> int:
        return self.model.in_flight(stage, self.task.pp, self.task.microbatches, self.task.schedule)

    def solve(self) -> tuple[float, list[tuple[int, int]], list[int]] | None:
        """Best (step time, stage ranges, strategy index per layer), or None when nothing fits."""
        n, pp, m = len(self.profile.layers), self.task.pp, self.task.microbatches
        # T[i][a][e]: best time of stage i over layers [a, e)
        T = np.full((pp, n + 1, n + 1), np.inf)
        for i in range(pp):
            for a in ([0] if i == 0 else range(i, n - (pp - 1 - i))):
                ends = [n] if i == pp - 1 else range(a + 1, n - (pp - 2 - i))
                for e in ends:
                    T[i, a, e] = self.stage_best(a, e, i)[0]
        taus = np.unique(T[np.isfinite(T)])
        if len(taus) == 0:
            return None
        # best[a]: over τ, the least sum of stage times of stages 0..i ending at a, every stage time ≤ τ
        best = np.where(T[0, 0, :, None] <= taus[None, :], T[0, 0, :, None], np.inf)  # (n+1, τ)
        choice = []
        for i in range(1, pp):
            allowed = np.where(T[i, :, :, None] <= taus[None, None, :], T[i, :, :, None], np.inf)  # (a, e, τ)
            total = best[:, None, :] + allowed
            choice.append(np.argmin(total, axis=0))  # (e, τ) → a
            best = np.min(total, axis=0)
        objective = best[n] + (m - 1) * taus
        j = int(np.argmin(objective))
        if not np.isfinite(objective[j]):
            return None
        bounds = [n]
        for i in range(pp - 1, 0, -1):
            bounds.append(int(choice[i - 1][bounds[-1], j]))
        bounds.append(0)
        ranges = list(zip(bounds[::-1][:-1], bounds[::-1][1:]))
        chosen: list[int] = []
        for i, (a, e) in enumerate(ranges):
            _, point = self.stage_best(a, e, i)
            chosen += self.frontier(a, e, self.in_flight(i)).strategies(point)
        return float(objective[j]), ranges, chosen


def _allowed(profile: ModelProfile, options: SearchOptions) -> SearchOptions:
    """The options as the search applies them: one stage for a model the executor does not cut into stages, or
    whose tied embedding and head it keeps whole; no offload where the executor does not offload the model."""
    if keeps_tie_whole(profile) and not tie_crosses_stages(profile) or not cuts_stages(profile):
        options = replace(options, pp_degrees=(1,))
    if profile.arch.get("no_offload"):
        options = replace(options, offload_levels=(0.0,))
    return options


def _solvers(model: CostModel, options: SearchOptions, budget: float, grid: float,
             mixed: bool = True) -> list[_Solver]:
    """One solver per task the search may take; a tied embedding and head get one per strategy they may share
    (no TP: the executor keeps the shared weight whole, in one FSDP group)."""
    profile = model.profile
    kinds = layer_kinds(profile)
    out = []
    for task in tasks(model, _allowed(profile, options), mixed):
        if not is_tied(profile):
            out.append(_Solver(model, task, budget, kinds, grid))
            continue
        last = len(profile.layers) - 1
        shared = [j for j, s in enumerate(task.space) if s.tp == 1 or not keeps_tie_whole(profile)]
        candidates = [_Solver(model, task, budget, kinds, grid, forced={0: j, last: j}) for j in shared]
        out += [c for c in candidates if c.allowed[c.forced[0]]]  # its offload level must fit the host
    return out


def search(profile: ModelProfile, cluster: Cluster, *, global_batch: int, seq_len: int | None = None,
           memory: float | None = None, top: int = 3, options: SearchOptions = SearchOptions(),
           cost_options: CostOptions = CostOptions()) -> list[Plan]:
    """The ``top`` fastest distinct plans that fit, each with ``predicted`` set, best first."""
    model = CostModel(profile, cluster, global_batch=global_batch, seq_len=seq_len, budget_bytes=memory,
                      options=cost_options)
    budget = model.budget - model.reserve
    found: list[tuple[float, Plan]] = []
    kinds = layer_kinds(profile)
    if budget <= 0:  # the reserve alone fills the budget: nothing fits (recommend.py says so)
        return []
    grid = budget / options.memory_grid if options.memory_grid else 0.0
    # offload mixed with TP only where nothing fits without the mix: their union is ~3x the search's work
    for mixed in (False, True):
        if not found:
            _solve(model, _solvers(model, options, budget, grid, mixed), found, top, kinds, global_batch)
    return [plan for _, plan in found[:top]]


def _solve(model: CostModel, solvers: list[_Solver], found: list, top: int, kinds: list[int],
           global_batch: int) -> None:
    """Solve ``solvers``' tasks into ``found`` (step time, plan), fastest first, until no task can beat the ``top``
    found: tasks are visited by a lower bound on their step time (no memory limit, no re-layouts or transfers)."""
    profile, cluster = model.profile, model.cluster
    solvers.sort(key=lambda solver: solver.lower_bound)
    for solver in solvers:
        if len(found) >= top and solver.lower_bound >= found[top - 1][0]:
            break
        task = solver.task
        solved = solver.solve()
        if solved is None:
            continue
        _, ranges, chosen = solved
        chosen = _tidy(chosen, task, kinds, ranges)
        plan = Plan(num_devices=cluster.num_devices, layers=one_expert_degree(profile, [task.space[j] for j in chosen]),
                    pp=task.pp, microbatches=task.microbatches, schedule=task.schedule,
                    stages=tuple(e - a for a, e in ranges), global_batch=global_batch,
                    seq_len=model.seq_len, model=profile.model)
        prediction = model.estimate(plan)
        if any(plan == other for _, other in found):
            continue
        found.append((prediction.step_time_s, plan.replace(predicted=prediction)))
        found.sort(key=lambda x: x[0])


def layer_kinds(profile: ModelProfile) -> list[int]:
    """A small id per layer; two layers share it when their costs are equal under every strategy: the same
    profiled costs and the same input size (what TP collectives and re-layouts move)."""
    def signature(i: int):
        layer = profile.layers[i]
        input_size = profile.layers[i - 1].scaling["output_bytes"].coeffs if i else None
        costs = tuple(layer.scaling[q].coeffs for q in QUANTITIES if q in layer.scaling)
        return layer.kind, layer.params, costs, input_size
    ids: dict = {}
    return [ids.setdefault(signature(i), len(ids)) for i in range(len(profile.layers))]


def one_expert_degree(profile: ModelProfile, layers: list) -> tuple:
    """``layers`` with the layers that hold no experts given the experts' ``ep`` (the most common one), where it
    divides their dp, else 1: they run and cost the same under any ``ep``, so the search may return any, and one
    degree throughout reads as one strategy (``dp_shard=8 ep=8``)."""
    per_layer = profile.arch.get("layer_expert_params") or ()
    spread = [s.ep for i, s in enumerate(layers) if i < len(per_layer) and per_layer[i]]
    ep = max(sorted(set(spread)), key=spread.count) if spread else 1
    return tuple(s if i < len(per_layer) and per_layer[i] else replace(s, ep=ep if s.dp % ep == 0 else 1)
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
    model = CostModel(profile, cluster, global_batch=global_batch, seq_len=seq_len, budget_bytes=memory,
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
            chosen += stage_best[1]
        plan = Plan(num_devices=cluster.num_devices, layers=one_expert_degree(profile, [task.space[j] for j in chosen]),
                    pp=task.pp, microbatches=task.microbatches, schedule=task.schedule, global_batch=global_batch,
                    seq_len=model.seq_len, model=profile.model)
        prediction = model.estimate(plan)
        key = (prediction.memory_bytes, max(stage.host_bytes for stage in prediction.stages))
        if best is None or key < best[0]:
            best = key, plan.replace(predicted=prediction)
    return None if best is None else best[1]
