"""One sub-problem of the search (a pipeline degree, micro-batch count, schedule and strategy space), solved exactly.

:func:`nbtrain.planner.search.search` makes one :class:`Solver` per task (``Solver(model, task, budget, kinds,
grid)``) and asks it for bounds (:attr:`Solver.lower_bound`, :meth:`Solver.bounds`) and for its best plan
(:meth:`Solver.solve`: the step, the stage ranges, a strategy index per layer).

Per layer kind, the strategies' costs are priced once per task (:class:`TaskTables`, kept with the model's shared
price table, so a second search of the same task, the tied variants of one and the explorer's next replan take
them as they are); per stage, :mod:`.frontier` keeps the Pareto set of partial plans; the stage boundaries come from
:func:`~nbtrain.planner.partition.best_partition`. Before any stage is priced, a lower bound of every stage's time
over every range (Lagrangian relaxation of its memory limit) bounds every partition through that range; a range
whose bound exceeds a step already known (one partition of this task priced first, or the search's ``top``-th
plan) is not priced, and the answer is the same: every partition at most that step keeps all its ranges.
"""

from __future__ import annotations

import numpy as np

from nbtrain.planner.cost import CostModel
from nbtrain.planner.frontier import Frontier
from nbtrain.planner.partition import best_partition, partition_bounds
from nbtrain.planner.search_space import Task

LAMBDAS = np.concatenate([[0.0], np.geomspace(1e-15, 1e-6, 40)])
"""Prices of memory, in seconds per byte, at which the Lagrangian bounds are taken."""
SAFETY = 1e-9
"""Relative margin by which a bound must exceed a known step to prune: bounds and steps add in other orders."""


class PerKind(dict):
    """A table by layer kind whose entries are made the first time they are read."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def __missing__(self, kind):
        value = self[kind] = self.make(kind)
        return value


class TaskTables:
    """A task's costs per layer kind and strategy, what its solvers (one per tied strategy) share. Each kind's
    is priced when first read: a task the search rules out by its blocks' costs alone never prices the others."""

    def __init__(self, model: CostModel, task: Task, kinds: list[int]):
        reps = {k: kinds.index(k) for k in sorted(set(kinds))}
        m, pp = task.microbatches, task.pp
        layouts = [task.space[list(task.layout_of).index(c)] for c in range(len(task.layouts))]
        self.model, self.task, self.kinds = model, task, kinds
        self.costs = PerKind(lambda k: [model.layer(reps[k], s, m, pp) for s in task.space])
        self.time = PerKind(lambda k: np.array([c.time.total for c in self.costs[k]]))
        self.transient = PerKind(lambda k: np.array([c.transient for c in self.costs[k]]))
        self.relayout = PerKind(lambda k: np.array([[model.relayout(reps[k], a, b, m) for b in layouts]
                                                    for a in layouts]))
        self.p2p = PerKind(lambda k: np.array([[model.p2p(reps[k], s, m, pp, stage) for s in layouts]
                                               for stage in range(pp)]))
        self.useful = PerKind(lambda k: _undominated(task, self.costs[k], self.allowed))
        self.residents: dict = {}
        self._allowed = None

    @property
    def allowed(self) -> np.ndarray:
        if self._allowed is None:
            self._allowed = _host_fits(self.model, self.task, self.kinds, self.costs)
        return self._allowed


def task_tables(model: CostModel, task: Task, kinds: list[int]) -> TaskTables:
    """``task``'s tables, from the model's shared price table when a solver of the same task made them."""
    shared = getattr(model, "table", None)
    key = ("tables", task.pp, task.microbatches, tuple(task.space), tuple(kinds), model.host_budget)
    if shared is None:
        return TaskTables(model, task, kinds)
    if key not in shared.solved:
        shared.solved[key] = TaskTables(model, task, kinds)
    return shared.solved[key]


def _host_fits(model: CostModel, task: Task, kinds: list[int], costs: dict) -> np.ndarray:
    """Strategies that fit the host memory even in the worst case.

    Offloaded optimizer state adds up over a stage's layers in host memory. Rather than carry host memory as a
    third resource through the frontier, strategies are admitted from the least host-hungry up (by host bytes
    per byte of optimizer state: the offloaded fraction over the shard degree, 0 without offload) while every
    layer taking its most host-hungry admitted strategy still fits: exact whenever the host is not the limit
    (hosts have far more memory than devices), and never a plan over the host's memory when it is. (Admitting
    a whole offload level at once, as before, refused ZeRO-3 offload over 8 devices because DDP's unsharded
    offload at that level would not fit.)
    """
    host = {k: np.array([c.host_bytes for c in costs[k]]) for k in set(kinds)}
    share = np.array([s.offload / s.dp_shard for s in task.space])
    allowed = share == 0
    for t in np.unique(share[share > 0]):
        admitted = share <= t
        worst = sum(float(host[k][admitted].max()) for k in kinds)
        if worst > model.host_budget:
            break
        allowed = admitted
    return allowed


def _undominated(task: Task, costs: list, allowed: np.ndarray) -> np.ndarray:
    """Strategies of a layer kind that no other strategy of the same layout beats in every cost (resident
    memory, activations, transient, time); removing the others cannot change the optimum. ``beats[i, j]``: ``i``
    is allowed, of ``j``'s layout, no worse in any cost, and better in one (of equal ones, the first is kept)."""
    crit = np.array([[c.memory.total - c.activations, c.activations, c.transient, c.time.total] for c in costs])
    lay, first = task.layout_of, np.arange(len(costs))
    no_worse = np.all(crit[:, None, :] <= crit[None, :, :], axis=2)
    better = np.any(crit[:, None, :] < crit[None, :, :], axis=2) | (first[:, None] < first[None, :])
    beats = allowed[:, None] & (lay[:, None] == lay[None, :]) & no_worse & better
    return np.flatnonzero(allowed & ~beats.any(axis=0))


class Solver:
    """Everything one task needs: per-layer cost arrays, cached stage frontiers, bounds, the partition."""

    prune = True
    """Skip the ranges and tasks the bounds rule out (False: price them all, the same answers, for the tests)."""

    def __init__(self, model: CostModel, task: Task, budget: float, kinds: list[int], grid: float,
                 forced: dict[int, int] | None = None):
        self.model, self.task, self.budget, self.grid = model, task, budget, grid
        self.forced = forced or {}
        """Layer index → the one strategy index it must take (a tied embedding and head share one)."""
        self.profile = model.profile
        self.kind = kinds  # layers of equal kind cost the same: they share tables and cached frontiers
        self.tables = t = task_tables(model, task, kinds)
        self.costs, self.time, self.transient, self.relayout, self.p2p = t.costs, t.time, t.transient, t.relayout, t.p2p
        self.useful = t.useful
        self._cache: dict = {}
        self._bounds = self._lower = None

    @property
    def allowed(self) -> np.ndarray:
        """Which strategies of the space fit the host memory (:func:`_host_fits`)."""
        return self.tables.allowed

    @property
    def lower_bound(self) -> float:
        """A bound no plan of this task can beat: Lagrangian relaxation of the memory limit.

        Dropping re-layouts, transfers and transients (all ≥ 0) and replacing each stage's memory limit by one on
        the total (≤ pp × budget, with one micro-batch in flight) only enlarges the set of plans; for any λ ≥ 0,
        ``Σ_layers min_j (t_j + λ·m_j) − λ·pp·budget`` then bounds the sum of stage times from below.
        """
        if self._lower is None:
            self._lower = self._lagrangian(range(len(self.kind)))
        return self._lower

    def partial_bound(self) -> float:
        """:attr:`lower_bound` from the most common layer kind alone (the blocks), which only the blocks' prices
        give: at most it (every layer's term is ≥ 0), to visit tasks in its order without pricing them all."""
        common = max(set(self.kind), key=self.kind.count)
        return self._lagrangian([i for i, k in enumerate(self.kind) if k == common and i not in self.forced]) * \
            (1 - SAFETY)

    def _lagrangian(self, layers) -> float:
        lambdas = LAMBDAS
        bound = np.full(len(lambdas), -lambdas * self.task.pp * self.budget)
        best = {}
        for i in layers:
            k = self.kind[i]
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

    def resident(self, kind, in_flight: int) -> np.ndarray:
        key = (kind, in_flight)
        if key not in self.tables.residents:
            self.tables.residents[key] = np.array([c.resident(in_flight) for c in self.costs[kind]])
        return self.tables.residents[key]

    def options(self, layer: int) -> np.ndarray:
        """The strategies layer ``layer`` may take in a stage: the one it is forced to, or its kind's useful ones."""
        return np.array([self.forced[layer]]) if layer in self.forced else self.useful[self.kind[layer]]

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
        use = self.options(end - 1)
        result = prev.extend(self.resident(k, in_flight)[use], self.transient[k][use], self.time[k][use],
                             self.task.layout_of[use], self.relayout[k], self.budget, self.grid, use)
        self._cache[key] = result
        return result

    def _sent(self, end: int, stage: int) -> np.ndarray | None:
        """Seconds per micro-batch a stage ending at ``end`` spends sending its output on, by the last layer's
        layout (None for the last stage)."""
        return None if stage == self.task.pp - 1 else self.p2p[self.kind[end - 1]][stage]

    def _overhead(self) -> float:
        return self.model.schedule_overhead() if self.task.pp > 1 else 0.0

    def stage_time(self, start: int, end: int, stage: int) -> float:
        """The time per micro-batch of the fastest fitting plan for ``stage`` over ``[start, end)``, or inf: what
        :meth:`stage_best` finds, from the frontier's fastest plan per last layout (a sum rounds monotonically, so
        the least of the sums is the sum of the least)."""
        f = self.frontier(start, end, self.in_flight(stage))
        if len(f) == 0 or f.previous is None:
            return np.inf
        fastest, sent = f.fastest_by_layout(len(self.task.layouts)), self._sent(end, stage)
        return float(np.min((fastest if sent is None else fastest + sent) + self._overhead()))

    def stage_best(self, start: int, end: int, stage: int) -> tuple[float, int]:
        """(time per micro-batch, point index) of the fastest fitting plan for ``stage`` over layers
        ``[start, end)``, or (inf, -1)."""
        f = self.frontier(start, end, self.in_flight(stage))
        if len(f) == 0 or f.previous is None:
            return np.inf, -1
        sent = self._sent(end, stage)
        t = f.time + (0.0 if sent is None else sent[f.layout]) + self._overhead()
        i = int(np.argmin(t))
        return float(t[i]), i

    def in_flight(self, stage: int) -> int:
        return self.model.in_flight(stage, self.task.pp, self.task.microbatches, self.task.schedule)

    def ranges(self) -> list[tuple[int, int, int]]:
        """Every (stage, first layer, end) a partition may give, stage by stage."""
        n, pp = len(self.profile.layers), self.task.pp
        return [(i, a, e) for i in range(pp) for a in self.starts(i)
                for e in ([n] if i == pp - 1 else range(a + 1, n - (pp - 2 - i)))]

    def starts(self, stage: int) -> range:
        """The first layers stage ``stage`` may take: every stage before it has one layer at least, every one
        after it too."""
        n, pp = len(self.profile.layers), self.task.pp
        return range(1) if stage == 0 else range(stage, n - (pp - 1 - stage))

    def bounds(self):
        """(a bound on this task's step, per range a bound on the steps through it, the ranges of a promising
        partition), from :meth:`stage_bounds`; computed once."""
        if self._bounds is None:
            self._bounds = partition_bounds(self.stage_bounds(), self.task.microbatches)
        return self._bounds

    def stage_bounds(self) -> np.ndarray:
        """``low[i, a, e]`` ≤ stage ``i``'s best time over ``[a, e)``: for each price of memory λ, the layers' least
        ``t_j + λ·resident_j`` summed less ``λ·budget`` (the stage's plans hold at most the budget), the best λ;
        plus what the stage pays beyond its layers at the least (its output sent on, the schedule's work)."""
        n, pp = len(self.profile.layers), self.task.pp
        low = np.full((pp, n + 1, n + 1), np.inf)
        prefixes = {}
        kinds = sorted(set(self.kind))
        for i in range(pp):
            q = self.in_flight(i)
            if q not in prefixes:
                least = {k: np.min(self.time[k][self.useful[k]][None, :] + LAMBDAS[:, None] *
                                   self.resident(k, q)[self.useful[k]][None, :], axis=1) for k in kinds}
                per_layer = np.stack([least[k] for k in self.kind], axis=1)  # (λ, layer)
                for layer, j in self.forced.items():
                    k = self.kind[layer]
                    per_layer[:, layer] = self.time[k][j] + LAMBDAS * self.resident(k, q)[j]
                prefixes[q] = np.concatenate([np.zeros((len(LAMBDAS), 1)), np.cumsum(per_layer, axis=1)], axis=1)
            prefix, starts = prefixes[q], self.starts(i)
            ends = range(n, n + 1) if i == pp - 1 else range(starts.start + 1, n - (pp - 2 - i))
            spans = prefix[:, None, ends.start:ends.stop] - prefix[:, starts.start:starts.stop, None] - \
                LAMBDAS[:, None, None] * self.budget  # (λ, first layer, end)
            sent = np.zeros(n + 1)
            if i < pp - 1:
                least_sent = {k: float(np.min(self.p2p[k][i])) for k in kinds}
                sent[1:] = [least_sent[k] for k in self.kind]
            window = np.maximum(np.max(spans, axis=0), 0.0) + sent[None, ends.start:ends.stop] + self._overhead()
            first, end = np.meshgrid(np.arange(starts.start, starts.stop), np.arange(ends.start, ends.stop),
                                     indexing="ij")
            low[i, starts.start:starts.stop, ends.start:ends.stop] = np.where(end > first, window, np.inf)
        return low * (1 - SAFETY)

    def solve(self, limit: float = np.inf) -> tuple[float, list[tuple[int, int]], list[int]] | None:
        """Best (step time, stage ranges, strategy index per layer), or None when nothing fits.

        ``limit``: a step already known elsewhere; a partition above it may be lost (the answer is then above
        ``limit`` or None, and the caller drops it), one at most ``limit`` never. An exact answer is kept with the
        model's shared price table: the same task solved again (the best plan without offload, the explorer's
        next replan) is not solved twice."""
        shared = getattr(self.model, "table", None)
        task = self.task
        key = ("solve", task.pp, task.microbatches, task.schedule, tuple(task.space), tuple(self.kind), self.budget,
               self.grid, tuple(sorted(self.forced.items())), self.model.host_budget)
        if shared is not None and key in shared.solved:
            return shared.solved[key]
        answer = self._solve(limit)
        if shared is not None and (answer[0] <= limit if answer is not None else limit == np.inf):
            shared.solved[key] = answer
        return answer

    def _solve(self, limit: float):
        n, pp, m = len(self.profile.layers), self.task.pp, self.task.microbatches
        T = np.full((pp, n + 1, n + 1), np.inf)
        if not self.prune:
            limit, through = np.inf, np.zeros_like(T)
        else:
            _, through, promising = self.bounds()
            if pp > 1 and promising is not None:  # price one partition first: no better one is pruned against it
                times = [self.stage_time(a, e, i) for i, (a, e) in enumerate(promising)]
                limit = min(limit, sum(times) + (m - 1) * max(times))
        for i, a, e in self.ranges():
            if through[i, a, e] <= limit:
                T[i, a, e] = self.stage_time(a, e, i)
        # a largest stage time τ gives a step of at least (m − 1)·τ: none above the limit's is the optimum's
        tau_limit = np.inf if m == 1 or not np.isfinite(limit) else limit / (m - 1) * (1 + SAFETY)
        found = best_partition(T, m, tau_limit)
        if found is None:
            return None
        objective, ranges = found
        chosen: list[int] = []
        for i, (a, e) in enumerate(ranges):
            _, point = self.stage_best(a, e, i)
            chosen += self.frontier(a, e, self.in_flight(i)).strategies(point)
        return objective, ranges, chosen
