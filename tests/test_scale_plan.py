"""Scaling a plan to the processes at hand keeps its structure: the inner axes and per-layer choices survive."""

from __future__ import annotations

import pytest

from nbtrain.errors import InvalidArgumentError
from nbtrain.planner.scale import scale_plan
from nbtrain.planner.plan import Plan


def parse(text: str, devices: int, layers: int = 6, **kw) -> Plan:
    return Plan.parse(text, num_devices=devices, num_layers=layers, **kw)


def test_outer_axes_shrink_first_and_tensor_parallel_survives():
    big = parse("pp=4 mb=8 | 0-2: dp_shard=8 tp=2 ac; 3-5: tp=16", 64)
    small = scale_plan(big, 2)
    assert small.num_devices == 2 and small.pp == 1 and small.microbatches == 2  # 8 over 4 stages: 2 per stage
    assert [str(s) for s in small.layers] == ["tp=2 ac"] * 3 + ["tp=2"] * 3


def test_sharding_survives_when_there_is_no_tensor_parallel():
    small = scale_plan(parse("dp_replicate=4 dp_shard=16 zero=2", 64), 2)
    assert str(small.layers[0]) == "dp_shard=2 zero=2"


def test_pipeline_stages_merge_pairwise_while_the_pipeline_fits():
    big = parse("pp=4 stages=1+2+2+1 | dp_shard=2", 8)
    four = scale_plan(big, 4)
    assert four.pp == 2 and four.stages == (3, 3) and str(four.layers[0]) == "dp_shard=2"
    two = scale_plan(big, 2)
    assert two.pp == 1 and str(two.layers[0]) == "dp_shard=2"


def test_a_plan_for_fewer_devices_grows_data_parallel_copies():
    small = scale_plan(parse("tp=2", 2), 8)
    assert str(small.layers[0]) == "dp_replicate=4 tp=2"


def test_the_global_batch_is_the_smallest_every_layer_splits_unless_given():
    plan = parse("mb=2 | 0-2: dp_shard=8; 3-5: tp=8", 8)
    assert scale_plan(plan, 4).global_batch == 2 * 4
    assert scale_plan(plan, 4, global_batch=16, seq_len=64).global_batch == 16


def test_device_counts_that_are_not_a_power_of_two_ratio_are_refused_with_the_nearest():
    with pytest.raises(InvalidArgumentError, match="launch 2 processes"):
        scale_plan(parse("dp_shard=8", 8), 3)


def test_the_docstring_example_runs():
    import doctest

    import nbtrain.planner.scale as module

    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


def test_spread_experts_stay_spread_over_the_data_parallel_ranks_left():
    big = Plan.parse("dp_replicate=2 dp_shard=32 ep=8", num_devices=64, num_layers=4)
    assert str(scale_plan(big, 2)) == "dp_shard=2 ep=2"
    assert str(scale_plan(big, 1)) == "dp_replicate=1"  # one device: no rank to spread over


def test_a_gpipe_plan_with_fewer_micro_batches_than_stages_runs_as_planned():
    """The search offers GPipe with m < pp (1F1B cannot run it); the launch of that plan on its own devices must run
    the plan the table priced, not one with a micro-batch per stage (CI caught the table at mb=1, the launch at mb=2)."""
    plan = parse("pp=2 mb=1 schedule=gpipe | dp_replicate=1", 2, layers=4)
    same = scale_plan(plan, 2, global_batch=6, seq_len=24)
    assert (same.pp, same.microbatches, same.schedule) == (2, 1, "gpipe")
    assert scale_plan(parse("pp=2 mb=2 | dp_replicate=1", 2, layers=4), 2).microbatches == 2  # 1F1B keeps m ≥ pp
