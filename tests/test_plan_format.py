"""Strategies and plans: validation with the arithmetic in the message, the compact form users type, JSON, and the
pruned per-layer strategy space the search walks.

    .venv/bin/pytest tests/test_plan_format.py -q          # about a second, pure Python
"""

from __future__ import annotations

import doctest
import json
import math
import random
import subprocess
import sys

import pytest

from nbtrain.errors import InvalidPlanError
from nbtrain.planner import grammar, strategy as strategy_module
from nbtrain.planner.plan import Plan
from nbtrain.planner.strategy import Strategy, strategy_space

S = Strategy


def roundtrip_text(plan: Plan) -> Plan:
    return Plan.parse(str(plan), num_devices=plan.num_devices, num_layers=plan.num_layers,
                      global_batch=plan.global_batch, seq_len=plan.seq_len, model=plan.model)


def roundtrip_json(plan: Plan) -> Plan:
    return Plan.from_dict(json.loads(json.dumps(plan.to_dict())))


# --- Strategy ----------------------------------------------------------------------------------------------------

def test_strategy_degrees_multiply_to_its_devices_and_layout_is_dp_tp_and_sp():
    s = S(dp_replicate=2, dp_shard=4, tp=2)
    assert (s.devices, s.dp, s.layout) == (16, 8, (8, 2, False))
    assert S().devices == 1 and S().layout == (1, 1, False)
    assert S(tp=2, sp=True).layout == (1, 2, True)


def test_strategy_prints_non_default_keys_in_the_fixed_order():
    assert str(S(dp_replicate=2, dp_shard=4, zero=2, tp=2, ac=True, offload=0.25)) == \
        "dp_replicate=2 dp_shard=4 zero=2 tp=2 ac offload=0.25"
    assert str(S(tp=8, ac=True)) == "tp=8 ac"
    assert str(S(dp_shard=8)) == "dp_shard=8"  # zero=3 is the default and is left out
    assert str(S(offload=1.0)) == "offload=1"


def test_all_default_strategy_prints_dp_replicate_1_so_it_is_never_empty():
    assert str(S()) == "dp_replicate=1"


def test_zero_level_is_normalised_to_3_without_sharding_so_equal_strategies_compare_equal():
    assert S(dp_shard=1, zero=2) == S()
    assert S(dp_replicate=4, zero=2).zero == 3
    assert hash(S(zero=2)) == hash(S())
    assert S(dp_shard=2, zero=2) != S(dp_shard=2, zero=3)


def test_offload_is_kept_to_three_decimals_so_the_compact_form_round_trips():
    assert S(offload=0.12345).offload == 0.123
    assert S(offload=1).offload == 1.0 and isinstance(S(offload=1).offload, float)
    assert str(S(offload=0.1 + 0.2)) == "offload=0.3"


@pytest.mark.parametrize("kwargs, needle", [
    ({"tp": 0}, "tp=0"),
    ({"dp_shard": -2}, "dp_shard=-2"),
    ({"dp_replicate": 1.5}, "dp_replicate=1.5"),
    ({"tp": True}, "tp=True"),
    ({"zero": 1, "dp_shard": 2}, "zero=1"),
    ({"offload": 1.5}, "offload=1.5"),
    ({"offload": -0.1}, "offload=-0.1"),
    ({"offload": float("nan")}, "offload=nan"),
    ({"ac": "yes"}, "ac='yes'"),
])
def test_invalid_strategy_raises_with_the_offending_value(kwargs, needle):
    with pytest.raises(InvalidPlanError, match=needle.replace("(", r"\(").replace(".", r"\.")):
        S(**kwargs)


# --- Plan validation ---------------------------------------------------------------------------------------------

def test_plan_whose_degrees_do_not_multiply_to_the_devices_spells_out_the_product():
    good = S(dp_replicate=2, dp_shard=4)  # 2 × 4 × 1 × pp 2 = 16
    layers = (good,) * 3 + (S(dp_replicate=2, dp_shard=2, tp=1),) + (good,) * 4
    with pytest.raises(InvalidPlanError) as err:
        Plan(num_devices=16, layers=layers, pp=2)
    assert str(err.value) == ("layer 3: dp_replicate × dp_shard × tp × pp = 2 × 2 × 1 × 2 = 8, but the plan is "
                              "for 16 devices; choose degrees whose product is 16")


def test_plan_with_several_wrong_layers_names_the_first_and_counts_the_rest():
    with pytest.raises(InvalidPlanError, match=r"layer 0: .* = 1 × 2 × 1 × 1 = 2, .* \(and 3 more layers\)"):
        Plan(num_devices=8, layers=(S(dp_shard=2),) * 4)


@pytest.mark.parametrize("kwargs, needle", [
    ({"pp": 9}, "pp=9 needs at least 9 layers, but the plan has 8"),
    ({"pp": 0}, "pp=0"),
    ({"microbatches": 0}, "microbatches=0"),
    ({"schedule": "interleaved"}, "schedule='interleaved'"),
    ({"stages": (4, 4)}, "stages=4+4 has 2 stages, but pp=1"),
    ({"pp": 2, "stages": (5, 4)}, "stages=5+4 covers 9 layers, but the plan has 8"),
    ({"pp": 2, "stages": (8, 0)}, "every stage needs at least one layer"),
    ({"global_batch": 0}, "global_batch=0"),
    ({"seq_len": 0}, "seq_len=0"),
    ({"model": 3}, "model=3"),
])
def test_invalid_plan_fields_raise_with_what_to_change(kwargs, needle):
    pp = kwargs.get("pp", 1)
    devices = 8 * pp if pp >= 1 else 8
    with pytest.raises(InvalidPlanError, match=needle.replace("+", r"\+").replace("(", r"\(")):
        Plan(num_devices=devices, layers=(S(dp_replicate=8),) * 8, **kwargs)


def test_global_batch_must_divide_by_microbatches_times_each_layers_dp_and_the_message_shows_the_product():
    layers = (S(dp_replicate=2, tp=2),) * 2 + (S(dp_shard=4),) * 2  # dp 2 then 4
    Plan(num_devices=4, layers=layers, microbatches=4, global_batch=16)
    with pytest.raises(InvalidPlanError) as err:
        Plan(num_devices=4, layers=layers, microbatches=4, global_batch=24)
    assert "global_batch=24 is not divisible by microbatches × dp = 4 × 4 = 16 (layer 2)" in str(err.value)
    assert "multiple of 16" in str(err.value)


def test_fewer_microbatches_than_stages_run_under_gpipe_only_and_1f1b_is_refused_while_the_plan_is_read():
    plan = Plan(num_devices=4, layers=(S(),) * 8, pp=4, microbatches=1, schedule="gpipe")
    assert plan.microbatches == 1  # allowed, though wasteful: torch's GPipe runs any count
    with pytest.raises(InvalidPlanError, match=r"pp=2 mb=1: the 1F1B schedule runs at least as many micro-batches "
                                               r"as stages; use mb=2 or more"):
        Plan.parse("pp=2 mb=1", num_devices=2, num_layers=4)  # torch's Schedule1F1B would refuse it in every worker
    with pytest.raises(InvalidPlanError, match="pp=4 mb=2"):
        Plan(num_devices=4, layers=(S(),) * 8, pp=4, microbatches=2)


def test_a_pipeline_written_without_mb_runs_one_micro_batch_per_stage():
    assert Plan.parse("pp=2", num_devices=2, num_layers=4).microbatches == 2
    assert Plan(num_devices=4, layers=(S(),) * 8, pp=4).microbatches == 4


def test_empty_stages_become_the_even_split_with_the_extra_layers_in_the_earlier_stages():
    plan = Plan(num_devices=4, layers=(S(),) * 26, pp=4)
    assert plan.stages == (7, 7, 6, 6)
    assert plan == Plan(num_devices=4, layers=(S(),) * 26, pp=4, stages=(7, 7, 6, 6))
    assert Plan(num_devices=1, layers=(S(),) * 5).stages == (5,)


def test_schedule_is_normalised_to_1f1b_without_a_pipeline():
    assert Plan(num_devices=2, layers=(S(dp_replicate=2),) * 3, schedule="gpipe").schedule == "1f1b"
    assert Plan(num_devices=2, layers=(S(),) * 3, pp=2, schedule="GPipe").schedule == "gpipe"


def test_stage_ranges_and_stage_of_follow_an_uneven_split():
    plan = Plan(num_devices=6, layers=(S(dp_replicate=2),) * 10, pp=3, stages=(3, 5, 2))
    assert plan.stage_ranges() == [(0, 3), (3, 8), (8, 10)]
    assert [plan.stage_of(i) for i in range(10)] == [0, 0, 0, 1, 1, 1, 1, 1, 2, 2]
    assert plan.devices_per_stage == 2 and plan.num_layers == 10
    with pytest.raises(IndexError):
        plan.stage_of(10)


def test_micro_batch_size_divides_the_global_batch_by_microbatches_and_the_layers_dp():
    layers = (S(dp_shard=8),) + (S(dp_replicate=2, tp=4),) * 2
    plan = Plan(num_devices=8, layers=layers, microbatches=4, global_batch=64)
    assert [plan.micro_batch_size(i) for i in range(3)] == [2, 8, 8]
    with pytest.raises(InvalidPlanError, match="no global_batch"):
        plan.replace(global_batch=None).micro_batch_size(0)


def test_replace_resets_stages_when_pp_changes_and_drops_the_stale_prediction():
    plan = Plan(num_devices=4, layers=(S(),) * 6, pp=4, stages=(3, 1, 1, 1), predicted={"step_time": 1.0})
    assert plan.replace(microbatches=8).stages == (3, 1, 1, 1)
    assert plan.replace(microbatches=8).predicted is None
    assert plan.replace(pp=2, layers=(S(dp_replicate=2),) * 6).stages == (3, 3)
    assert plan.replace(predicted="p").predicted == "p"


# --- the compact form: what users type means what it says --------------------------------------------------------

def test_dp_shard_alone_on_16_devices_is_hsdp_with_the_rest_replicated():
    plan = Plan.parse("dp_shard=4", num_devices=16, num_layers=4)
    assert set(plan.layers) == {S(dp_replicate=4, dp_shard=4)}
    assert (plan.pp, plan.microbatches) == (1, 1)


def test_pipeline_part_alone_replicates_over_the_devices_left_in_each_stage():
    plan = Plan.parse("pp=2 mb=4", num_devices=8, num_layers=6)
    assert (plan.pp, plan.microbatches, plan.schedule, plan.stages) == (2, 4, "1f1b", (3, 3))
    assert set(plan.layers) == {S(dp_replicate=4)}  # 8 / (pp 2 × dp_shard 1 × tp 1)


def test_pipeline_and_layer_parts_together():
    # 16 devices / (pp 2 × dp_shard 4 × tp 2) = 1: nothing is left to replicate.
    plan = Plan.parse("pp=2 mb=8 | dp_shard=4 tp=2 ac", num_devices=16, num_layers=26)
    assert set(plan.layers) == {S(dp_replicate=1, dp_shard=4, zero=3, tp=2, ac=True)}
    assert (plan.pp, plan.microbatches, plan.stages) == (2, 8, (13, 13))


def test_single_strategy_with_flags_and_all_keys():
    assert set(Plan.parse("dp_shard=8 ac", num_devices=8, num_layers=3).layers) == {S(dp_shard=8, ac=True)}
    plan = Plan.parse("offload=0.5 tp=2 zero=2 dp_shard=2 dp_replicate=2", num_devices=8, num_layers=2)
    assert set(plan.layers) == {S(dp_replicate=2, dp_shard=2, zero=2, tp=2, offload=0.5)}


def test_per_range_strategies_cover_every_layer():
    plan = Plan.parse("0-11: tp=2 ac; 12-23: dp_shard=2", num_devices=8, num_layers=24)
    assert plan.layers == (S(dp_replicate=4, tp=2, ac=True),) * 12 + (S(dp_replicate=4, dp_shard=2),) * 12
    plan = Plan.parse("0-4: tp=2; 5: tp=2 ac; 6-7: tp=2", num_devices=2, num_layers=8)
    assert [s.ac for s in plan.layers] == [False] * 5 + [True] + [False] * 2


def test_choices_where_the_brief_was_silent():
    # A range may list several spans; stages alone set pp; offload may be a percentage; without ranges the '|'
    # is optional; a trailing ';' is fine; schedule is case-insensitive.
    plan = Plan.parse("0,9: dp_shard=4; 1-8: tp=4 offload=25%;", num_devices=4, num_layers=10)
    assert plan.layers[0] == plan.layers[9] == S(dp_shard=4) and plan.layers[1] == S(tp=4, offload=0.25)
    plan = Plan.parse("stages=5+3 schedule=GPipe mb=4", num_devices=4, num_layers=8)
    assert (plan.pp, plan.stages, plan.schedule) == (2, (5, 3), "gpipe")
    assert Plan.parse("pp=2 mb=4 tp=2", num_devices=8, num_layers=4) == \
        Plan.parse("pp=2 mb=4 | tp=2", num_devices=8, num_layers=4)


def test_parse_carries_batch_sequence_and_model():
    plan = Plan.parse("dp_shard=8", num_devices=8, num_layers=4, global_batch=32, seq_len=2048, model="gpt2")
    assert (plan.global_batch, plan.seq_len, plan.model) == (32, 2048, "gpt2")


def test_str_prints_the_pipeline_part_only_when_there_is_one_and_ranges_only_when_layers_differ():
    def show(text, devices, layers):
        return str(Plan.parse(text, num_devices=devices, num_layers=layers))

    assert show("dp_shard=8 ac", 8, 4) == "dp_shard=8 ac"
    assert show("mb=4 | dp_shard=8", 8, 4) == "pp=1 mb=4 | dp_shard=8"
    assert show("pp=2", 8, 4) == "pp=2 mb=2 schedule=1f1b | dp_replicate=4"
    assert show("pp=2 mb=1 stages=3+1 schedule=gpipe | tp=4", 8, 4) == "pp=2 mb=1 schedule=gpipe stages=3+1 | tp=4"
    assert show("pp=2 stages=2+2 | tp=4", 8, 4) == "pp=2 mb=2 schedule=1f1b | tp=4"  # even split: not printed
    assert show("0-11: tp=2 ac; 12-23: dp_shard=2", 8, 24) == \
        "0-11: dp_replicate=4 tp=2 ac; 12-23: dp_replicate=4 dp_shard=2"
    assert show("0: dp_shard=4; 1-2: tp=4; 3: dp_shard=4", 4, 4) == "0: dp_shard=4; 1-2: tp=4; 3: dp_shard=4"
    assert show("0-1: ac; 2-3: ac", 1, 4) == "ac"  # equal runs merge


@pytest.mark.parametrize("text, needle", [
    ("tpp=2", "'tpp=2'"),
    ("dp=8", "dp_replicate (DDP) or dp_shard (FSDP)"),
    ("tp=x", "'tp=x': tp takes a positive integer, e.g. 'tp=2'"),
    ("tp=0", "'tp=0'"),
    ("tp=-2", "'tp=-2'"),
    ("offload=2", "'offload=2'"),
    ("offload=abc", "'offload=abc'"),
    ("zero=4 dp_shard=2", "'zero=4'"),
    ("zero=2", "needs dp_shard > 1"),
    ("ac=1", "'ac=1': checkpointing is written 'ac' (full recomputation), 'ac=op'"),
    ("ac=foo", "'ac=foo': checkpointing is written"),
    ("ac=1/0", "'ac=1/0': every k-th layer needs k ≥ 1"),
    ("ac=op ac=1/2", "'ac=1/2' repeats 'ac' (already 'ac=op')"),
    ("tp=2 tp=4", "'tp=4' repeats 'tp' (already 'tp=2')"),
    ("ac ac", "'ac' repeats"),
    ("pp=", "'pp=' has no value; write it as 'pp=2'"),
    ("pp= mb=2", "'pp=' has no value"),
    ("tp = 2", "'tp' has no value"),
    ("pp=2 | tp=2 | ac", "has 2 '|'"),
    ("pp=2 tp=2 | ac", "'tp=2' is a per-layer key, it belongs after '|'"),
    ("pp=2 | mb=4 tp=2", "'mb=4' is a pipeline key, it belongs before '|'"),
    ("0-7: pp=2", "'pp=2' is a pipeline key"),
    ("schedule=zb", "'schedule=zb'"),
    ("stages=4+x", "'stages=4+x'"),
    ("stages=8+0", "'stages=8+0'"),
    ("pp=2 stages=2+3+3", "'stages=2+3+3' has 3 stages, but 'pp=2'"),
    ("pp=2 stages=3+3", "stages=3+3 covers 6 layers, but the plan has 8"),
    ("pp=3", "'pp=3' does not divide the 16 devices"),
    ("pp=16", "pp=16 needs at least 16 layers, but the plan has 8"),
    ("mb=0", "'mb=0'"),
    ("0-8: tp=2", "'0-8' is out of range: the model has 8 layers, 0-7"),
    ("5-3: tp=2; 0-2: ac; 6-7: ac", "'5-3' runs backwards"),
    ("a-b: tp=2", "'a-b' is not a layer range"),
    ("0-3: tp=2; 5-7: ac", "layer 4 is missing"),
    ("0-4: tp=2; 3-7: ac", "layers 3-4 are given more than once"),
    ("0-2: tp=2; 2-5: ac", "layers 6-7 are missing; layer 2 is given more than once"),
    ("0-3: tp=2; 4-7 ac", "'4-7 ac' has no ':' after its layer range"),
    ("0-3: tp=2 4-7: ac", "'4-7:' looks like a layer range"),
    ("tp=2; ac", "has 2 strategies but no layer ranges"),
    ("", "the plan string is empty"),
    ("  |  ", "the plan string is empty"),
])
def test_malformed_plan_strings_raise_one_line_that_quotes_the_offending_token(text, needle):
    with pytest.raises(InvalidPlanError) as err:
        Plan.parse(text, num_devices=16, num_layers=8)
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_degrees_that_do_not_fit_the_devices_spell_out_the_product():
    with pytest.raises(InvalidPlanError) as err:
        Plan.parse("pp=2 | dp_replicate=2 dp_shard=2", num_devices=16, num_layers=8)
    assert "dp_replicate × dp_shard × tp × pp = 2 × 2 × 1 × 2 = 8, but the plan is for 16 devices" in str(err.value)
    with pytest.raises(InvalidPlanError) as err:
        Plan.parse("pp=2 | 0-3: dp_shard=3; 4-7: tp=2", num_devices=16, num_layers=8)
    assert "'0-3: dp_shard=3': pp × dp_shard × tp = 2 × 3 × 1 = 6 does not divide the 16 devices" in str(err.value)
    with pytest.raises(InvalidPlanError, match="tp = 1 × 1 × 32 = 32 does not divide the 16 devices"):
        Plan.parse("tp=32", num_devices=16, num_layers=8)


# --- round trips -------------------------------------------------------------------------------------------------

class Prediction:
    """Stands in for the cost model's prediction: opaque to the plan except for to_dict/from_dict."""

    def __init__(self, step_time: float):
        self.step_time = step_time

    def to_dict(self) -> dict:
        return {"step_time": self.step_time}

    @classmethod
    def from_dict(cls, d: dict) -> Prediction:
        return cls(d["step_time"])


EXAMPLES = {
    "uniform": Plan(num_devices=8, layers=(S(dp_shard=8, ac=True),) * 6),
    "hsdp with batch": Plan(num_devices=16, layers=(S(dp_replicate=4, dp_shard=4, zero=2),) * 4,
                            microbatches=2, global_batch=64, seq_len=1024, model="gpt2"),
    "per range": Plan(num_devices=8, layers=(S(dp_shard=8),) + (S(dp_replicate=2, tp=4, ac=True),) * 22
                      + (S(dp_shard=4, tp=2),), global_batch=16),
    "pipeline, uneven stages": Plan(num_devices=16, layers=(S(dp_shard=4, tp=2),) * 10, pp=2, microbatches=8,
                                    schedule="gpipe", stages=(6, 4), global_batch=64),
    "offload fractions": Plan(num_devices=4, layers=tuple(S(dp_shard=4, offload=f) for f in (1, 0.75, 0.5, 0.125, 0)),
                              model="llama-7b"),
    "single device": Plan(num_devices=1, layers=(S(),) * 3),
    "pp on every device": Plan(num_devices=4, layers=(S(),) * 5, pp=4, stages=(2, 1, 1, 1)),
}


@pytest.mark.parametrize("name", EXAMPLES)
def test_json_round_trip_is_exact(name):
    plan = EXAMPLES[name]
    assert roundtrip_json(plan) == plan
    assert Plan.from_json(plan.to_json()) == plan
    assert json.loads(plan.to_json())["layers"][0] == plan.layers[0].to_dict()  # strategies as plain dicts


@pytest.mark.parametrize("name", EXAMPLES)
def test_parse_of_str_gives_back_an_equal_plan(name):
    assert roundtrip_text(EXAMPLES[name]) == EXAMPLES[name]


def test_prediction_is_stored_by_its_to_dict_and_rebuilt_by_the_given_type_but_not_compared():
    plan = EXAMPLES["uniform"].replace(predicted=Prediction(1.25))
    assert plan == EXAMPLES["uniform"]  # compare=False
    d = json.loads(plan.to_json())
    assert d["predicted"] == {"step_time": 1.25}
    assert Plan.from_dict(d).predicted == {"step_time": 1.25}  # without a type: kept as a dict
    rebuilt = Plan.from_dict(d, prediction_type=Prediction.from_dict)
    assert isinstance(rebuilt.predicted, Prediction) and rebuilt.predicted.step_time == 1.25
    assert Plan.from_dict(d).to_dict() == d


def test_from_dict_rejects_unknown_fields():
    d = EXAMPLES["uniform"].to_dict()
    with pytest.raises(InvalidPlanError, match="unknown field.s. cp"):
        Plan.from_dict({**d, "cp": 2})
    with pytest.raises(InvalidPlanError, match="missing field.s. layers"):
        Plan.from_dict({"num_devices": 8})
    d["layers"][0]["cp"] = 2
    with pytest.raises(InvalidPlanError, match="unknown strategy field"):
        Plan.from_dict(d)


def random_plan(rng: random.Random) -> Plan:
    """A random valid plan: power-of-two and other device counts, per-layer strategies drawn from a small pool so
    that runs of equal layers (and hence ranges) appear, random stage splits, batches that divide."""
    num_devices = rng.choice([1, 2, 4, 6, 8, 12, 16, 32, 64])
    num_layers = rng.randint(1, 30)
    pp = rng.choice([d for d in range(1, num_devices + 1) if num_devices % d == 0 and d <= num_layers])
    per_stage = num_devices // pp
    divisors = [d for d in range(1, per_stage + 1) if per_stage % d == 0]

    def one() -> Strategy:
        tp = rng.choice(divisors)
        dp_shard = rng.choice([d for d in divisors if (per_stage // tp) % d == 0])
        return S(per_stage // (tp * dp_shard), dp_shard, rng.choice([2, 3]), tp, rng.random() < 0.5,
                 rng.choice([0.0, 0.0, 1.0, 0.5, round(rng.random(), 3), rng.random()]))

    pool = [one() for _ in range(rng.randint(1, 4))]
    layers = tuple(rng.choice(pool) for _ in range(num_layers))
    if rng.random() < 0.5:
        cuts = sorted(rng.sample(range(1, num_layers), pp - 1))
        stages = tuple(b - a for a, b in zip([0] + cuts, cuts + [num_layers]))
    else:
        stages = ()
    microbatches = rng.randint(1, 8)
    unit = math.lcm(*(microbatches * s.dp for s in layers))
    return Plan(num_devices=num_devices, layers=layers, pp=pp, microbatches=microbatches,
                schedule=rng.choice(["1f1b", "gpipe"]) if microbatches >= pp else "gpipe", stages=stages,
                global_batch=rng.choice([None, unit * rng.randint(1, 4)]),
                seq_len=rng.choice([None, 128, 4096]), model=rng.choice(["", "gpt2", "mod:make_model"]))


def test_random_valid_plans_round_trip_through_the_compact_form_and_json():
    rng = random.Random(20240611)
    shapes = set()
    for _ in range(400):
        plan = random_plan(rng)
        assert roundtrip_text(plan) == plan, str(plan)
        assert roundtrip_json(plan) == plan, plan.to_json()
        shapes.add((plan.pp > 1, ";" in str(plan), "stages=" in str(plan)))
    assert len(shapes) >= 6  # the sample did reach pipelines, ranges and uneven stages in combination


# --- the per-layer strategy space --------------------------------------------------------------------------------

def test_strategy_space_for_4_devices_2_per_node_is_the_hand_enumeration():
    # tp ∈ {1, 2}: tp=4 would leave the node (2 devices per node).
    # tp=1, dp=4: (dp_replicate, dp_shard) ∈ {(4,1), (2,2), (1,4)}; the sharded two take zero=2 or 3 → 5.
    # tp=2, dp=2: {(2,1), (1,2)}; the sharded one takes zero=2 or 3 → 3, each with sp off and on → 6.
    # No ac, one offload level: 11 in all.
    expected = {
        S(dp_replicate=4), S(dp_replicate=2, dp_shard=2, zero=2), S(dp_replicate=2, dp_shard=2, zero=3),
        S(dp_shard=4, zero=2), S(dp_shard=4, zero=3),
        S(dp_replicate=2, tp=2), S(dp_shard=2, zero=2, tp=2), S(dp_shard=2, zero=3, tp=2),
        S(dp_replicate=2, tp=2, sp=True), S(dp_shard=2, zero=2, tp=2, sp=True), S(dp_shard=2, zero=3, tp=2, sp=True),
    }
    space = strategy_space(4, devices_per_node=2, allow_ac=False)
    assert len(space) == len(expected) and set(space) == expected
    assert space == strategy_space(4, devices_per_node=2, allow_ac=False)  # deterministic order


def test_strategy_space_for_8_devices_in_one_node():
    # dp = 2^k has k+1 (replicate, shard) splits, k of them sharded with two zero levels: 1 + 2k each.
    # tp 1, 2, 4, 8 → dp 8, 4, 2, 1 → 7 + 5 + 3 + 1 = 16; sp off and on where tp > 1: 7 + 2 × 9 = 25;
    # times ac none/op/full = 75.
    space = strategy_space(8, devices_per_node=8)
    assert len(space) == len(set(space)) == 75
    assert all(s.devices == 8 and s.offload == 0.0 for s in space)
    assert {s.tp for s in space} == {1, 2, 4, 8} and {s.ac for s in space} == {False, "op", True}
    assert {s.tp for s in space if s.sp} == {2, 4, 8}
    assert all(s.zero == 3 for s in space if s.dp_shard == 1)


def test_strategy_space_respects_the_caps_and_levels():
    assert {s.tp for s in strategy_space(8, devices_per_node=8, max_tp=2)} == {1, 2}
    assert {s.tp for s in strategy_space(16, devices_per_node=4)} == {1, 2, 4}
    capped = strategy_space(8, devices_per_node=8, max_dp=2)
    assert {s.dp for s in capped} == {1, 2} and {s.tp for s in capped} == {4, 8}
    assert strategy_space(16, devices_per_node=8, max_dp=1) == []  # tp cannot reach 16 inside a node
    space = strategy_space(2, devices_per_node=2, allow_ac=False, zero_levels=(3,), offload_levels=(0.0, 0.5, 1.0))
    assert [str(s) for s in space] == ["dp_replicate=2", "dp_replicate=2 offload=0.5", "dp_replicate=2 offload=1",
                                       "dp_shard=2", "dp_shard=2 offload=0.5", "dp_shard=2 offload=1",
                                       "tp=2", "tp=2 offload=0.5", "tp=2 offload=1",
                                       "tp=2 sp", "tp=2 sp offload=0.5", "tp=2 sp offload=1"]  # each rank its shard
    assert strategy_space(1, devices_per_node=8) == [S(), S(ac="op"), S(ac=True)]


@pytest.mark.parametrize("kwargs, needle", [
    ({"devices": 12, "devices_per_node": 8}, "devices=12 is not a power of two"),
    ({"devices": 0, "devices_per_node": 8}, "devices=0"),
    ({"devices": 8, "devices_per_node": 0}, "devices_per_node=0"),
    ({"devices": 8, "devices_per_node": 8, "max_dp": 0}, "max_dp=0"),
    ({"devices": 8, "devices_per_node": 8, "zero_levels": (1,)}, "zero_levels"),
    ({"devices": 8, "devices_per_node": 8, "offload_levels": (2.0,)}, "offload=2.0"),
])
def test_strategy_space_rejects_impossible_requests(kwargs, needle):
    with pytest.raises(InvalidPlanError, match=needle):
        strategy_space(**kwargs)


# --- the modules themselves --------------------------------------------------------------------------------------

@pytest.mark.parametrize("module", [strategy_module, grammar])
def test_docstring_examples_run(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_planning_types_import_without_torch():
    code = "import sys, nbtrain.planner.strategy, nbtrain.planner.grammar; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
