"""What the cost model predicts for a plan: memory and time by what they are made of, per layer, per stage and for
the step (:class:`Prediction`, kept with a plan as ``plan.predicted`` and written to JSON with it).

    >>> (Memory(params=2.0, grads=1.0) + Memory(params=1.0)).total
    4.0
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from functools import cache
from operator import attrgetter


@cache
def _names(kind: type) -> tuple[str, ...]:
    """A dataclass's field names, read once: a plan search adds Memory and Time a million times."""
    return tuple(f.name for f in fields(kind))


class Sum:
    """Fields that add up: ``total`` and field-wise ``+`` (for Memory and Time)."""

    @property
    def total(self) -> float:
        return sum(getattr(self, name) for name in _names(type(self)))

    def __add__(self, other):
        return type(self)(*(getattr(self, name) + getattr(other, name) for name in _names(type(self))))

    @classmethod
    def summed(cls, items):
        """``items[0] + items[1] + ...`` field by field, in that order (the same floats), without a new object per
        ``+``: a stage sums each of its layers' memory and time."""
        get = attrgetter(*_names(cls))
        rows = map(get, items)
        totals = next(rows)
        for row in rows:
            totals = [a + b for a, b in zip(totals, row)]
        return cls(*totals)


@dataclass(frozen=True)
class Memory(Sum):
    """Bytes per device, by what they hold."""

    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    transient: float = 0.0
    reserve: float = 0.0


@dataclass(frozen=True)
class Time(Sum):
    """Seconds per step, by what they are spent on (communication counts only where not hidden)."""

    compute: float = 0.0
    tp_comm: float = 0.0
    zero3_comm: float = 0.0
    dp_comm: float = 0.0
    offload: float = 0.0
    relayout: float = 0.0
    pp_comm: float = 0.0
    bubble: float = 0.0
    update: float = 0.0
    """The device's own optimizer step (its share of the update), where its rate is known: a CPU "device"."""
    ep_comm: float = 0.0
    """Expert parallelism's all-to-alls: tokens to their experts' ranks and back (:mod:`nbtrain.planner.expert_cost`)."""

    def scaled(self, k: float) -> "Time":
        return Time(*(getattr(self, f.name) * k for f in fields(self)))

    def over_step(self, step: float, microbatches: int, pp: int) -> "Time":
        """A step of ``step`` seconds by category, as the devices of the stage whose time per micro-batch this is
        (the slowest) spend it: its ``m`` micro-batches, its once-a-step costs whole (the cost model spreads them over
        ``pp + m − 1`` slots, ``m`` of them inside its micro-batches), idle for the rest (the pipeline bubble)."""
        once = Time(dp_comm=self.dp_comm, offload=self.offload, update=self.update)
        idle = step - microbatches * self.total
        rest = min(pp - 1, idle / once.total) if once.total > 0 else 0.0
        return self.scaled(microbatches) + once.scaled(rest) + Time(bubble=idle - rest * once.total)


@dataclass(frozen=True)
class LayerCost:
    """One layer under one strategy: resident memory, transient peak, and time per micro-batch."""

    memory: Memory
    """Resident bytes with activations for ONE micro-batch (the stage multiplies by the micro-batches in flight)."""
    activations: float
    """Activation bytes of one micro-batch (already in ``memory.activations``)."""
    transient: float
    time: Time
    """Per micro-batch, once-per-step costs spread over the micro-batches."""
    host_bytes: float
    """Offloaded optimizer state in host memory."""

    def resident(self, in_flight: int) -> float:
        return self.memory.total + (in_flight - 1) * self.activations


@dataclass(frozen=True)
class StagePrediction:
    """One pipeline stage: its layers, memory per device and time per micro-batch."""

    start: int
    end: int
    in_flight: int
    memory: Memory
    time_per_microbatch: float
    host_bytes: float


@dataclass(frozen=True)
class Prediction:
    """What the cost model predicts for a plan."""

    step_time_s: float
    tokens_per_s: float
    mfu: float
    """Model FLOPs (no recompute) per step / (step time × devices × peak FLOP/s)."""
    stages: tuple[StagePrediction, ...]
    time: Time
    budget_bytes: float
    host_budget_bytes: float
    reserve_parts: tuple[tuple[str, float], ...] = ()
    """What each stage's ``memory.reserve`` is made of: (what, bytes per device) pairs (:func:`reserve_parts`)."""

    @property
    def memory_bytes(self) -> float:
        """The largest memory per device over the stages."""
        return max(stage.memory.total for stage in self.stages)

    @property
    def fits(self) -> bool:
        host = max(stage.host_bytes for stage in self.stages)
        return self.memory_bytes <= self.budget_bytes and host <= self.host_budget_bytes

    def to_dict(self) -> dict:
        d = asdict(self)
        d["memory_bytes"] = self.memory_bytes
        d["fits"] = self.fits
        d["reserve_parts"] = {what: nbytes for what, nbytes in self.reserve_parts}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Prediction":
        stages = tuple(StagePrediction(**{**s, "memory": Memory(**s["memory"])}) for s in d["stages"])
        keep = {k: v for k, v in d.items() if k not in ("memory_bytes", "fits", "stages", "time", "reserve_parts")}
        parts = d.get("reserve_parts") or {}
        parts = tuple(parts.items()) if isinstance(parts, dict) else tuple(tuple(p) for p in parts)
        return cls(**keep, stages=stages, time=Time(**d["time"]), reserve_parts=parts)
