"""The fast search answers as the slow one did (issue 46): the same plans, the same predictions, the same notes.

    .venv/bin/python -m pytest -q tests/test_plan_speed_same_plans.py       # ~1 min; the 70B and Mixtral cases slow

Three promises, each checked where it can break:

* on the fixed cases of ``tests/plan_cases.py`` (GPT-2 as the explorer replans it, LLaMA-7B at four budgets, with
  pipelines and offload, LLaMA-70B on 64 and 1,024 H100s, Mixtral with ``ep`` on 64), the search's top 3 and
  ``nbtrain.plan``'s recommendation, alternatives, predictions and notes are those recorded before the speed-up,
  exactly (``tests/data/plans_before_speedup.json.gz``; the profiles are recorded with them);
* the bounds that skip sub-problems and stage ranges change no answer: the search with them and without them
  agree (this holds whatever the cost model's numbers are);
* the shared price tables price a layer as the cost model does: no price depends on the memory budget (so a new
  budget reuses them), and layers share prices only when every input about them is equal.
"""

from __future__ import annotations

import dataclasses

import pytest

from nbtrain.planner import cost_tables
from nbtrain.planner.cost import CostModel
from nbtrain.planner.cost_tables import SharedCostModel, twins
from nbtrain.planner.plan import Plan
from nbtrain.planner.search import search
from nbtrain.planner.search_space import SearchOptions
from nbtrain.planner.solver import Solver
from nbtrain.planner.strategy import Strategy
from nbtrain.profiler.hardware import Cluster
from nbtrain.units import parse_bytes

from tests.plan_cases import CASES, answer, profiles, recorded_from

RECORDED = recorded_from()
PROFILES = profiles(RECORDED)


@pytest.fixture(autouse=True)
def fresh_tables():
    """Each test prices from nothing: a table another test filled would hide what this one checks."""
    cost_tables.forget()
    yield
    cost_tables.forget()


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c.slow else c for c in CASES],
                         ids=[c.name for c in CASES])
def test_the_search_answers_as_it_did_before_it_was_made_fast(case):
    assert answer(case, PROFILES[case.model]) == RECORDED["answers"][case.name]


@pytest.mark.parametrize("name", ["gpt2 on 4 at 3 GiB (the explorer's second change)", "llama-7b on 8 at 16 GiB",
                                  "llama-7b on 16 one a node at 12 GiB (pipeline and offload)",
                                  "llama-7b on 8 one a node at 12 GiB, pp 2 or 4"])
def test_the_bounds_that_skip_work_change_no_answer(name, monkeypatch):
    case = next(c for c in CASES if c.name == name)
    profile = PROFILES[case.model]
    kwargs = dict(global_batch=case.batch, seq_len=profile.seq_len, top=3,
                  memory=parse_bytes(case.memory) if case.memory else None,
                  options=SearchOptions(pp_degrees=case.pp_degrees))
    bounded = search(profile, case.cluster(), **kwargs)
    cost_tables.forget()
    monkeypatch.setattr(Solver, "prune", False)
    every = search(profile, case.cluster(), **kwargs)
    assert [(str(p), p.predicted) for p in bounded] == [(str(p), p.predicted) for p in every]


def test_no_layer_price_depends_on_the_memory_budget():
    """What lets the explorer keep its tables when a budget is typed: ``CostModel.layer``, ``relayout`` and ``p2p``
    at 3 GiB and at 80 GiB give the same costs. (A cost term that reads the budget would break this, and then
    :class:`SharedCostModel`'s table must take the budget in its key.)"""
    profile = PROFILES["llama-7b"]
    cluster = Cluster.from_catalog("H100", num_devices=8)
    tight, loose = (CostModel(profile, cluster, global_batch=64, budget_bytes=b) for b in (3 * 2**30, 80 * 2**30))
    strategies = [Strategy(dp_shard=8, ac=True), Strategy(dp_shard=4, tp=2, sp=True, ac="op", offload=0.5),
                  Strategy(dp_replicate=2, tp=4), Strategy(tp=8)]
    for index in (0, 1, 17, len(profile.layers) - 1):
        for s in strategies:
            assert tight.layer(index, s, 4, 2) == loose.layer(index, s, 4, 2)
            assert tight.p2p(index, s, 4, 2, 0) == loose.p2p(index, s, 4, 2, 0)
            for after in strategies:
                assert tight.relayout(index, s, after, 4) == loose.relayout(index, s, after, 4)


def test_layers_share_prices_only_when_every_fact_about_them_is_equal():
    profile = PROFILES["llama-70b"]
    ids = twins(profile)
    assert ids[0] != ids[1] and len(set(ids[1:-1])) == 1 and ids[-1] != ids[1]  # 80 equal blocks
    pairs = list(profile.arch["tp_pairs"])
    pairs[7] += 1  # block 7 now issues another collective under TP
    odd = dataclasses.replace(profile, arch={**profile.arch, "tp_pairs": pairs})
    ids = twins(odd)
    assert ids[7] != ids[6] and ids[6] == ids[8]


def test_the_shared_model_predicts_any_plan_as_the_cost_model_does():
    profile = PROFILES["gpt2"]
    pairs = list(profile.arch["tp_pairs"])
    pairs[3] += 1
    profile = dataclasses.replace(profile, arch={**profile.arch, "tp_pairs": pairs})  # one block unlike the others
    cluster = Cluster.from_catalog("H100", num_devices=8)
    plan = Plan.parse("0-5: dp_shard=4 tp=2 sp ac; 6-13: dp_shard=2 tp=4 ac=op", num_devices=8, num_layers=14,
                      global_batch=32, seq_len=1024)
    plain = CostModel(profile, cluster, global_batch=32, budget_bytes=24 * 2**30).estimate(plan)
    shared = SharedCostModel(profile, cluster, global_batch=32, budget_bytes=24 * 2**30)
    assert shared.estimate(plan) == plain and shared.estimate(plan) == plain  # priced, then from the table


def test_a_second_search_at_another_budget_prices_no_layer_again(monkeypatch):
    """The explorer's budget box: the first search prices the layers, the next ones only look them up."""
    profile = PROFILES["gpt2"]
    cluster = Cluster.from_catalog("H100", num_devices=4)
    priced = []
    real = CostModel.layer
    monkeypatch.setattr(CostModel, "layer", lambda self, *args: priced.append(args) or real(self, *args))
    first = search(profile, cluster, global_batch=32, memory=3 * 2**30)
    assert priced and first
    priced.clear()
    search(profile, cluster, global_batch=32, memory=4 * 2**30)
    search(profile, cluster, global_batch=32, memory=3 * 2**30)
    assert priced == []


def test_the_search_tells_layers_apart_by_every_field_but_their_names_and_timings():
    """Blocks share one table and one cached frontier in the search only when nothing about them differs: a field
    of the profile the search's own signature never named (``param_bytes`` here; which parameters train, when a
    profile says so) tells a block apart, a measured time (noise between equal blocks) does not."""
    from nbtrain.planner.search import layer_kinds

    profile = PROFILES["llama-70b"]
    layers = list(profile.layers)
    layers[5] = dataclasses.replace(layers[5], param_bytes=layers[5].param_bytes // 2)
    layers[6] = dataclasses.replace(layers[6], time_fwd_s=0.0123, time_bwd_s=0.0246)
    kinds = layer_kinds(dataclasses.replace(profile, layers=tuple(layers)))
    assert kinds[5] != kinds[4] == kinds[6] == kinds[7]
