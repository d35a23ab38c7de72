"""The cost side of :func:`nbtrain.planner.switching.buckets.plan_buckets`: what a hot switch costs, what each bucket costs
under every strategy, and the search for the fastest home strategy and grouping of the other buckets.

    >>> costs = SwitchingCostModel(profile, cluster, None, BucketOptions())
    >>> best = fastest(costs, [costs.bucket(4096, 48), costs.bucket(32768, 2)])
    >>> best.seconds, [str(costs.space[j]) for j in best.strategies]
    >>> switch_cost("weights", Strategy(dp_shard=2, tp=4), Strategy(dp_replicate=8), params=6.74e9,
    ...             bytes_per_param=2, cluster=Cluster.from_catalog("A100", num_devices=8)).bytes
    11795000000.0

**A switch** (HotSPa) moves the parameters from one layout to another; the model, stated so that the executor's
measurement (:class:`nbtrain.run.switching.reshard.Resharding` counts the bytes each rank receives) can stand beside it:

* Under a strategy ``S`` a rank holds ``1 / (S.dp_shard × S.tp)`` of every parameter (replicated over
  ``dp_replicate``): FSDP2 and TP each cut a tensor into equal contiguous chunks.
* A rank keeps what it already holds when its chunk under one layout lies inside its chunk under the other: then
  it reuses ``min(held_A, held_B)``. Otherwise nothing is counted as reused (a conservative bound).
* On the mesh ``dp_replicate × dp_shard × tp`` (tp innermost, as :mod:`nbtrain.run.parallel.mesh` lays it out) a rank's chunk
  index along its split is ``rank mod (dp_shard × tp)``, so chunks nest *for every rank* only when both layouts
  split the same way, or when one of them holds the whole tensor. Chunks of different sizes never do: rank 1 holds
  ``[1/2, 1)`` of a tensor under ``dp_shard=2`` and ``[1/4, 1/2)`` under ``dp_shard=4``. A switch is as slow as its
  slowest rank, so the bytes counted are that rank's.
* Bytes received per rank = Σ params × bytes per element × (held_B − reused); seconds = bytes / the link bandwidth
  of the ``D`` devices (intra-node when they share a node, else inter-node), point to point, not overlapped.

**Choosing strategies** for buckets is a facility-location problem: each strategy other than the home costs its
switches and one gradient sync once, however many buckets use it. Its optimum partitions the buckets into groups,
one strategy each, so a dynamic program over the subsets of the non-home buckets (3^(n−1) steps, every home strategy
at once as numpy arrays) finds it exactly. The step-time and memory models are in :mod:`nbtrain.planner.switching.buckets`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from nbtrain.planner.cost import CostModel, Memory
from nbtrain.planner.search import layer_kinds
from nbtrain.planner.strategy import Strategy, strategy_space
from nbtrain.profiler.hardware import Cluster
from nbtrain.profiler.result import ModelProfile
from nbtrain.units import format_bytes, format_seconds


def padded_rows(rows: int, dp: int) -> int:
    """Rows a bucket runs under ``dp`` data-parallel ranks: ``rows`` padded with empty ones to a multiple of ``dp``
    (as :mod:`nbtrain.run.switching.hot` pads them), each computed like a full row: ``padded_rows(55, 8) == 56``."""
    return -(-rows // dp) * dp


def held_fraction(s: Strategy) -> float:
    """The fraction of every parameter one rank holds under ``s``: ``1 / (dp_shard × tp)``."""
    return 1.0 / (s.dp_shard * s.tp)


def reused_fraction(a: Strategy, b: Strategy) -> float:
    """The fraction of every parameter that every rank holds under both ``a`` and ``b`` (module docstring)."""
    if (a.dp_shard, a.tp) == (b.dp_shard, b.tp):  # the same chunks on the same ranks (ac or ZeRO level aside)
        return held_fraction(a)
    if held_fraction(a) == 1.0 or held_fraction(b) == 1.0:  # a whole tensor contains any chunk of it
        return min(held_fraction(a), held_fraction(b))
    return 0.0


def received_fraction(a: Strategy, b: Strategy) -> float:
    """The fraction of every parameter a rank must receive to go from layout ``a`` to layout ``b``."""
    return held_fraction(b) - reused_fraction(a, b)


def link_bandwidth(cluster: Cluster) -> float:
    """Bytes/s per device of the links a switch over all the cluster's devices uses."""
    if cluster.num_devices <= cluster.devices_per_node:
        return cluster.intra_node_bandwidth
    return cluster.inter_node_bandwidth


@dataclass(frozen=True)
class PredictedSwitch:
    """One re-layout per step, as the planner predicts it."""

    what: str
    """``"weights"`` (the compute copy, home → strategy) or ``"gradients"`` (accumulated, strategy → home)."""
    source: Strategy
    target: Strategy
    bytes: float
    """Bytes the slowest rank receives."""
    seconds: float

    def __str__(self) -> str:
        return (f"{self.what} '{self.source}' → '{self.target}': {format_bytes(self.bytes)} per device, "
                f"{format_seconds(self.seconds)}")


def switch_cost(what: str, source: Strategy, target: Strategy, *, params: float, bytes_per_param: float,
                cluster: Cluster) -> PredictedSwitch:
    """The predicted switch of ``params`` parameters of ``bytes_per_param`` bytes from ``source`` to ``target``."""
    nbytes = params * bytes_per_param * received_fraction(source, target)
    return PredictedSwitch(what, source, target, nbytes, nbytes / link_bandwidth(cluster))


@dataclass(frozen=True)
class BucketCost:
    """One bucket under every strategy of the space (arrays indexed like it), each priced at its rows padded with
    empty ones to a multiple of the strategy's dp (:func:`padded_rows`)."""

    bound: int
    rows: int
    """The bucket's own rows (its tokens are ``bound × rows``); the padded ones are priced, not counted."""
    passes: np.ndarray
    """Forward and backward seconds: Σ layers compute + tp_comm + zero3_comm."""
    sync: np.ndarray
    """Gradient-sync seconds left over after overlapping this bucket's backward: Σ layers dp_comm."""
    activations: np.ndarray
    transient: np.ndarray
    """The largest transient of its layers."""


@dataclass(frozen=True)
class Assignment:
    seconds: float
    """Step time: passes, syncs, switches and the update."""
    home: int
    strategies: list[int]
    """Index into the space, per bucket (the last is ``home``)."""


class SwitchingCostModel:
    """The cost model over the strategy space: model states, update and switches per strategy; costs per bucket."""

    def __init__(self, profile: ModelProfile, cluster: Cluster, budget: float | None, options):
        self.profile, self.cluster, self.options, self._budget = profile, cluster, options, budget
        heads = profile.arch.get("n_kv_head") or profile.arch.get("n_head")
        unit = profile.arch.get("tp_unit")  # every split dimension divides by tp (nbtrain.models.description)
        # one strategy for every layer: a tied embedding and head keep the shared weight unsplit by TP (search.py)
        tied = len(profile.layers) > 1 and bool(profile.layers[-1].tied)
        self.no_tp = profile.arch.get("no_tensor_parallel") or ("a tied embedding and head" if tied else "")
        """Why tensor parallelism is ruled out, or empty."""
        self.space: list[Strategy] = [
            s for s in strategy_space(cluster.num_devices, devices_per_node=cluster.devices_per_node,
                                      max_tp=1 if self.no_tp else options.max_tp, allow_ac=options.allow_ac,
                                      zero_levels=options.zero_levels)
            if s.tp == 1 or ((not heads or heads % s.tp == 0) and (not unit or unit % s.tp == 0))]
        kinds = layer_kinds(profile)  # layers of one kind cost the same under every strategy
        self.kinds = [(kinds.index(k), kinds.count(k)) for k in sorted(set(kinds))]  # (representative, count)
        probe = self.model(cluster.num_devices, profile.seq_len)
        self.budget, self.reserve = probe.budget, probe.reserve
        self.states = [self._states(probe, s) for s in self.space]
        """Per strategy: Σ layers params, grads, optimizer — what the home layout holds all step."""
        self.update = np.array([sum(n * probe.layer(i, s, 1).time.update for i, n in self.kinds)
                                for s in self.space])
        self.home_states = np.array([m.total for m in self.states])
        self.copy = np.array([m.params + m.grads for m in self.states])
        params = sum(layer.params for layer in profile.layers)
        e, g = profile.dtype_bytes, options.cost.grad_reduce_bytes
        self.switches = {(h, s): (switch_cost("weights", h, s, params=params, bytes_per_param=e, cluster=cluster),
                                  switch_cost("gradients", s, h, params=params, bytes_per_param=g, cluster=cluster))
                         for h in self.space for s in self.space if h != s}
        self.switch_s = np.array([[sum(x.seconds for x in self.switches[h, s]) if h != s else 0.0
                                   for s in self.space] for h in self.space])
        """[home, strategy]: seconds of both switches per step."""

    @lru_cache(maxsize=None)
    def model(self, rows: int, bound: int) -> CostModel:
        return CostModel(self.profile, self.cluster, global_batch=rows, seq_len=bound, budget_bytes=self._budget,
                         options=self.options.cost)

    def _states(self, model: CostModel, s: Strategy) -> Memory:
        total = Memory()
        for i, n in self.kinds:
            m = model.layer(i, s, 1).memory
            total = total + Memory(params=n * m.params, grads=n * m.grads, optimizer=n * m.optimizer)
        return total

    @lru_cache(maxsize=None)
    def bucket(self, bound: int, rows: int) -> BucketCost:
        size = len(self.space)
        passes, sync, act, transient = np.zeros(size), np.zeros(size), np.zeros(size), np.zeros(size)
        for j, s in enumerate(self.space):
            # the executor pads the bucket with empty rows to a multiple of dp, and computes them: priced as full
            model = self.model(padded_rows(rows, s.dp), bound)
            costs = [(model.layer(i, s, 1), n) for i, n in self.kinds]
            passes[j] = sum(n * (c.time.compute + c.time.tp_comm + c.time.zero3_comm) for c, n in costs)
            sync[j] = sum(n * c.time.dp_comm for c, n in costs)
            act[j] = sum(n * c.memory.activations for c, n in costs)
            transient[j] = max(c.transient for c, _ in costs)
        return BucketCost(bound, rows, passes, sync, act, transient)

    def home_memory(self, b: BucketCost) -> np.ndarray:
        """Per strategy: the bucket run under it as the home (equals CostModel.estimate of the uniform plan)."""
        return self.reserve + self.home_states + b.activations + b.transient

    def away_memory(self, b: BucketCost) -> np.ndarray:
        """[home, strategy]: the bucket run under ``strategy`` while the ``home`` layout holds its states."""
        return self.reserve + self.home_states[:, None] + (self.copy + b.activations + b.transient)[None, :]

    def bucket_memory(self, b: BucketCost, home: int, strategy: int) -> Memory:
        """What :meth:`home_memory` / :meth:`away_memory` add up, by category."""
        own = Memory(activations=b.activations[strategy], transient=b.transient[strategy], reserve=self.reserve)
        if strategy == home:
            return self.states[home] + own
        away = self.states[strategy]
        return self.states[home] + own + Memory(params=away.params, grads=away.grads)


def fastest(costs: SwitchingCostModel, buckets: list[BucketCost]) -> Assignment | None:
    """The fastest home strategy and strategy per bucket (shortest first; the last is the home), or None."""
    size = len(costs.space)
    everyone = np.arange(size)
    last = buckets[-1]
    fits = costs.home_memory(last) <= costs.budget
    base = np.where(fits, last.passes + last.sync + costs.update, np.inf)  # (home,)
    others = buckets[:-1]
    # passes[k][home, strategy]: inf where bucket k does not fit under it beside the home's states
    passes = []
    for b in others:
        fits = costs.away_memory(b) <= costs.budget
        fits[everyone, everyone] = costs.home_memory(b) <= costs.budget
        passes.append(np.where(fits, b.passes[None, :], np.inf))
    m = len(others)
    group_time, group_strategy = {}, {}
    for mask in range(1, 2**m):
        members = [k for k in range(m) if mask >> k & 1]
        t = sum(passes[k] for k in members)
        # away from home: its switches and one sync after its last (longest) bucket; at home the home bucket syncs
        away = t + others[members[-1]].sync[None, :] + costs.switch_s
        away[everyone, everyone] = np.inf
        j = np.argmin(away, axis=1)
        stay = t[everyone, everyone] <= away[everyone, j]  # no pointless switch on a tie
        group_time[mask] = np.where(stay, t[everyone, everyone], away[everyone, j])
        group_strategy[mask] = np.where(stay, everyone, j)
    best, choice = {0: np.zeros(size)}, {}
    for mask in range(1, 2**m):  # partitions of `mask` into groups: the group of its lowest bucket, then the rest
        low, rest = mask & -mask, mask & ~(mask & -mask)
        best[mask], choice[mask] = np.full(size, np.inf), np.zeros(size, dtype=int)
        sub = rest
        while True:
            g = sub | low
            t = group_time[g] + best[mask ^ g]
            better = t < best[mask]
            best[mask], choice[mask] = np.where(better, t, best[mask]), np.where(better, g, choice[mask])
            if sub == 0:
                break
            sub = (sub - 1) & rest
    total = base + best[2**m - 1]
    home = int(np.argmin(total))
    if not np.isfinite(total[home]):
        return None
    strategies, mask = [home] * len(buckets), 2**m - 1
    while mask:
        g = int(choice[mask][home])
        for k in range(m):
            if g >> k & 1:
                strategies[k] = int(group_strategy[g][home])
        mask ^= g
    return Assignment(float(total[home]), home, strategies)


def fastest_single_strategy(costs: SwitchingCostModel, buckets: list[BucketCost]) -> tuple[float, int] | None:
    """(step time, strategy index) of the fastest single strategy that runs every bucket within the budget."""
    total = costs.update + buckets[-1].sync  # one sync, overlapped with the last (longest) bucket
    for b in buckets:
        total = np.where(costs.home_memory(b) <= costs.budget, total + b.passes, np.inf)
    j = int(np.argmin(total))
    return (float(total[j]), j) if np.isfinite(total[j]) else None
