"""A stage's memory and time are its layers' summed field by field, exactly as adding them one by one would: the
planner's answers (tests/test_plan_speed_same_plans.py) were recorded with ``+``."""

from __future__ import annotations

import operator
import random
from dataclasses import fields
from functools import reduce

import pytest

from nbtrain.planner.prediction import Memory, Time


@pytest.mark.parametrize("kind", [Memory, Time])
def test_summed_gives_the_same_floats_as_adding_one_by_one_in_order(kind):
    rng = random.Random(0)
    # magnitudes from a byte to 10 PB: where the order of the additions changes the float
    items = [kind(*(rng.uniform(0, 1) * 10.0 ** rng.randint(0, 16) for _ in fields(kind))) for _ in range(40)]
    assert kind.summed(items) == reduce(operator.add, items)
    assert kind.summed(items[:1]) == items[0]
