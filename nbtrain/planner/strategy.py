"""Strategies (one layer's choice) and plans (the whole model's), with the compact form users type.

    >>> from nbtrain.planner.strategy import Plan, Strategy
    >>> plan = Plan.parse("pp=2 mb=8 | dp_shard=4 tp=2 ac", num_devices=16, num_layers=26, global_batch=64)
    >>> plan.layers[0]
    Strategy(dp_replicate=1, dp_shard=4, zero=3, tp=2, ac=True, offload=0.0)
    >>> print(plan)
    pp=2 mb=8 schedule=1f1b | dp_shard=4 tp=2 ac
    >>> plan.stage_ranges(), plan.micro_batch_size(0)
    ([(0, 13), (13, 26)], 2)
    >>> Plan.from_dict(plan.to_dict()) == plan
    True

The grammar of the compact form is in :mod:`nbtrain.planner.grammar`. Pure Python: no torch here, so the planner
and its tests run anywhere in a fraction of a second.
"""

from __future__ import annotations

import dataclasses
import json
import math
import operator
from dataclasses import dataclass, field

from nbtrain.errors import InvalidPlanError

SCHEDULES = ("1f1b", "gpipe")


def _positive_int(value, what: str, hint: str) -> int:
    """``value`` as an int ≥ 1, or an InvalidPlanError that names ``what`` and says what to do (``hint``)."""
    try:
        n = operator.index(value) if not isinstance(value, bool) else None
    except TypeError:
        n = None
    if n is None or n < 1:
        raise InvalidPlanError(f"{what}={value!r} is not valid: {hint}")
    return n


def _is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _even_split(num_layers: int, pp: int) -> tuple[int, ...]:
    """``num_layers`` over ``pp`` stages by layer count, the earlier stages taking the extra layers (Galvatron's
    public code does the same; the paper's memory-balanced split is left to the search, which sets ``stages``)."""
    q, r = divmod(num_layers, pp)
    return (q + 1,) * r + (q,) * (pp - r)


def format_fraction(x: float) -> str:
    """Up to three decimals, trailing zeros dropped: ``0.25`` → ``'0.25'``, ``1.0`` → ``'1'``."""
    return f"{x:.3f}".rstrip("0").rstrip(".")


@dataclass(frozen=True)
class Strategy:
    """One layer's choice of parallelism, in the ecosystem's names (torchtitan's mesh axes).

        >>> Strategy(dp_shard=4, zero=2, tp=2, ac=True, offload=0.25)
        Strategy(dp_replicate=1, dp_shard=4, zero=2, tp=2, ac=True, offload=0.25)
        >>> str(Strategy(dp_replicate=2, dp_shard=4, offload=0.25)), Strategy(dp_shard=1, zero=2).zero
        ('dp_replicate=2 dp_shard=4 offload=0.25', 3)
    """

    dp_replicate: int = 1
    """Plain data-parallel degree (DDP): full replicas that all-reduce their gradients."""
    dp_shard: int = 1
    """Sharded data-parallel degree (FSDP2): the ranks that split this layer's parameters, gradients, optimizer."""
    zero: int = 3
    """ZeRO level of the sharding when ``dp_shard > 1``: 2 shards gradients and optimizer state and keeps the
    parameters gathered between forward and backward (FSDP ``reshard_after_forward=False``); 3 also reshards the
    parameters after forward (one more all-gather in backward, less memory). Normalised to 3 when ``dp_shard == 1``."""
    tp: int = 1
    """Tensor-parallel degree, Megatron-style with sequence parallelism; it stays inside a node."""
    ac: bool = False
    """Activation checkpointing: keep only the layer input and recompute the rest in backward."""
    offload: float = 0.0
    """Fraction (0..1) of this layer's optimizer update done on the CPU, kept to 0.001 (see ``__post_init__``)."""

    def __post_init__(self):
        for name in ("dp_replicate", "dp_shard", "tp"):
            object.__setattr__(self, name, _positive_int(
                getattr(self, name), name, f"{name} is a degree, a positive integer (1 = not used)"))
        if isinstance(self.zero, bool) or self.zero not in (2, 3):
            raise InvalidPlanError(f"zero={self.zero!r} is not valid: use zero=2 (shard gradients and optimizer "
                                   "state) or zero=3 (also shard parameters)")
        if self.ac not in (True, False):
            raise InvalidPlanError(f"ac={self.ac!r} is not valid: activation checkpointing is True or False")
        try:
            offload = float(self.offload)
        except (TypeError, ValueError):
            offload = math.nan
        if isinstance(self.offload, bool) or not 0.0 <= offload <= 1.0:
            raise InvalidPlanError(f"offload={self.offload!r} is not valid: it is the fraction of the optimizer "
                                   "update done on the CPU, from 0 (none) to 1 (all)")
        # Kept to 0.001 so the compact form (three decimals) round-trips exactly; finer splits mean nothing when
        # the update is divided at parameter-tensor granularity.
        object.__setattr__(self, "offload", round(offload, 3) + 0.0)  # + 0.0 turns -0.0 into 0.0
        object.__setattr__(self, "zero", int(self.zero) if self.dp_shard > 1 else 3)  # no sharding: no level
        object.__setattr__(self, "ac", bool(self.ac))

    @property
    def devices(self) -> int:
        """Devices one copy of this layer spans inside a pipeline stage: dp_replicate × dp_shard × tp."""
        return self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel degree, replicated and sharded together: how many ways the micro-batch is split."""
        return self.dp_replicate * self.dp_shard

    @property
    def layout(self) -> tuple[int, int]:
        """(dp, tp): when two consecutive layers differ in it, activations are re-laid-out between them."""
        return (self.dp, self.tp)

    def __str__(self) -> str:
        parts = [f"dp_replicate={self.dp_replicate}"] if self.dp_replicate > 1 else []
        parts += [f"dp_shard={self.dp_shard}"] if self.dp_shard > 1 else []
        parts += ["zero=2"] if self.zero == 2 else []
        parts += [f"tp={self.tp}"] if self.tp > 1 else []
        parts += ["ac"] if self.ac else []
        parts += [f"offload={format_fraction(self.offload)}"] if self.offload else []
        return " ".join(parts) or "dp_replicate=1"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Strategy:
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise InvalidPlanError(f"unknown strategy field(s) {', '.join(unknown)} in {d!r}; the fields are "
                                   "dp_replicate, dp_shard, zero, tp, ac, offload")
        return cls(**d)


@dataclass(frozen=True)
class Plan:
    """The whole model's plan: one pipeline degree and schedule, one :class:`Strategy` per profiled layer.

        >>> plan = Plan(num_devices=8, layers=(Strategy(dp_shard=4),) * 5 + (Strategy(dp_replicate=2, tp=2),), pp=2)
        >>> plan.stages, plan.stage_of(3), plan.devices_per_stage
        ((3, 3), 1, 4)
        >>> print(plan)
        pp=2 mb=1 schedule=1f1b | 0-4: dp_shard=4; 5: dp_replicate=2 tp=2
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
    microbatches: int = 1
    """Micro-batches per step (gradient accumulation steps when ``pp == 1``)."""
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
        n = _positive_int(self.num_devices, "num_devices", "the plan needs at least one device")
        layers = tuple(self.layers)
        if not layers:
            raise InvalidPlanError("the plan has no layers; give one Strategy per profiled layer")
        for i, s in enumerate(layers):
            if not isinstance(s, Strategy):
                raise InvalidPlanError(f"layer {i} is {s!r}, not a Strategy; build it with Strategy(...)")
        pp = _positive_int(self.pp, "pp", "the pipeline degree is a positive integer (1 = no pipeline)")
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
        mb = _positive_int(self.microbatches, "microbatches", "use at least one micro-batch")
        schedule = str(self.schedule).lower()
        if schedule not in SCHEDULES:
            raise InvalidPlanError(f"schedule={self.schedule!r} is not valid: use '1f1b' or 'gpipe'")
        stages = tuple(self.stages) or _even_split(len(layers), pp)
        text = "+".join(str(k) for k in stages)
        for k in stages:
            _positive_int(k, "stages", f"stages={text}: every stage needs at least one layer")
        if len(stages) != pp:
            raise InvalidPlanError(f"stages={text} has {len(stages)} stages, but pp={pp}; give one layer count "
                                   "per stage")
        if sum(stages) != len(layers):
            raise InvalidPlanError(f"stages={text} covers {sum(stages)} layers, but the plan has {len(layers)}; "
                                   f"the counts must add up to {len(layers)}")
        if self.global_batch is not None:
            batch = _positive_int(self.global_batch, "global_batch", "use at least one sequence per step")
            multiple = math.lcm(*(mb * s.dp for s in layers))
            for i, s in enumerate(layers):
                if batch % (mb * s.dp):
                    raise InvalidPlanError(
                        f"global_batch={batch} is not divisible by microbatches × dp = {mb} × {s.dp} = {mb * s.dp} "
                        f"(layer {i}); choose a global batch that is a multiple of {multiple}")
            object.__setattr__(self, "global_batch", batch)
        if self.seq_len is not None:
            object.__setattr__(self, "seq_len", _positive_int(self.seq_len, "seq_len", "use at least one token"))
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
        from nbtrain.planner.grammar import format_plan

        return format_plan(self)

    @classmethod
    def parse(cls, text: str, *, num_devices: int, num_layers: int, global_batch: int | None = None,
              seq_len: int | None = None, model: str = "") -> Plan:
        """Read the compact form (grammar in :mod:`nbtrain.planner.grammar`):

            >>> print(Plan.parse("dp_shard=4", num_devices=16, num_layers=4).layers[0])
            dp_replicate=4 dp_shard=4
        """
        from nbtrain.planner.grammar import parse_plan

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
        from nbtrain.planner.report import plan_summary

        return plan_summary(self, label)

    def table(self):
        from nbtrain.planner.report import plan_table

        return plan_table(self)

    def _repr_html_(self) -> str:
        return self.table()._repr_html_()

    @classmethod
    def from_json(cls, text: str, prediction_type=None) -> Plan:
        return cls.from_dict(json.loads(text), prediction_type)


def head_split_problem(tp: int, n_head: int | None, n_kv_head: int | None = None) -> str:
    """Why tensor parallelism of degree ``tp`` cannot give every rank whole attention heads, or ``""`` when it can.

        >>> head_split_problem(8, 12)
        'tp=8 does not divide the 12 attention heads; use a tp that divides 12: 1, 2, 3, 4, 6 or 12'
        >>> head_split_problem(2, 64, 8)
        ''

    Megatron's split gives each rank ``n_head / tp`` query heads and ``n_kv_head / tp`` key/value heads (Shoeybi et
    al. 2019, §3), so ``tp`` must divide the key/value heads, which divide the query heads. Unknown heads: ``""``."""
    heads = n_kv_head or n_head
    if tp <= 1 or not heads or heads % tp == 0:
        return ""
    plural = "s" if heads > 1 else ""
    which = f"{heads} key/value head{plural} ({n_head} query heads share them)" if heads != n_head else \
        f"{heads} attention head{plural}"
    divisors = [str(d) for d in range(1, heads + 1) if heads % d == 0]
    if len(divisors) == 1:
        return f"tp={tp} does not divide the {which}; use tp=1"
    return f"tp={tp} does not divide the {which}; use a tp that divides {heads}: " \
           f"{', '.join(divisors[:-1])} or {divisors[-1]}"


def strategy_space(devices: int, *, devices_per_node: int, max_tp: int | None = None, max_dp: int | None = None,
                   offload_levels=(0.0,), allow_ac: bool = True, zero_levels=(2, 3)) -> list[Strategy]:
    """Every strategy one layer may take on ``devices`` devices (one pipeline stage), pruned as Galvatron does:
    power-of-two degrees, dp_replicate × dp_shard × tp == devices, tp inside a node (≤ devices_per_node) and
    ≤ max_tp, dp ≤ max_dp (the micro-batch size: each data-parallel rank needs at least one sequence), a ZeRO
    level only when dp_shard > 1, an offload level only without TP (the executor offloads data-parallel layers). Ordered by tp, dp_shard, zero, ac, offload, each ascending. Empty when the
    caps leave nothing (e.g. 16 devices, 8 per node, max_dp=1).

        >>> [str(s) for s in strategy_space(2, devices_per_node=8, allow_ac=False)]
        ['dp_replicate=2', 'dp_shard=2 zero=2', 'dp_shard=2', 'tp=2']
    """
    devices = _positive_int(devices, "devices", "a stage needs at least one device")
    if not _is_power_of_two(devices):
        raise InvalidPlanError(f"devices={devices} is not a power of two; the strategy space has power-of-two "
                               "degrees only (use 1, 2, 4, 8, ... devices per pipeline stage)")
    per_node = _positive_int(devices_per_node, "devices_per_node", "a node has at least one device")
    if max_tp is not None:
        max_tp = _positive_int(max_tp, "max_tp", "the tensor-parallel cap is at least 1")
    if max_dp is not None:
        max_dp = _positive_int(max_dp, "max_dp", "the data-parallel cap (the micro-batch size) is at least 1")
    zero_levels = sorted(set(zero_levels))
    if not zero_levels or not set(zero_levels) <= {2, 3}:
        raise InvalidPlanError(f"zero_levels={zero_levels!r} is not valid: use a non-empty subset of (2, 3)")
    powers = [2**k for k in range(devices.bit_length()) if devices % 2**k == 0]
    out: list[Strategy] = []
    for tp in powers:
        dp = devices // tp
        if tp > per_node or (max_tp is not None and tp > max_tp) or (max_dp is not None and dp > max_dp):
            continue
        for dp_shard in (p for p in powers if p <= dp):
            for zero in zero_levels if dp_shard > 1 else (3,):
                for ac in (False, True) if allow_ac else (False,):
                    for offload in sorted(set(offload_levels)) if tp == 1 else (0.0,):
                        s = Strategy(dp // dp_shard, dp_shard, zero, tp, ac, offload)
                        if not out or out[-1] != s:  # two levels may be equal once rounded to 0.001
                            out.append(s)
    return out
