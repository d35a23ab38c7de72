"""The search is exact: on small random instances it finds the same best step time as trying every plan.

    .venv/bin/pytest tests/test_search_exact.py -q          # about 20 s on 2 cores

The brute force here shares nothing with the search but the definition of the space (``strategy_space`` with the
same options, the pp, micro-batch and offload rules of ``search``'s docstring) and the cost model: it builds every
:class:`Plan` — each pp, micro-batch count, schedule, partition into contiguous non-empty stages and strategy per
layer — and keeps the fastest whose ``CostModel.estimate`` fits. Instances are small enough that each stage's
frontier stays under ``frontier.EXACT_LIMIT`` (checked), where the search promises exactness, not a memory grid.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass
from functools import lru_cache

import pytest

from nbtrain.planner import frontier as frontier_module
from nbtrain.planner.cost import CostModel, CostOptions
from nbtrain.planner.search import search
from nbtrain.planner.search_space import SearchOptions
from nbtrain.planner.plan import Plan
from nbtrain.planner.strategy import Strategy, strategy_space
from nbtrain.profiler.result import Scaling

from tests.planner_fixtures import KINDS, cluster, layer, profile

NO_RESERVE = CostOptions(headroom=0, reserve_bytes=0)
EXACT = 1e-9
MAX_PLANS = 8_000
"""Plans the brute force evaluates per instance at most (~140 µs each)."""
INSTANCES = range(56)
DEEP_INSTANCES = range(100, 112)
"""Seeds of deeper instances: a run of identical blocks that pipeline stages cut, 1 device per stage."""


@dataclass(frozen=True)
class Instance:
    seed: int
    profile: object
    cluster: object
    global_batch: int
    options: SearchOptions

    def __str__(self) -> str:
        c, o = self.cluster, self.options
        return (f"seed {self.seed}: {len(self.profile.layers)} layers, {c.num_devices} devices "
                f"({c.devices_per_node}/node), batch {self.global_batch}, pp {o.pp_degrees}, mb {o.microbatches}, "
                f"offload {o.offload_levels}, ac {o.allow_ac}, zero {o.zero_levels}, max_tp {o.max_tp}, "
                f"schedules {o.schedules}")


# --- the brute force ---------------------------------------------------------------------------------------------

def pipeline_degrees(inst: Instance) -> list[int]:
    """search's rule: powers of two up to the devices and the layers, or the ones asked for."""
    n, devices = len(inst.profile.layers), inst.cluster.num_devices
    return list(inst.options.pp_degrees or [p for p in (1, 2, 4, 8) if p <= min(devices, n)])


def _power_of_two(k: int) -> bool:
    return k & (k - 1) == 0


def microbatch_counts(inst: Instance, pp: int) -> list[int]:
    """search's rule: the divisors of the global batch that are powers of two or leave a power of two of sequences
    per micro-batch (below pp too: those run GPipe), or the ones asked for (that divide the batch)."""
    batch = inst.global_batch
    counts = inst.options.microbatches or [m for m in range(1, batch + 1)
                                           if batch % m == 0 and (_power_of_two(m) or _power_of_two(batch // m))]
    return [m for m in counts if batch % m == 0]


def schedules(inst: Instance, pp: int, m: int) -> tuple[str, ...]:
    """search's rule: one stage has no schedule to choose; fewer micro-batches than stages run GPipe only (PyTorch's
    Schedule1F1B refuses them); otherwise the schedules asked for."""
    if pp == 1:
        return ("1f1b",)
    return ("gpipe",) if m < pp else inst.options.schedules


def space(inst: Instance, pp: int, m: int) -> list[Strategy]:
    """The layer strategies of one stage: the pruned space, less what the batch or the heads cannot take."""
    o, c = inst.options, inst.cluster
    heads = inst.profile.arch["n_kv_head"]
    return [s for s in strategy_space(c.num_devices // pp, devices_per_node=c.devices_per_node, max_tp=o.max_tp,
                                      offload_levels=o.offload_levels,
                                      allow_ac=o.allow_ac, zero_levels=o.zero_levels)
            if inst.global_batch % (m * s.dp) == 0 and heads % s.tp == 0]


def partitions(n: int, pp: int):
    """Every split of n layers into pp contiguous non-empty stages, as layer counts."""
    for cuts in itertools.combinations(range(1, n), pp - 1):
        bounds = (0, *cuts, n)
        yield tuple(b - a for a, b in zip(bounds, bounds[1:]))


def count_plans(inst: Instance) -> int:
    n = len(inst.profile.layers)
    total = 0
    for pp in pipeline_degrees(inst):
        for m in microbatch_counts(inst, pp):
            every = space(inst, pp, m)
            total += len(schedules(inst, pp, m)) * math.comb(n - 1, pp - 1) * len(every) ** n
    return total


@lru_cache(maxsize=None)
def every_plan(seed: int) -> tuple[Instance, list[tuple[float, float, bool, Plan]]]:
    """(step time, memory per device, fits the host, plan) of every plan of the instance's space."""
    inst = random_instance(seed)
    n = len(inst.profile.layers)
    model = CostModel(inst.profile, inst.cluster, global_batch=inst.global_batch, options=NO_RESERVE)
    for name in ("layer", "relayout", "p2p"):  # pure functions of their arguments: memoise them for speed
        setattr(model, name, lru_cache(maxsize=None)(getattr(model, name)))
    out = []
    for pp in pipeline_degrees(inst):
        for m in microbatch_counts(inst, pp):
            strategies = space(inst, pp, m)
            for schedule in schedules(inst, pp, m):
                for stages in partitions(n, pp):
                    for layers in itertools.product(strategies, repeat=n):
                        plan = Plan(num_devices=inst.cluster.num_devices, layers=layers, pp=pp, microbatches=m,
                                    schedule=schedule, stages=stages, global_batch=inst.global_batch,
                                    seq_len=inst.profile.seq_len)
                        pred = model.estimate(plan)
                        host = max(s.host_bytes for s in pred.stages) <= pred.host_budget_bytes
                        out.append((pred.step_time_s, pred.memory_bytes, host, plan))
    assert len(out) == count_plans(inst)
    return inst, out


def mixes_offload_and_tp(plan: Plan) -> bool:
    return any(s.offload for s in plan.layers) and any(s.tp > 1 for s in plan.layers)


def brute_force_best(plans, budget: float) -> float | None:
    """search's rule: the fastest plan that fits without mixing CPU offload and TP; only when none fits, the fastest
    of all (the mixes are searched only to make a model fit)."""
    fits = [(t, plan) for t, memory, host, plan in plans if memory <= budget and host]
    unmixed = [t for t, plan in fits if not mixes_offload_and_tp(plan)]
    times = unmixed or [t for t, _ in fits]
    return min(times) if times else None


# --- random instances --------------------------------------------------------------------------------------------

def _coefficient(rng: random.Random, low: int, high: int, multiple: int = 4) -> int:
    """An integer multiple of ``multiple`` spread log-uniformly over [10^low, 10^high]: byte counts stay whole
    numbers after dividing by tp and dp_shard (≤ 4), so memory sums are exact and ties at the budget are real."""
    return multiple * max(1, round(10 ** rng.uniform(low, high) / multiple))


def random_layer(rng: random.Random, name: str, kind: str):
    params = _coefficient(rng, 3, 7, multiple=64)
    flops = 0 if kind == "embedding" and rng.random() < 0.5 else 2 * params * rng.uniform(0.3, 3)
    attention = _coefficient(rng, 0, 3) if kind == "block" and rng.random() < 0.5 else 0  # b·s² terms
    return layer(name, kind, params=params, act=0, out=0, fwd=0, scaling={
        "flops_fwd": Scaling((flops, 2 * attention, 0, 0, 0, 0)),
        "flops_bwd": Scaling((flops * rng.choice((1, 2, 3)), 5 * attention, 0, 0, 0, 0)),
        "activation_bytes": Scaling((_coefficient(rng, 1, 4.5), attention, 0, 0, 0, 0)),
        "output_bytes": Scaling((_coefficient(rng, 1, 3.5), 0, 0, 0, 0, 0)),
    })


def random_instance(seed: int) -> Instance:
    if seed in DEEP_INSTANCES:
        return deep_instance(seed)
    rng = random.Random(seed)
    n = rng.randint(2, 5)
    blocks = n - 2
    kinds = ["embedding"] + ["block"] * blocks + ["head"]
    layers = [random_layer(rng, "embed", "embedding")]
    shared = rng.random() < 0.5  # identical blocks share the search's tables and cached frontiers
    block = random_layer(rng, "blocks.0", "block")
    for i in range(blocks):
        layers.append(block if i == 0 or shared else random_layer(rng, f"blocks.{i}", "block"))
    layers.append(random_layer(rng, "head", "head"))
    assert [x.kind for x in layers] == kinds and set(kinds) <= set(KINDS)
    prof = profile(layers, seq_len=rng.choice((16, 64, 128, 256)), n_head=8,
                   n_kv_head=rng.choice((8, 8, 8, 2, 1)))

    devices = rng.choice((2, 4))
    intra = 10 ** rng.uniform(9, 11.5)
    cl = cluster(devices, rng.choice((2, 4)) if devices == 4 else 2,
                 peak_flops=10 ** rng.uniform(11, 13), flops_efficiency=rng.uniform(0.4, 1.0),
                 intra_node_bandwidth=intra, inter_node_bandwidth=intra / rng.choice((1, 4, 10)),
                 host_to_device_bandwidth=10 ** rng.uniform(9, 11), cpu_optimizer_rate=10 ** rng.uniform(8.5, 10.5),
                 device_memory=10**15, host_memory=10**15)
    batch = rng.choice((4, 8))

    pps = [p for p in (1, 2, 4) if p <= min(devices, n)]
    options = dict(
        schedules=("1f1b", "gpipe") if rng.random() < 0.25 else ("1f1b",),
        offload_levels=rng.choice(((0.0,), (0.0, 1.0), (0.0, 0.5, 1.0))),
        allow_ac=rng.random() < 0.7,
        zero_levels=rng.choice(((2, 3), (2, 3), (3,), (2,))),
        max_tp=rng.choice((None, None, 1, 2)),
        pp_degrees=None if rng.random() < 0.5 else tuple(sorted(rng.sample(pps, rng.randint(1, len(pps))))),
        # explicit counts may go below pp (run with GPipe, which holds all m in flight)
        microbatches=None if rng.random() < 0.5 else tuple(sorted(rng.sample([m for m in (1, 2, 4, 8) if m <= batch],
                                                                             rng.randint(1, 2)))),
    )
    # shrink the space, one knob at a time, until the brute force stays cheap
    shrinks = [("offload_levels", (0.0,)), ("zero_levels", (3,)), ("allow_ac", False), ("max_tp", 1),
               ("schedules", ("1f1b",))]
    rng.shuffle(shrinks)
    shrinks += [("microbatches", (rng.choice((1, 2)),)), ("pp_degrees", (1, 2) if 2 in pps else (1,))]
    inst = Instance(seed, prof, cl, batch, SearchOptions(**options))
    while count_plans(inst) > MAX_PLANS:
        key, value = shrinks.pop(0)
        options[key] = value
        inst = Instance(seed, prof, cl, batch, SearchOptions(**options))
    return inst


def deep_instance(seed: int) -> Instance:
    """Embeddings, 4 or 5 identical blocks and a head on 2 devices in a 2-stage pipeline: each stage is one device,
    so the only choices are the stage boundary and checkpointing per layer, and the budget decides which blocks
    of the run, in which stage, may keep their activations."""
    rng = random.Random(seed)
    block = random_layer(rng, "blocks.0", "block")
    blocks = [block] * rng.randint(4, 5)
    layers = [random_layer(rng, "embed", "embedding"), *blocks, random_layer(rng, "head", "head")]
    prof = profile(layers, seq_len=rng.choice((64, 256)))
    cl = cluster(2, 2, peak_flops=10 ** rng.uniform(11, 13), intra_node_bandwidth=10 ** rng.uniform(9, 11),
                 inter_node_bandwidth=1e9, device_memory=10**15, host_memory=10**15)
    options = SearchOptions(offload_levels=(0.0,), pp_degrees=(2,), microbatches=(rng.choice((2, 4)),))
    return Instance(seed, prof, cl, rng.choice((4, 8)), options)


def budgets(seed: int, plans) -> list[float]:
    """Memory budgets from tight to loose: exactly the least memory any plan needs (only those fit), exactly some
    plan's memory, between two plans' memories, everything fits; and for some instances one byte too few. When
    the caps leave no plan at all (e.g. one KV head and a micro-batch of one sequence on 4 devices), any budget."""
    rng = random.Random(seed + 1000)
    memories = sorted({memory for _, memory, _, _ in plans})
    if not memories:
        return [10.0**15]
    i = rng.randrange(len(memories) - 1) if len(memories) > 1 else 0
    chosen = [memories[0], memories[rng.randrange(len(memories) // 2 + 1)],
              (memories[i] + memories[min(i + 1, len(memories) - 1)]) / 2, memories[-1] * 2]
    if seed % 4 == 0:
        chosen.append(memories[0] - 1)
    return chosen


@pytest.fixture
def frontier_sizes(monkeypatch):
    """Largest number of candidate partial plans any ``Frontier.extend`` saw (the grid applies above EXACT_LIMIT)."""
    seen = [0]
    extend = frontier_module.Frontier.extend

    def spy(self, resident, *args, **kwargs):
        seen[0] = max(seen[0], len(self) * len(resident))
        return extend(self, resident, *args, **kwargs)

    monkeypatch.setattr(frontier_module.Frontier, "extend", spy)
    return seen


# --- the tests ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [*INSTANCES, *DEEP_INSTANCES])
def test_search_finds_the_brute_force_optimum(seed, frontier_sizes):
    inst, plans = every_plan(seed)
    for budget in budgets(seed, plans):
        found = search(inst.profile, inst.cluster, global_batch=inst.global_batch, memory=budget, top=1,
                       options=inst.options, cost_options=NO_RESERVE)
        best = brute_force_best(plans, budget)
        if best is None:
            assert found == [], f"{inst}, budget {budget:.0f}: nothing fits, the search returned {found[0]}"
            continue
        assert len(found) == 1, f"{inst}, budget {budget:.0f}: the search found nothing, brute force {best:.6g} s"
        pred = found[0].predicted
        assert pred.memory_bytes <= budget and pred.fits, f"{inst}: {found[0]} does not fit {budget:.0f} bytes"
        assert pred.step_time_s == pytest.approx(best, rel=EXACT), (
            f"{inst}, budget {budget:.0f}: search {found[0]} at {pred.step_time_s:.9g} s, brute force {best:.9g} s")
    assert frontier_sizes[0] <= frontier_module.EXACT_LIMIT, f"{inst}: shrink it, the memory grid applied"


def test_the_random_instances_cover_tight_infeasible_pipelined_and_mixed_cases():
    """The instances above are worth their time: budgets bind, some are infeasible, and optima use pipelines,
    different strategies per layer and both 2 and 4 devices."""
    bound = infeasible = pipelined = mixed = 0
    devices = set()
    for seed in INSTANCES:
        inst, plans = every_plan(seed)
        devices.add(inst.cluster.num_devices)
        unconstrained = brute_force_best(plans, math.inf)
        for budget in budgets(seed, plans):
            best = brute_force_best(plans, budget)
            if best is None:
                infeasible += 1
                continue
            bound += best > unconstrained * (1 + EXACT)
            winner = min((p for p in plans if p[1] <= budget), key=lambda p: p[0])[3]
            pipelined += winner.pp > 1
            mixed += len(set(winner.layers)) > 1
    assert devices == {2, 4}
    assert infeasible >= 5 and bound >= 30 and pipelined >= 10 and mixed >= 20, (infeasible, bound, pipelined, mixed)


def test_search_recommends_a_plan_that_fits_the_host_memory_its_offload_needs():
    # Offloading is free here (a fast CPU and PCIe) and saves the most device memory, but the host holds only
    # 1 kB per device: no offloaded plan fits, so the recommendation must not offload.
    prof = profile([layer("embed", "embedding", params=64_000, act=16, out=100, fwd=1e3),
                    layer("blocks.0", "block", params=640_000, act=1_000, out=100, fwd=2e7),
                    layer("head", "head", params=64_000, act=500, out=400, fwd=2e6)])
    cl = cluster(4, 4, host_memory=4_000, cpu_optimizer_rate=1e15, host_to_device_bandwidth=1e15)
    options = SearchOptions(offload_levels=(0.0, 1.0))
    found = search(prof, cl, global_batch=8, top=1, options=options, cost_options=NO_RESERVE)
    assert found, "plans without offload fit the device"
    pred = found[0].predicted
    assert pred.fits, (f"recommended {found[0]}: {max(s.host_bytes for s in pred.stages):.0f} bytes of optimizer "
                       f"state on the host, {pred.host_budget_bytes:.0f} available per device")


# --- the recommendation beats every uniform plan ------------------------------------------------------------------

def uniform_instance(seed: int):
    rng = random.Random(seed)
    blocks = rng.randint(4, 8)
    block = random_layer(rng, "blocks.0", "block")
    prof = profile([random_layer(rng, "embed", "embedding")] + [block] * blocks
                   + [random_layer(rng, "head", "head")], seq_len=rng.choice((128, 512)))
    intra = 10 ** rng.uniform(10, 11.5)
    cl = cluster(8, rng.choice((4, 8)), peak_flops=10 ** rng.uniform(12, 14.5), intra_node_bandwidth=intra,
                 inter_node_bandwidth=intra / 8, host_to_device_bandwidth=10 ** rng.uniform(10, 11),
                 cpu_optimizer_rate=10 ** rng.uniform(9, 10.5), device_memory=10**15, host_memory=10**15)
    return prof, cl, rng.choice((16, 32))


@pytest.mark.parametrize("seed", range(4))
def test_the_recommended_plan_is_never_slower_than_a_uniform_plan_that_fits(seed):
    prof, cl, batch = uniform_instance(seed)
    n = len(prof.layers)
    opts = SearchOptions()
    model = CostModel(prof, cl, global_batch=batch, options=NO_RESERVE)
    uniform = []
    for pp in (p for p in (1, 2, 4, 8) if p <= n):
        for m in (m for m in (1, 2, 4, 8, 16, 32) if pp <= m <= batch):
            for s in strategy_space(8 // pp, devices_per_node=cl.devices_per_node,
                                    offload_levels=opts.offload_levels if pp == 1 else (0.0,),
                                    allow_ac=opts.allow_ac, zero_levels=opts.zero_levels):
                if batch % (m * s.dp) == 0:
                    plan = Plan(num_devices=8, layers=(s,) * n, pp=pp, microbatches=m, global_batch=batch)
                    uniform.append((model.estimate(plan), plan))
    memories = sorted(pred.memory_bytes for pred, _ in uniform)
    for budget in (memories[len(memories) // 10], memories[len(memories) // 2], memories[-1]):
        (best,) = search(prof, cl, global_batch=batch, memory=budget, top=1, options=opts, cost_options=NO_RESERVE)
        assert best.predicted.memory_bytes <= budget
        fitting = [(pred.step_time_s, plan) for pred, plan in uniform if pred.memory_bytes <= budget]
        # offload mixed with TP is searched only when nothing fits without it (brute_force_best's rule)
        fitting = [x for x in fitting if not mixes_offload_and_tp(x[1])] or fitting
        fastest_time, fastest = min(fitting, key=lambda x: x[0])
        assert best.predicted.step_time_s <= fastest_time * (1 + EXACT), (
            f"budget {budget:.0f}: recommended {best} at {best.predicted.step_time_s:.6g} s, uniform {fastest} at "
            f"{fastest_time:.6g} s")
