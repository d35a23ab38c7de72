"""The search of :func:`nbtrain.planner.switching.buckets.plan_buckets`: the strategies a bucket may take (with a
pipeline or without, the home's CPU offload), what each layout holds, the switches between layouts, and the fastest
home strategy and grouping of the other buckets.

    >>> costs = SwitchingCostModel(profile, cluster, None, BucketOptions())
    >>> best = fastest(costs, [costs.bucket(4096, 48), costs.bucket(32768, 2)])
    >>> best.seconds > 0, all(0 <= j < len(costs.space) for j in best.strategies)
    (True, True)
    >>> switch_cost("weights", Strategy(dp_shard=2, tp=4), Strategy(dp_replicate=8), params=6.74e9,
    ...             bytes_per_param=2, cluster=Cluster.from_catalog("A100", num_devices=8)).bytes
    11795000000.0

**The space.** Every strategy of ``strategy_space`` on all the devices (power-of-two degrees, tp inside a node and
dividing the heads, no tp with a tied embedding the executor keeps whole, no sequence parallelism yet), and, where
the model's stages can be cut and its tied embedding may sit in two stages (:mod:`nbtrain.planner.reach`), the same
on ``N / pp`` devices per stage for each power-of-two ``pp`` up to the layers and ``BucketOptions.max_pp``, as a
1F1B pipeline (GPipe runs the same time with more activations in flight, so the search never prefers it; a user
may give it). A home strategy may also offload its update to the CPU (``BucketOptions.offload_levels``): offload is
the home optimizer's, so only the home takes those variants.

**What a layout holds** (per group of ranks, :mod:`nbtrain.planner.switching.bucket_costs`): the home layout its
stage's parameters, gradients and optimizer state all step (the cost model's ``params + grads + optimizer`` of the
stage, a tied copy on a pipeline's last stage), a layout away from home its stage's ``params + grads`` while its
buckets run; a bucket adds its activations and transient. Its memory is its worst group's.

**A switch** (:mod:`nbtrain.planner.switching.switch_cost`): the weights home → layout (``profile.dtype_bytes`` per
parameter) and the accumulated gradients back (``CostOptions.grad_reduce_bytes``), the slowest rank's bytes.

**Choosing strategies** for buckets is a facility-location problem: each layout other than the home costs its
switches and one gradient sync once, however many buckets use it. Its optimum partitions the buckets into groups,
one layout each, so a dynamic program over the subsets of the non-home buckets (3^(n−1) steps, every home strategy
at once as numpy arrays) finds it exactly. The step-time and memory models are in
:mod:`nbtrain.planner.switching.buckets`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from nbtrain.planner.cost import Memory
from nbtrain.planner.reach import cuts_stages, keeps_tie_whole, tie_crosses_stages
from nbtrain.planner.search import layer_kinds
from nbtrain.planner.strategy import Strategy, strategy_space
from nbtrain.planner.switching.bucket_costs import (MICRO_ROWS, BucketCost, KindCostModel, best_fit,
                                                    pipeline_prediction, price_bucket, stage_states)
from nbtrain.planner.switching.bucket_strategy import BucketStrategy, layout_key, pp_of, with_layers
from nbtrain.planner.switching.switch_cost import PredictedSwitch, switch_cost
from nbtrain.profiler.hardware import Cluster
from nbtrain.profiler.result import ModelProfile

layout = layout_key
"""The layout a strategy runs in (:func:`~nbtrain.planner.switching.bucket_strategy.layout_key`)."""


@dataclass(frozen=True)
class Assignment:
    seconds: float
    """Step time: passes, syncs, switches and the update."""
    home: int
    strategies: list[int]
    """Index into the space, per bucket (the last is ``home``)."""


class SwitchingCostModel:
    """The cost model over the strategy space (module docstring): model states and switches per strategy, costs per
    bucket (:meth:`bucket`), memory beside the home (:meth:`home_memory`, :meth:`away_memory`). ``options``:
    :class:`~nbtrain.planner.switching.buckets.BucketOptions`; ``extra``: strategies to price beside the space;
    ``step_tokens``: the tokens of a step, the most any one bucket may get (a pipelined bucket's memory is priced
    at that step: :func:`~nbtrain.planner.switching.bucket_costs.peak_rows`); None: no step holds more rows than a
    bucket's own."""

    def __init__(self, profile: ModelProfile, cluster: Cluster, budget: float | None, options, extra=(),
                 step_tokens: int | None = None):
        self.profile, self.cluster, self.options, self._budget = profile, cluster, options, budget
        self.step_tokens = step_tokens
        n, per_node = cluster.num_devices, cluster.devices_per_node
        heads = profile.arch.get("n_kv_head") or profile.arch.get("n_head")
        unit = profile.arch.get("tp_unit")  # every split dimension divides by tp (nbtrain.models.description)
        # one strategy for every layer: a tied embedding and head the executor keeps whole keep TP out (search.py)
        tied = keeps_tie_whole(profile)
        self.no_tp = profile.arch.get("no_tensor_parallel") or ("a tied embedding and head" if tied else "")
        """Why tensor parallelism is ruled out, or empty."""
        self.no_pp = ("its stages cannot be cut" if not cuts_stages(profile) else
                      # a bucket's rows change from step to step; a traced stage's shapes are fixed when traced
                      "its pipeline stages are traced graphs of fixed shapes" if profile.arch.get("traced_stages")
                      else "a tied embedding and head the executor keeps in one stage" if tied and
                      not tie_crosses_stages(profile) else "")
        """Why pipelines are ruled out, or empty."""

        def space(devices: int) -> list[Strategy]:
            return [s for s in strategy_space(devices, devices_per_node=per_node,
                                              max_tp=1 if self.no_tp else options.max_tp, allow_ac=options.allow_ac,
                                              zero_levels=options.zero_levels, allow_sp=False)  # no sp yet
                    if s.tp == 1 or ((not heads or heads % s.tp == 0) and (not unit or unit % s.tp == 0))]

        self.num_layers = len(profile.layers)
        most = min(n, self.num_layers, options.max_pp or n) if not self.no_pp else 1
        degrees = [p for p in (2 ** k for k in range(1, most.bit_length())) if n % p == 0 and p <= most]
        base = space(n) + [BucketStrategy(s, p) for p in degrees for s in space(n // p)]
        offloaded = [with_layers(s, offload=f) for f in options.offload_levels if f > 0 for s in base]
        self.space: list = base + offloaded + [s for s in dict.fromkeys(extra) if s not in base + offloaded]
        """Every strategy a bucket may take: a Strategy, or a pipelined BucketStrategy; offloaded ones home only;
        ``extra`` ones a user gave (a GPipe pipeline, another offload fraction) to be priced."""
        self.home_only = np.array([s.offload > 0 for s in self.space])
        kinds = layer_kinds(profile)  # layers of one kind cost the same under every strategy
        self.kinds = [(kinds.index(k), n_k) for k, n_k in ((k, kinds.count(k)) for k in sorted(set(kinds)))]
        self._representative = [kinds.index(k) for k in kinds]
        self.groups = max(pp_of(s) for s in self.space)
        """Groups of ranks memory is kept per (:mod:`nbtrain.planner.switching.bucket_costs`)."""
        probe = self.model(n, profile.seq_len)
        self.budget, self.reserve = probe.budget, probe.reserve
        held = [stage_states(probe, s, n, self.num_layers, self.groups) for s in self.space]
        self.states_g = np.array([h for h, _, _ in held])
        """[strategy, group]: params + grads + optimizer the home layout holds all step."""
        self.copy_g = np.array([c for _, c, _ in held])
        """[strategy, group]: params + grads a layout away from home holds while its buckets run."""
        self._stage_memory = [m for _, _, m in held]
        self.home_states = self.states_g.max(axis=1)
        self.layouts = list(dict.fromkeys(layout(s) for s in self.space))
        """The distinct layouts: strategies that differ only in checkpointing (or offload) share one model."""
        self.layout_index = np.array([self.layouts.index(layout(s)) for s in self.space])
        self._layer_params = [layer.params for layer in profile.layers]
        arch = profile.arch
        self._tied = (arch.get("vocab_size") or 0) * (arch.get("n_embd") or 0) if profile.layers[-1].tied else 0.0
        pair = np.array([[self._switch_seconds(a, b) for b in range(len(self.layouts))]
                         for a in range(len(self.layouts))])
        self.layout_switch_s = pair[self.layout_index]
        """[home, layout]: seconds of both switches per step (checkpointing and offload move no bytes)."""
        self.switch_s = self.layout_switch_s[:, self.layout_index]
        """[home, strategy]: seconds of both switches per step."""
        self._away: dict = {}

    @lru_cache(maxsize=None)
    def model(self, rows: int, bound: int) -> KindCostModel:
        return KindCostModel(self.profile, self.cluster, global_batch=rows, seq_len=bound, budget_bytes=self._budget,
                             options=self.options.cost, representative=self._representative)

    @lru_cache(maxsize=None)
    def switches(self, home, strategy) -> tuple[PredictedSwitch, PredictedSwitch]:
        """The two switches a layout away from ``home`` costs per step: weights there, gradients back."""
        params = sum(self._layer_params)
        e, g = self.profile.dtype_bytes, self.options.cost.grad_reduce_bytes
        common = dict(params=params, cluster=self.cluster, layer_params=self._layer_params, tied=self._tied)
        return (switch_cost("weights", home, strategy, bytes_per_param=e, **common),
                switch_cost("gradients", strategy, home, bytes_per_param=g, **common))

    def _switch_seconds(self, a: int, b: int) -> float:
        if a == b:
            return 0.0
        return sum(x.seconds for x in self.switches(self.layouts[a], self.layouts[b]))

    @lru_cache(maxsize=None)
    def bucket(self, bound: int, rows: int) -> BucketCost:
        return price_bucket(self, bound, rows)

    def pipeline(self, b: BucketCost, strategy: int, choice: int):
        """The cost model's prediction of bucket ``b`` under a pipelined strategy (for the plan's explanation)."""
        return pipeline_prediction(self, self.space[strategy], b.bound, b.rows, MICRO_ROWS[choice])

    def _need(self, b: BucketCost) -> np.ndarray:
        """[choice, strategy, group]: what the bucket itself holds."""
        return b.activations + b.transient

    def home_memory(self, b: BucketCost) -> np.ndarray:
        """[choice, strategy]: the bucket run under it as the home, its worst group of ranks."""
        return self.reserve + (self.states_g[None] + self._need(b)).max(axis=2)

    def away_memory(self, b: BucketCost) -> np.ndarray:
        """[choice, home, strategy]: the bucket run under ``strategy`` while the ``home`` layout holds its states;
        a strategy in the home's own layout (the home, or it with checkpointing toggled) holds no second copy."""
        key = (b.bound, b.rows)
        if key not in self._away:
            need = self._need(b)
            same = self.layout_index[:, None] == self.layout_index[None, :]  # [home, strategy]
            worst = np.full((need.shape[0], len(self.space), len(self.space)), -np.inf)
            for g in range(self.groups):  # per group of ranks: the home's stage there beside the strategy's
                own = need[:, :, g][:, None, :] + np.where(same, 0.0, self.copy_g[None, :, g])[None]
                worst = np.maximum(worst, self.states_g[None, :, g, None] + own)
            self._away[key] = self.reserve + worst
        return self._away[key]

    def choice(self, b: BucketCost, home: int, strategy: int, *, as_home: bool = False) -> int | None:
        """The fastest micro-batch choice under which the bucket fits under ``strategy`` beside ``home``, or None
        (``as_home``: it is the home's bucket, whose update counts)."""
        fits = self.away_memory(b)[:, home, strategy] <= self.budget
        seconds = b.passes[:, strategy] + b.sync[:, strategy] + (b.update[:, strategy] if as_home else 0.0)
        c, ok = best_fit(fits, seconds, b.microbatches[:, strategy])
        return int(c) if ok else None

    def bucket_memory(self, b: BucketCost, home: int, strategy: int, choice: int) -> Memory:
        """What :meth:`away_memory` adds up, by category, on the worst group of ranks."""
        same = self.layout_index[strategy] == self.layout_index[home]
        totals = self.states_g[home] + self._need(b)[choice, strategy] + (0.0 if same else self.copy_g[strategy])
        g = int(np.argmax(totals))
        states = self._stage_memory[home][g]
        memory = Memory(params=states.params, grads=states.grads, optimizer=states.optimizer,
                        activations=b.activations[choice, strategy, g], transient=b.transient[choice, strategy, g],
                        reserve=self.reserve)
        if not same:
            away = self._stage_memory[strategy][g]
            memory = memory + Memory(params=away.params, grads=away.grads)
        return memory


def fastest(costs: SwitchingCostModel, buckets: list[BucketCost]) -> Assignment | None:
    """The fastest home strategy and strategy per bucket (shortest first; the last is the home), or None.

    The facilities are *layouts* (:attr:`SwitchingCostModel.layouts`): strategies that differ only in checkpointing
    share one (one model, switched once, synchronised once), each bucket in it taking the faster variant that fits.
    Only the home may offload."""
    size, count = len(costs.space), len(costs.layouts)
    everyone = np.arange(size)
    last = buckets[-1]
    first, fits = best_fit(costs.home_memory(last) <= costs.budget, last.passes + last.sync + last.update,
                           last.microbatches)
    base = np.where(fits, (last.passes + last.sync + last.update)[first, everyone], np.inf)
    others = buckets[:-1]
    # per bucket k, [home, layout]: the fastest variant of the layout that fits beside the home's states (in the
    # fastest micro-batches that do), its passes and its gradient sync; inf where none fits
    passes, syncs, variants = [], [], []
    for b in others:
        first, fits = best_fit(costs.away_memory(b) <= costs.budget, (b.passes + b.sync)[:, None, :],
                               b.microbatches[:, None, :])
        t = np.where(fits & ~costs.home_only[None, :], b.passes[first, everyone[None, :]], np.inf)
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
    total = np.zeros(len(costs.space))
    for b in buckets[:-1]:
        first, fits = best_fit(costs.home_memory(b) <= costs.budget, b.passes + b.sync, b.microbatches)
        total = np.where(fits, total + b.passes[first, everyone], np.inf)
    last = buckets[-1]  # one sync, overlapped with the last (longest) bucket's backward, then the update
    once = last.passes + last.sync + last.update
    chosen, fits = best_fit(costs.home_memory(last) <= costs.budget, once, last.microbatches)
    total = np.where(fits, total + once[chosen, everyone], np.inf)
    j = int(np.argmin(total))
    return (float(total[j]), j) if np.isfinite(total[j]) else None
