"""A whole model's plan: the pipeline degree, micro-batches, schedule and stage split, and one strategy per layer,
with the compact form users type (parsed and written by :mod:`nbtrain.planner.grammar`) and its tables
(:mod:`nbtrain.planner.report`).

    >>> from nbtrain.planner.plan import Plan
    >>> plan = Plan.parse("pp=2 mb=8 | dp_shard=4 tp=2 ac", num_devices=16, num_layers=26, global_batch=64)
    >>> plan.layers[0]
    Strategy(dp_replicate=1, dp_shard=4, zero=3, tp=2, ac=True, offload=0.0, sp=False, ep=1)
    >>> print(plan)
    pp=2 mb=8 schedule=1f1b | dp_shard=4 tp=2 ac
    >>> plan.stage_ranges(), plan.micro_batch_size(0)
    ([(0, 13), (13, 26)], 2)
    >>> Plan.from_dict(plan.to_dict()) == plan
    True

Pure Python: no torch here, so the planner and its tests run anywhere in a fraction of a second.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field

from nbtrain.errors import InvalidPlanError
from nbtrain.planner.grammar import format_plan, parse_plan
from nbtrain.planner.report import plan_summary, plan_table
from nbtrain.planner.strategy import SCHEDULES, Strategy, even_split, plan_int


@dataclass(frozen=True)
class Plan:
    """The whole model's plan: one pipeline degree and schedule, one :class:`Strategy` per profiled layer.

        >>> plan = Plan(num_devices=8, layers=(Strategy(dp_shard=4),) * 5 + (Strategy(dp_replicate=2, tp=2),), pp=2)
        >>> plan.stages, plan.stage_of(3), plan.devices_per_stage
        ((3, 3), 1, 4)
        >>> print(plan)
        pp=2 mb=2 schedule=1f1b | 0-4: dp_shard=4; 5: dp_replicate=2 tp=2
        >>> Plan(num_devices=8, layers=(Strategy(dp_shard=2),) * 4)
        Traceback (most recent call last):
        ...
        nbtrain.errors.InvalidPlanError: layer 0: dp_replicate × dp_shard × tp × pp = 1 × 2 × 1 × 1 = 2, but the plan is for 8 devices; choose degrees whose product is 8 (and 3 more layers)
    """

    num_devices: int
    """Devices the plan runs on, all pipeline stages together."""
    layers: tuple[Strategy, ...]
    """One strategy per profiled layer: index 0 is the embeddings, then the blocks, the last is the head."""
    pp: int = 1
    """Pipeline degree, the same for every layer: each stage runs on ``num_devices // pp`` devices."""
    microbatches: int | None = None
    """Micro-batches per step (gradient accumulation steps when ``pp == 1``); None: one per stage (``pp``), the
    fewest 1F1B runs."""
    schedule: str = "1f1b"
    """Pipeline schedule: "1f1b" (stage i keeps pp − i micro-batches in flight) or "gpipe" (all of them).
    Normalised to "1f1b" when ``pp == 1``, where the two are the same gradient accumulation."""
    stages: tuple[int, ...] = ()
    """Layers in each pipeline stage, in order. Empty means split as evenly as possible by layer count (earlier
    stages take the extra layers); normalised to that explicit split so equal plans compare equal."""
    global_batch: int | None = None
    """Sequences per optimizer step, all data-parallel ranks and micro-batches together (None: not chosen yet)."""
    seq_len: int | None = None
    """Tokens per sequence (None: not chosen yet)."""
    model: str = ""
    """The model the plan is for (a preset name or ``module:attribute``), for display and checks."""
    predicted: object | None = field(default=None, compare=False)
    """What the cost model predicts for this plan (an object with ``to_dict()``), or None. Opaque here."""
    alternatives: tuple = field(default=(), compare=False)
    """The next best plans the search found (each with its prediction), best first."""
    notes: tuple = field(default=(), compare=False)
    """What the planner wants the user to know (a dimension it could not search, and why)."""

    def __post_init__(self):
        n = plan_int(self.num_devices, "num_devices", "the plan needs at least one device")
        layers = tuple(self.layers)
        if not layers:
            raise InvalidPlanError("the plan has no layers; give one Strategy per profiled layer")
        for i, s in enumerate(layers):
            if not isinstance(s, Strategy):
                raise InvalidPlanError(f"layer {i} is {s!r}, not a Strategy; build it with Strategy(...)")
        pp = plan_int(self.pp, "pp", "the pipeline degree is a positive integer (1 = no pipeline)")
        if pp > len(layers):
            raise InvalidPlanError(f"pp={pp} needs at least {pp} layers, but the plan has {len(layers)}; "
                                   f"use pp ≤ {len(layers)}")
        wrong = [i for i, s in enumerate(layers) if s.devices * pp != n]
        if wrong:
            s = layers[wrong[0]]
            more = f" (and {len(wrong) - 1} more layers)" if len(wrong) > 1 else ""
            raise InvalidPlanError(
                f"layer {wrong[0]}: dp_replicate × dp_shard × tp × pp = {s.dp_replicate} × {s.dp_shard} × {s.tp} "
                f"× {pp} = {s.devices * pp}, but the plan is for {n} devices; choose degrees whose product is {n}"
                + more)
        mb = plan_int(pp if self.microbatches is None else self.microbatches, "microbatches",
                      "use at least one micro-batch")
        schedule = str(self.schedule).lower()
        if schedule not in SCHEDULES:
            raise InvalidPlanError(f"schedule={self.schedule!r} is not valid: use '1f1b' or 'gpipe'")
        if pp > 1 and schedule == "1f1b" and mb < pp:  # torch's Schedule1F1B refuses it in every worker
            raise InvalidPlanError(f"pp={pp} mb={mb}: the 1F1B schedule runs at least as many micro-batches as "
                                   f"stages; use mb={pp} or more (more micro-batches, a smaller bubble), or "
                                   "schedule=gpipe, which runs any count")
        stages = tuple(self.stages) or even_split(len(layers), pp)
        text = "+".join(str(k) for k in stages)
        for k in stages:
            plan_int(k, "stages", f"stages={text}: every stage needs at least one layer")
        if len(stages) != pp:
            raise InvalidPlanError(f"stages={text} has {len(stages)} stages, but pp={pp}; give one layer count "
                                   "per stage")
        if sum(stages) != len(layers):
            raise InvalidPlanError(f"stages={text} covers {sum(stages)} layers, but the plan has {len(layers)}; "
                                   f"the counts must add up to {len(layers)}")
        if self.global_batch is not None:
            batch = plan_int(self.global_batch, "global_batch", "use at least one sequence per step")
            multiple = math.lcm(*(mb * s.dp for s in layers))
            for i, s in enumerate(layers):
                if batch % (mb * s.dp):
                    raise InvalidPlanError(
                        f"global_batch={batch} is not divisible by microbatches × dp = {mb} × {s.dp} = {mb * s.dp} "
                        f"(layer {i}); choose a global batch that is a multiple of {multiple}")
            object.__setattr__(self, "global_batch", batch)
        if self.seq_len is not None:
            object.__setattr__(self, "seq_len", plan_int(self.seq_len, "seq_len", "use at least one token"))
        if not isinstance(self.model, str):
            raise InvalidPlanError(f"model={self.model!r} is not valid: give the model's name as a string")
        for name, value in (("num_devices", n), ("layers", layers), ("pp", pp), ("microbatches", mb),
                            ("schedule", schedule if pp > 1 else "1f1b"), ("stages", tuple(map(int, stages)))):
            object.__setattr__(self, name, value)

    # -- questions about the plan ------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def devices_per_stage(self) -> int:
        return self.num_devices // self.pp

    def stage_ranges(self) -> list[tuple[int, int]]:
        """Each stage's layers as a half-open (start, end): ``stages=(3, 2)`` → ``[(0, 3), (3, 5)]``."""
        ends = [sum(self.stages[: i + 1]) for i in range(self.pp)]
        return list(zip([0] + ends[:-1], ends))

    def stage_of(self, layer_index: int) -> int:
        """The pipeline stage that runs layer ``layer_index``."""
        for stage, (start, end) in enumerate(self.stage_ranges()):
            if start <= layer_index < end:
                return stage
        raise IndexError(f"layer {layer_index} is out of range: the plan has layers 0-{self.num_layers - 1}")

    def micro_batch_size(self, layer_index: int) -> int:
        """Sequences one data-parallel rank runs per micro-batch at this layer: global_batch // (microbatches × dp)."""
        if self.global_batch is None:
            raise InvalidPlanError("the plan has no global_batch; give one, e.g. plan.replace(global_batch=64)")
        return self.global_batch // (self.microbatches * self.layers[layer_index].dp)

    def replace(self, **changes) -> Plan:
        """A copy with ``changes``. ``stages`` returns to the even split when ``pp`` or the number of layers
        changes (unless given), and ``predicted`` is dropped unless given: it described the old plan."""
        if "layers" in changes:
            changes["layers"] = tuple(changes["layers"])
        resized = "pp" in changes or len(changes.get("layers", self.layers)) != self.num_layers
        if resized and "stages" not in changes:
            changes["stages"] = ()
        changes.setdefault("predicted", None)
        changes.setdefault("alternatives", ())
        changes.setdefault("notes", self.notes)
        return dataclasses.replace(self, **changes)

    # -- the compact form --------------------------------------------------------------------------------------
    def __str__(self) -> str:
        return format_plan(self)

    @classmethod
    def parse(cls, text: str, *, num_devices: int, num_layers: int, global_batch: int | None = None,
              seq_len: int | None = None, model: str = "") -> Plan:
        """Read the compact form (grammar in :mod:`nbtrain.planner.grammar`):

            >>> print(Plan.parse("dp_shard=4", num_devices=16, num_layers=4).layers[0])
            dp_replicate=4 dp_shard=4
        """
        parts = parse_plan(text, num_devices=num_devices, num_layers=num_layers)
        return cls(num_devices=num_devices, global_batch=global_batch, seq_len=seq_len, model=model, **parts)

    # -- JSON --------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        predicted = self.predicted
        if predicted is not None and hasattr(predicted, "to_dict"):
            predicted = predicted.to_dict()
        return {"num_devices": self.num_devices, "layers": [s.to_dict() for s in self.layers], "pp": self.pp,
                "microbatches": self.microbatches, "schedule": self.schedule, "stages": list(self.stages),
                "global_batch": self.global_batch, "seq_len": self.seq_len, "model": self.model,
                "predicted": predicted, "alternatives": [alt.to_dict() for alt in self.alternatives],
                "notes": list(self.notes)}

    @classmethod
    def from_dict(cls, d: dict, prediction_type=None) -> Plan:
        """The inverse of :meth:`to_dict`; ``prediction_type`` (e.g. ``Prediction.from_dict``) rebuilds
        ``predicted`` from its dict, which is otherwise kept as a dict."""
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        missing = [k for k in ("num_devices", "layers") if k not in d]
        if unknown or missing:
            raise InvalidPlanError(f"not a plan written by nbtrain: unknown field(s) {', '.join(unknown) or '-'}, "
                                   f"missing field(s) {', '.join(missing) or '-'}")
        fields = dict(d)
        fields["layers"] = tuple(s if isinstance(s, Strategy) else Strategy.from_dict(s) for s in d["layers"])
        fields["stages"] = tuple(d.get("stages", ()))
        if fields.get("predicted") is not None and prediction_type is not None:
            fields["predicted"] = prediction_type(fields["predicted"])
        fields["alternatives"] = tuple(cls.from_dict(alt, prediction_type) for alt in d.get("alternatives", ()))
        fields["notes"] = tuple(d.get("notes", ()))
        return cls(**fields)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    # -- display (needs a prediction; see nbtrain.planner.report) -------------------------------------------
    def summary(self, label: str = "recommended") -> str:
        return plan_summary(self, label)

    def table(self):
        return plan_table(self)

    def _repr_html_(self) -> str:
        return self.table()._repr_html_()

    @classmethod
    def from_json(cls, text: str, prediction_type=None) -> Plan:
        return cls.from_dict(json.loads(text), prediction_type)
