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

import dataclasses
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from nbtrain.planner.cost import CostModel, Memory
from nbtrain.planner.search import layer_kinds
from nbtrain.planner.strategy import Strategy, strategy_space
from nbtrain.profiler.hardware import Cluster
from nbtrain.profiler.result import ModelProfile
from nbtrain.units import format_bytes, format_seconds


def layout(s: Strategy) -> Strategy:
    """The layout a strategy runs in: itself without checkpointing (the executor turns that on and off per bucket
    of one model)."""
    return dataclasses.replace(s, ac=False)


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


MICRO_ROWS = (None, 1, 2, 4, 8, 16, 32, 64)
"""Rows per micro-batch a bucket may run in on each rank: None, all at once; ``r``, micro-batches of ``r`` rows
(the gradients accumulated), the rank's rows padded with empty ones to a multiple of ``r`` (computed, as full
ones). The fastest that fits is taken (:func:`best_fit`)."""


@dataclass(frozen=True)
class BucketCost:
    """One bucket under every strategy of the space (columns indexed like it) and every choice of
    :data:`MICRO_ROWS` (rows), each priced at its rows padded with empty ones to a multiple of the strategy's dp
    (:func:`padded_rows`) and then of the micro-batch's rows."""

    bound: int
    rows: int
    """The bucket's own rows (its tokens are ``bound × rows``); the padded ones are priced, not counted."""
    micro_rows: np.ndarray
    """[choice, strategy]: rows per micro-batch on each rank (:func:`micro_rows_for`)."""
    microbatches: np.ndarray
    """[choice, strategy]: micro-batches per rank."""
    passes: np.ndarray
    """[choice, strategy]: forward and backward seconds of all the micro-batches: Σ layers compute + tp_comm +
    zero3_comm (FSDP2 gathers once per micro-batch)."""
    sync: np.ndarray
    """[choice, strategy]: gradient-sync seconds left over after overlapping the last micro-batch's backward: Σ
    layers dp_comm (once a step)."""
    activations: np.ndarray
    """[choice, strategy]: of one micro-batch."""
    transient: np.ndarray
    """[choice, strategy]: the largest transient of its layers."""


def micro_rows_for(choice: int | None, rows: int) -> int:
    """Rows per micro-batch for a choice of :data:`MICRO_ROWS` on a rank holding ``rows``: all of them when the
    choice is None or holds them (``micro_rows_for(4, 33) == 4``, ``micro_rows_for(64, 33) == 33``)."""
    return rows if choice is None or choice >= rows else choice


def best_fit(fits: np.ndarray, seconds: np.ndarray, microbatches: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(index of the fastest choice that fits, whether any does) along the first axis, ``seconds`` and
    ``microbatches`` broadcast to ``fits``; of choices equally fast (to rounding), the fewest micro-batches."""
    seconds = np.where(fits, np.broadcast_to(seconds, fits.shape), np.inf)
    near = seconds <= seconds.min(axis=0) * (1 + 1e-9)
    return np.argmin(np.where(near, np.broadcast_to(microbatches, fits.shape), np.iinfo(int).max), axis=0), \
        fits.any(axis=0)


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
                                      zero_levels=options.zero_levels, allow_sp=False)  # hot switching: no sp yet
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
        self.layouts = list(dict.fromkeys(layout(s) for s in self.space))
        """The distinct layouts: strategies that differ only in checkpointing share one (the executor's model)."""
        self.layout_index = np.array([self.layouts.index(layout(s)) for s in self.space])
        representative = [int(np.argmax(self.layout_index == L)) for L in range(len(self.layouts))]
        self.layout_switch_s = self.switch_s[:, representative]
        """[home, layout]: seconds of both switches per step (checkpointing moves no bytes)."""

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
        size, count = len(self.space), len(MICRO_ROWS)
        micro, counts = np.ones((count, size), dtype=int), np.ones((count, size), dtype=int)
        passes, sync = np.zeros((count, size)), np.zeros((count, size))
        act, transient = np.zeros((count, size)), np.zeros((count, size))
        for j, s in enumerate(self.space):
            # the executor pads the bucket with empty rows to a multiple of dp, and computes them: priced as full
            per_rank = padded_rows(rows, s.dp) // s.dp
            for c, choice in enumerate(MICRO_ROWS):
                r = micro_rows_for(choice, per_rank)
                m = -(-per_rank // r)
                model = self.model(s.dp * m * r, bound)  # each rank's rows padded to m micro-batches of r
                costs = [(model.layer(i, s, m), n) for i, n in self.kinds]  # per micro-batch
                passes[c, j] = m * sum(n * (x.time.compute + x.time.tp_comm + x.time.zero3_comm) for x, n in costs)
                sync[c, j] = m * sum(n * x.time.dp_comm for x, n in costs)  # per micro-batch: a share of the step's
                micro[c, j], counts[c, j] = r, m
                act[c, j] = sum(n * x.memory.activations for x, n in costs)
                transient[c, j] = max(x.transient for x, _ in costs)
        return BucketCost(bound, rows, micro, counts, passes, sync, act, transient)

    def home_memory(self, b: BucketCost) -> np.ndarray:
        """[choice, strategy]: the bucket run under it as the home (CostModel.estimate of the uniform plan)."""
        return self.reserve + self.home_states[None, :] + b.activations + b.transient

    def away_memory(self, b: BucketCost) -> np.ndarray:
        """[choice, home, strategy]: the bucket run under ``strategy`` while the ``home`` layout holds its states;
        a strategy in the home's own layout (the home, or it with checkpointing toggled) as :meth:`home_memory`."""
        need = self.reserve + self.home_states[None, :, None] + (self.copy[None, :] + b.activations
                                                                 + b.transient)[:, None, :]
        same = self.layout_index[:, None] == self.layout_index[None, :]  # [home, strategy] in the home's layout
        return np.where(same[None], self.home_memory(b)[:, None, :], need)

    def choice(self, b: BucketCost, home: int, strategy: int) -> int | None:
        """The fastest micro-batch choice under which the bucket fits under ``strategy`` beside ``home``, or None."""
        fits = self.away_memory(b)[:, home, strategy] <= self.budget
        c, ok = best_fit(fits, b.passes[:, strategy] + b.sync[:, strategy], b.microbatches[:, strategy])
        return int(c) if ok else None

    def bucket_memory(self, b: BucketCost, home: int, strategy: int, choice: int) -> Memory:
        """What :meth:`away_memory` adds up, by category."""
        own = Memory(activations=b.activations[choice, strategy], transient=b.transient[choice, strategy],
                     reserve=self.reserve)
        if self.layout_index[strategy] == self.layout_index[home]:
            return self.states[home] + own
        away = self.states[strategy]
        return self.states[home] + own + Memory(params=away.params, grads=away.grads)


def fastest(costs: SwitchingCostModel, buckets: list[BucketCost]) -> Assignment | None:
    """The fastest home strategy and strategy per bucket (shortest first; the last is the home), or None.

    The facilities are *layouts* (:attr:`SwitchingCostModel.layouts`): strategies that differ only in checkpointing
    share one (one model, switched once, synchronised once), each bucket in it taking the faster variant that fits."""
    size, count = len(costs.space), len(costs.layouts)
    everyone = np.arange(size)
    last = buckets[-1]
    first, fits = best_fit(costs.home_memory(last) <= costs.budget, last.passes + last.sync, last.microbatches)
    base = np.where(fits, last.passes[first, everyone] + last.sync[first, everyone] + costs.update, np.inf)
    others = buckets[:-1]
    # per bucket k, [home, layout]: the fastest variant of the layout that fits beside the home's states (in the
    # fastest micro-batches that do), its passes and its gradient sync; inf where none fits
    passes, syncs, variants = [], [], []
    for b in others:
        first, fits = best_fit(costs.away_memory(b) <= costs.budget, (b.passes + b.sync)[:, None, :],
                               b.microbatches[:, None, :])
        t = np.where(fits, b.passes[first, everyone[None, :]], np.inf)
        sync = b.sync[first, everyone[None, :]]
        by_layout = np.stack([np.where(costs.layout_index[None, :] == L, t, np.inf) for L in range(count)])
        pick = np.argmin(by_layout, axis=2).T  # [home, layout]: the variant's index into the space
        passes.append(np.take_along_axis(t, pick, axis=1))
        syncs.append(np.take_along_axis(sync, pick, axis=1))
        variants.append(pick)
    home_layout = costs.layout_index  # [home]
    m = len(others)
    group_time, group_layout = {}, {}
    for mask in range(1, 2**m):
        members = [k for k in range(m) if mask >> k & 1]
        t = sum(passes[k] for k in members)
        # away from home: its switches and one sync after its last (longest) bucket; at home the home bucket syncs
        away = t + syncs[members[-1]] + costs.layout_switch_s
        away[everyone, home_layout] = np.inf
        j = np.argmin(away, axis=1)
        stay = t[everyone, home_layout] <= away[everyone, j]  # no pointless switch on a tie
        group_time[mask] = np.where(stay, t[everyone, home_layout], away[everyone, j])
        group_layout[mask] = np.where(stay, home_layout, j)
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
                strategies[k] = int(variants[k][home, group_layout[g][home]])
        mask ^= g
    return Assignment(float(total[home]), home, strategies)


def fastest_single_strategy(costs: SwitchingCostModel, buckets: list[BucketCost]) -> tuple[float, int] | None:
    """(step time, strategy index) of the fastest single strategy that runs every bucket within the budget."""
    everyone = np.arange(len(costs.space))
    total = costs.update.copy()
    for b in buckets:
        first, fits = best_fit(costs.home_memory(b) <= costs.budget, b.passes + b.sync, b.microbatches)
        total = np.where(fits, total + b.passes[first, everyone], np.inf)
    last = buckets[-1]  # one sync, overlapped with the last (longest) bucket's backward
    chosen, _ = best_fit(costs.home_memory(last) <= costs.budget, last.passes + last.sync, last.microbatches)
    total = total + last.sync[chosen, everyone]
    j = int(np.argmin(total))
    return (float(total[j]), j) if np.isfinite(total[j]) else None
