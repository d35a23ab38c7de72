"""A bucket's strategy, as HotSPa writes it (dp, tp, pp): one layer strategy for every layer, and a pipeline.

    >>> s = parse_bucket_strategy("pp=2 tp=2", num_devices=4)
    >>> str(s), pp_of(s), str(layers_of(s)), s.dp, s.tp
    ('pp=2 tp=2', 2, 'tp=2', 1, 2)
    >>> parse_bucket_strategy("dp_shard=4", num_devices=4) == Strategy(dp_shard=4)   # no pipeline: a Strategy
    True
    >>> str(bucket_plan(s, num_devices=4, num_layers=6, microbatches=1))   # fewer micro-batches than stages
    'pp=2 mb=1 schedule=gpipe | tp=2'

A bucket without a pipeline is a plain :class:`~nbtrain.planner.strategy.Strategy`, as before pipelines ran inside
buckets; one with ``pp > 1`` is a :class:`BucketStrategy`: its layers' strategy on each stage's ``N / pp`` devices,
the stages cut evenly by layer count (:func:`~nbtrain.planner.strategy.even_split`, the executor's cut) and a
schedule (1F1B by default, GPipe). The helpers below take either, so code that never sees a pipeline is unchanged.

A pipelined bucket runs its rows in its own micro-batches; 1F1B with fewer micro-batches than stages is the GPipe
order (every stage holds all of them either way), so :func:`bucket_plan` runs GPipe there.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from nbtrain.errors import InvalidArgumentError, InvalidPlanError
from nbtrain.planner.plan import Plan
from nbtrain.planner.strategy import SCHEDULES, Strategy

ANY_LAYERS = 64
"""Layers a strategy's text is parsed against (more than any pipeline degree it may name)."""


@dataclass(frozen=True)
class BucketStrategy:
    """A pipelined bucket's strategy: ``layers`` on each stage's devices, ``pp`` stages, a ``schedule``.

        >>> BucketStrategy(Strategy(dp_replicate=2), pp=2, schedule="gpipe").devices
        4
    """

    layers: Strategy
    """Every layer's strategy inside its stage (over ``num_devices / pp`` devices)."""
    pp: int
    """Pipeline stages (> 1)."""
    schedule: str = "1f1b"
    """``"1f1b"`` or ``"gpipe"``."""

    def __post_init__(self):
        if not isinstance(self.layers, Strategy):
            raise InvalidPlanError(f"a bucket's layers take a Strategy, got {self.layers!r}")
        if not isinstance(self.pp, int) or self.pp < 2:
            raise InvalidPlanError(f"pp={self.pp!r}: a pipelined bucket has at least 2 stages (pp=1 is a Strategy)")
        if self.schedule not in SCHEDULES:
            raise InvalidPlanError(f"schedule={self.schedule!r} is not valid: use '1f1b' or 'gpipe'")

    # what code written for a Strategy reads of a bucket's strategy
    dp = property(lambda self: self.layers.dp)
    tp = property(lambda self: self.layers.tp)
    ac = property(lambda self: self.layers.ac)
    offload = property(lambda self: self.layers.offload)
    dp_shard = property(lambda self: self.layers.dp_shard)
    dp_replicate = property(lambda self: self.layers.dp_replicate)
    zero = property(lambda self: self.layers.zero)
    sp = property(lambda self: self.layers.sp)
    devices = property(lambda self: self.layers.devices * self.pp)

    def __str__(self) -> str:
        inner = str(self.layers)
        parts = [f"pp={self.pp}"] + (["schedule=gpipe"] if self.schedule == "gpipe" else [])
        return " ".join(parts + ([] if inner == "dp_replicate=1" else [inner]))


def pp_of(s) -> int:
    """Pipeline stages of a bucket's strategy (1 for a Strategy)."""
    return s.pp if isinstance(s, BucketStrategy) else 1


def layers_of(s) -> Strategy:
    """The layers' strategy of a bucket's strategy (a Strategy is its own)."""
    return s.layers if isinstance(s, BucketStrategy) else s


def schedule_of(s) -> str:
    return s.schedule if isinstance(s, BucketStrategy) else "1f1b"


def bucket_strategy(layers: Strategy, pp: int = 1, schedule: str = "1f1b"):
    """``layers`` itself without a pipeline, else a :class:`BucketStrategy`."""
    return layers if pp == 1 else BucketStrategy(layers, pp, schedule)


def with_layers(s, **changes):
    """``s`` with its layers' strategy changed (``ac=False``), its pipeline kept."""
    return bucket_strategy(dataclasses.replace(layers_of(s), **changes), pp_of(s), schedule_of(s))


def layout_key(s):
    """The model a bucket's strategy runs on: without checkpointing (toggled per bucket of one model) or offload
    (the home optimizer's, not the model's)."""
    return with_layers(s, ac=False, offload=0.0)


def parse_bucket_strategy(value, num_devices: int):
    """A bucket's strategy from a Strategy, a BucketStrategy or text (``"tp=2"``, ``"pp=2 dp_replicate=2"``,
    ``"pp=2 schedule=gpipe tp=2 ac"``); refuses what a bucket cannot run (a strategy per layer range, ``mb=`` or
    ``stages=``) with what to write instead."""
    if isinstance(value, (Strategy, BucketStrategy)):
        return value
    text = str(value)
    found = Plan.parse(text, num_devices=num_devices, num_layers=ANY_LAYERS)
    words = text.replace("|", " ").split()
    fixed = [w.split("=")[0] for w in words if w.split("=")[0] in ("mb", "stages")]
    if fixed or len(set(found.layers)) > 1:
        what = f"'{fixed[0]}=' is chosen per bucket" if fixed else "a bucket runs one strategy for every layer"
        raise InvalidArgumentError(f"plan {value!r}: {what}; give one strategy such as 'dp_shard=2', 'tp=2 ac' or "
                                   "'pp=2 tp=2' (micro-batches per bucket: micro_rows=, stages cut evenly)")
    return bucket_strategy(found.layers[0], found.pp, found.schedule)


def bucket_plan(s, num_devices: int, num_layers: int, *, microbatches: int | None = None,
                global_batch: int | None = None, seq_len: int | None = None, model: str = "") -> Plan:
    """The uniform plan a bucket runs under: ``s``'s layers on every layer, its pipeline cut evenly, in
    ``microbatches`` (default: one per stage); 1F1B with fewer micro-batches than stages runs as GPipe (module
    docstring)."""
    pp = pp_of(s)
    m = microbatches or pp
    schedule = schedule_of(s) if pp == 1 or m >= pp else "gpipe"
    if pp > num_layers:
        raise InvalidArgumentError(f"'{s}' cuts the model into {pp} stages but it has {num_layers} layers "
                                   f"(embeddings, blocks, head); use pp ≤ {num_layers}")
    return Plan(num_devices=num_devices, layers=(layers_of(s),) * num_layers, pp=pp, microbatches=m,
                schedule=schedule, global_batch=global_batch, seq_len=seq_len, model=model)
