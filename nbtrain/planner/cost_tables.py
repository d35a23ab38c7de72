"""The cost model's per-layer prices, computed once per model and cluster and shared by everything that plans it.

    >>> prof = nbtrain.profile("gpt-tiny", batch_size=1, seq_len=64)
    >>> cluster = nbtrain.Cluster.from_catalog("H100", num_devices=8)
    >>> model = shared_cost_model(prof, cluster, global_batch=32, budget_bytes=24 * 2**30)
    >>> model.layer(2, Strategy(dp_shard=8), 4) is model.layer(3, Strategy(dp_shard=8), 4)   # twins: priced once
    True

A search, its second pass, the best plan without offload, the baselines and every estimate of ``nbtrain.plan`` ask
the cost model for the same layers under the same strategies, and the plan explorer asks again whenever a box
changes. :class:`SharedCostModel` is the :class:`~nbtrain.planner.cost.CostModel` (its methods stay the one source
of every number) with ``layer``, ``relayout`` and ``p2p`` remembered in a table shared by every instance of the
same profile, cluster, global batch, length and cost options (and ``estimate`` by plan and budget): the memory
budget is not part of it (it moves only the reserve, ``tests/test_plan_speed_same_plans.py`` checks that no layer
price depends on it), so typing another budget in the explorer prices no layer again. Layers that cost the same (:func:`twins`: equal profiles and equal
per-layer facts) share their prices, as most blocks do. The last :data:`KEPT` tables are kept.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

from nbtrain.planner.cost import CostModel
from nbtrain.planner.cost_options import CostOptions
from nbtrain.planner.plan import Plan
from nbtrain.planner.prediction import Prediction
from nbtrain.planner.strategy import Strategy
from nbtrain.profiler.hardware import Cluster
from nbtrain.profiler.result import ModelProfile

KEPT = 8
"""Tables kept: a notebook that moves between a few clusters, batches and lengths finds each again."""


MEASURED = ("time_fwd_s", "time_bwd_s", "time_fwd_fixed_s", "time_bwd_fixed_s")
"""A layer's measured times: noise between equal blocks, which the search's layer kinds leave out."""


def twins(profile: ModelProfile, *, measured: bool = True) -> list[int]:
    """A small id per layer; two layers share it when every input of :meth:`CostModel.layer` about them is equal:
    their profiles (every field but the name, the scaling's coefficients), the hidden state that enters them, and
    every per-layer fact of ``profile.arch`` (a list with an entry per layer, such as ``tp_pairs``,
    ``tp_whole_params``, ``layer_expert_params``: the layer's entry; any other list, such as the indices of
    ``tp_gathers_output``: whether it names the layer); the first layer always stands alone (its input is token
    ids). ``measured=False`` leaves the measured times out (:func:`nbtrain.planner.search.layer_kinds`: the search
    prices equal blocks once, however their timings scatter)."""
    layers, n = profile.layers, len(profile.layers)

    def facts(i: int) -> tuple:
        out = []
        for key, value in sorted(profile.arch.items()):
            if isinstance(value, (list, tuple)):
                out.append((key, repr(value[i])) if len(value) == n else (key, i in value))
        return tuple(out)

    def signature(i: int) -> tuple:
        layer = layers[i]
        left_out = ("name", "scaling") if measured else ("name", "scaling", *MEASURED)
        fields = tuple(getattr(layer, f.name) for f in dataclasses.fields(layer) if f.name not in left_out)
        scaling = tuple(sorted((q, s.coeffs) for q, s in layer.scaling.items()))
        entering = layers[i - 1].scaling["output_bytes"].coeffs if i else None
        return i == 0, fields, scaling, entering, facts(i)

    ids: dict = {}
    return [ids.setdefault(signature(i), len(ids)) for i in range(n)]


@dataclasses.dataclass
class PriceTable:
    """What one profile, cluster, global batch, length and cost options price, by the layer's :func:`twins` id."""

    profile: ModelProfile
    twin: list[int]
    prices: dict = dataclasses.field(default_factory=dict)
    """(method, twin id, its other arguments) → what the method returned."""
    solved: dict = dataclasses.field(default_factory=dict)
    """What the search keeps per sub-problem (:mod:`nbtrain.planner.task_tables`): its tables and its solutions."""


_TABLES: OrderedDict = OrderedDict()


def price_table(profile: ModelProfile, cluster: Cluster, global_batch: int, seq_len: int,
                options: CostOptions) -> PriceTable:
    """The shared table of ``profile`` (by identity: a profile is not changed once made) on ``cluster``."""
    key = (id(profile), cluster, global_batch, seq_len, options)
    table = _TABLES.get(key)
    if table is None or table.profile is not profile:
        table = _TABLES[key] = PriceTable(profile, twins(profile))
        while len(_TABLES) > KEPT:
            _TABLES.popitem(last=False)
    _TABLES.move_to_end(key)
    return table


def forget() -> None:
    """Drop every shared table (the next search prices its layers again)."""
    _TABLES.clear()


class SharedCostModel(CostModel):
    """A :class:`CostModel` whose per-layer prices come from (and go to) the shared :func:`price_table`."""

    def __init__(self, profile: ModelProfile, cluster: Cluster, *, global_batch: int, seq_len: int | None = None,
                 budget_bytes: float | None = None, options: CostOptions = CostOptions()):
        super().__init__(profile, cluster, global_batch=global_batch, seq_len=seq_len, budget_bytes=budget_bytes,
                         options=options)
        self.table = price_table(profile, cluster, global_batch, self.seq_len, options)

    def _remembered(self, method: str, index: int, args: tuple, price):
        key = (method, self.table.twin[index], args)
        found = self.table.prices.get(key)
        if found is None:
            found = self.table.prices[key] = price()
        return found

    def layer(self, index: int, s: Strategy, microbatches: int, pp: int = 1):
        return self._remembered("layer", index, (s, microbatches, pp),
                                lambda: super(SharedCostModel, self).layer(index, s, microbatches, pp))

    def relayout(self, index: int, before: Strategy, after: Strategy, microbatches: int) -> float:
        return self._remembered("relayout", index, (before, after, microbatches),
                                lambda: super(SharedCostModel, self).relayout(index, before, after, microbatches))

    def p2p(self, last_layer: int, s: Strategy, microbatches: int, pp: int, stage: int) -> float:
        return self._remembered("p2p", last_layer, (s, microbatches, pp, stage),
                                lambda: super(SharedCostModel, self).p2p(last_layer, s, microbatches, pp, stage))


    def estimate(self, plan: Plan) -> Prediction:
        """:meth:`CostModel.estimate`, remembered by plan and budget (``plan()`` and ``plan_and_compare`` predict
        the same baselines)."""
        key = ("estimate", plan, self.budget)
        found = self.table.prices.get(key)
        if found is None:
            found = self.table.prices[key] = super().estimate(plan)
        return found


def shared_cost_model(profile: ModelProfile, cluster: Cluster, *, global_batch: int, seq_len: int | None = None,
                      budget_bytes: float | None = None, options: CostOptions = CostOptions()) -> SharedCostModel:
    """:class:`SharedCostModel` for these arguments (those of :class:`CostModel`)."""
    return SharedCostModel(profile, cluster, global_batch=global_batch, seq_len=seq_len, budget_bytes=budget_bytes,
                           options=options)
