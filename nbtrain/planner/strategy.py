"""One layer's strategy (data-parallel replicate × shard, ZeRO level, TP, checkpointing, offload) and the space
of strategies the search walks; a whole model's plan is :class:`nbtrain.planner.plan.Plan`.

    >>> Strategy(dp_shard=4, tp=2, ac=True)
    Strategy(dp_replicate=1, dp_shard=4, zero=3, tp=2, ac=True, offload=0.0, sp=False, ep=1)
    >>> even_split(26, 2)
    (13, 13)

Pure Python: no torch here.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from nbtrain.checks import is_power_of_two, positive_int, power_of_two_divisors
from nbtrain.errors import InvalidPlanError

SCHEDULES = ("1f1b", "gpipe")
AC_MODES = {"op": "op", "full": True, "none": False}
"""Names ``Strategy.ac`` takes besides True and False, and what each is stored as."""
AC_CHOICES = (False, "op", True)
"""Checkpointing the search offers, from none to full: none, per-op selective, full."""


def plan_int(value, what: str, hint: str) -> int:
    """``value`` as an int ≥ 1, or an InvalidPlanError that names ``what`` and says what to do (``hint``)."""
    return positive_int(value, f"{what}={value!r} is not valid: {hint}", InvalidPlanError)


def even_split(num_layers: int, pp: int) -> tuple[int, ...]:
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
        Strategy(dp_replicate=1, dp_shard=4, zero=2, tp=2, ac=True, offload=0.25, sp=False, ep=1)
        >>> str(Strategy(dp_replicate=2, dp_shard=4, offload=0.25)), Strategy(dp_shard=1, zero=2).zero
        ('dp_replicate=2 dp_shard=4 offload=0.25', 3)
        >>> str(Strategy(dp_shard=2, ac="op")), Strategy(ac="full").ac
        ('dp_shard=2 ac=op', True)
        >>> str(Strategy(tp=2, sp=True)), Strategy(tp=2, sp=True).layout
        ('tp=2 sp', (1, 2, True))
        >>> str(Strategy(dp_shard=4, ep=2))
        'dp_shard=4 ep=2'
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
    """Tensor-parallel degree, Megatron-style (column- then row-parallel pairs); it stays inside a node."""
    ac: bool | str = False
    """Activation checkpointing: ``False`` (none), ``True`` (full: keep only the layer input, recompute the whole
    forward in backward) or ``"op"`` (per-op selective, torchtitan's "op" SAC: keep the input and the outputs of the
    matmuls and attention, recompute the rest). ``if s.ac:`` means some checkpointing."""
    offload: float = 0.0
    """Fraction (0..1) of this layer's optimizer update done on the CPU, kept to 0.001 (see ``__post_init__``)."""
    sp: bool = False
    """Sequence parallelism with the TP (Korthikanti et al. 2022, §4.2.2): what runs token by token (norms, the
    residual adds) runs on ``1/tp`` of the sequence, all-gathers and reduce-scatters replace the all-reduces, and the
    hidden state this layer takes and hands on is split along the sequence over the ``tp`` ranks. Needs ``tp > 1``.
    (Last, so positional construction in the order above still works.)"""
    ep: int = 1
    """Expert-parallel degree (torchtitan's and Megatron's ``ep``): a mixture-of-experts layer's experts are spread
    over ``ep`` of its data-parallel ranks, each holding ``E/ep`` of them, and every token is sent to its experts'
    ranks and its outputs sent back (an all-to-all each way); the experts are data-parallel over the remaining
    ``dp / ep`` ranks. Borrows from the data-parallel ranks (``ep`` divides ``dp_replicate × dp_shard``), so it uses
    no devices of its own; a layer without experts runs as if it were 1."""

    def __post_init__(self):
        for name in ("dp_replicate", "dp_shard", "tp"):
            object.__setattr__(self, name, plan_int(
                getattr(self, name), name, f"{name} is a degree, a positive integer (1 = not used)"))
        if isinstance(self.zero, bool) or self.zero not in (2, 3):
            raise InvalidPlanError(f"zero={self.zero!r} is not valid: use zero=2 (shard gradients and optimizer "
                                   "state) or zero=3 (also shard parameters)")
        if not (self.ac in (True, False) or isinstance(self.ac, str) and self.ac in AC_MODES):
            raise InvalidPlanError(f"ac={self.ac!r} is not valid: activation checkpointing is False (none), True "
                                   "(full recomputation) or 'op' (save attention and every other projection's outputs, "
                                   "recompute the rest)")
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
        object.__setattr__(self, "ac", AC_MODES.get(self.ac, bool(self.ac)) if isinstance(self.ac, str) else
                           bool(self.ac))
        if self.sp not in (True, False):
            raise InvalidPlanError(f"sp={self.sp!r} is not valid: sequence parallelism is True or False")
        if self.sp and self.tp == 1:
            raise InvalidPlanError("sp (sequence parallelism) splits the sequence over the tensor-parallel ranks, "
                                   "so it needs tp > 1: write e.g. 'tp=2 sp', or leave out 'sp'")
        object.__setattr__(self, "sp", bool(self.sp))
        object.__setattr__(self, "ep", plan_int(self.ep, "ep", "the expert-parallel degree is a positive integer "
                                                "(1 = experts not spread)"))
        if self.ep > 1 and self.tp > 1:
            raise InvalidPlanError(f"ep={self.ep} with tp={self.tp}: expert parallelism runs with data parallelism "
                                   "(dp_replicate, dp_shard), not yet with tensor parallelism; use tp=1 with ep")
        if self.ep > 1 and self.dp % self.ep:
            hint = f"use an ep that divides {self.dp}" if self.dp > 1 else "give it dp_shard or dp_replicate, or " \
                "leave out ep"
            raise InvalidPlanError(f"ep={self.ep} spreads the experts over data-parallel ranks, but this layer has "
                                   f"dp_replicate × dp_shard = {self.dp}; {hint}")

    @property
    def devices(self) -> int:
        """Devices one copy of this layer spans inside a pipeline stage: dp_replicate × dp_shard × tp."""
        return self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel degree, replicated and sharded together: how many ways the micro-batch is split."""
        return self.dp_replicate * self.dp_shard

    @property
    def expert_degrees(self) -> tuple[int, int]:
        """``(dp_replicate, dp_shard)`` of the experts of a layer that spreads them over ``ep`` ranks: data-parallel
        over the ``dp / ep`` ranks holding the same experts, ``ep`` taken from ``dp_shard`` first (torchtitan's
        ``dp_shard_mod_ep``), then from ``dp_replicate``.

            >>> Strategy(dp_replicate=2, dp_shard=4, ep=2).expert_degrees, Strategy(dp_replicate=4, ep=2).expert_degrees
            ((2, 2), (2, 1))
        """
        if self.dp_shard % self.ep == 0:
            return self.dp_replicate, self.dp_shard // self.ep
        return self.dp // self.ep, 1

    @property
    def layout(self) -> tuple[int, int, bool]:
        """(dp, tp, sp): how the hidden state this layer takes and hands on is split (batch over dp, the sequence
        over tp when sp); when two consecutive layers differ in it, the hidden state is re-laid-out between them."""
        return (self.dp, self.tp, self.sp)

    def __str__(self) -> str:
        parts = [f"dp_replicate={self.dp_replicate}"] if self.dp_replicate > 1 else []
        parts += [f"dp_shard={self.dp_shard}"] if self.dp_shard > 1 else []
        parts += ["zero=2"] if self.zero == 2 else []
        parts += [f"tp={self.tp}"] if self.tp > 1 else []
        parts += ["sp"] if self.sp else []
        parts += [f"ep={self.ep}"] if self.ep > 1 else []
        parts += ["ac=op"] if self.ac == "op" else ["ac"] if self.ac else []
        parts += [f"offload={format_fraction(self.offload)}"] if self.offload else []
        return " ".join(parts) or "dp_replicate=1"

    def to_dict(self) -> dict:
        """The fields as a dict; ``sp`` only when on and ``ep`` only when > 1, so a plan file without them reads the
        same in an nbtrain that predates them."""
        d = dataclasses.asdict(self)
        if not self.sp:
            del d["sp"]
        if self.ep == 1:
            del d["ep"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Strategy:
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise InvalidPlanError(f"unknown strategy field(s) {', '.join(unknown)} in {d!r}; the fields are "
                                   "dp_replicate, dp_shard, zero, tp, ac, offload, sp, ep")
        return cls(**d)


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
                   offload_levels=(0.0,), allow_ac: bool = True, zero_levels=(2, 3),
                   allow_sp: bool = True, expert_degrees=(1,)) -> list[Strategy]:
    """Every strategy one layer may take on ``devices`` devices (one pipeline stage), pruned as Galvatron does:
    power-of-two degrees, dp_replicate × dp_shard × tp == devices, tp inside a node (≤ devices_per_node) and
    ≤ max_tp, dp ≤ max_dp (the micro-batch size: each data-parallel rank needs at least one sequence), a ZeRO
    level only when dp_shard > 1, every offload level (each rank offloads its own shard, TP's or FSDP's),
    sequence parallelism off and on wherever tp > 1 (``allow_sp``), checkpointing none, per-op selective (``ac=op``)
    or full, and each ``ep`` of ``expert_degrees`` that divides dp where tp = 1 (expert parallelism, for the layers
    with experts). Ordered by tp, dp_shard, zero,
    sp, ac (none, op, full), offload, ep, each ascending. Empty when the caps leave nothing (e.g. 16 devices, 8 per
    node, max_dp=1).

        >>> [str(s) for s in strategy_space(2, devices_per_node=8, allow_ac=False)]
        ['dp_replicate=2', 'dp_shard=2 zero=2', 'dp_shard=2', 'tp=2', 'tp=2 sp']
    """
    devices = plan_int(devices, "devices", "a stage needs at least one device")
    if not is_power_of_two(devices):
        raise InvalidPlanError(f"devices={devices} is not a power of two; the strategy space has power-of-two "
                               "degrees only (use 1, 2, 4, 8, ... devices per pipeline stage)")
    per_node = plan_int(devices_per_node, "devices_per_node", "a node has at least one device")
    if max_tp is not None:
        max_tp = plan_int(max_tp, "max_tp", "the tensor-parallel cap is at least 1")
    if max_dp is not None:
        max_dp = plan_int(max_dp, "max_dp", "the data-parallel cap (the micro-batch size) is at least 1")
    zero_levels = sorted(set(zero_levels))
    if not zero_levels or not set(zero_levels) <= {2, 3}:
        raise InvalidPlanError(f"zero_levels={zero_levels!r} is not valid: use a non-empty subset of (2, 3)")
    powers = power_of_two_divisors(devices)
    out: list[Strategy] = []
    for tp in powers:
        dp = devices // tp
        if tp > per_node or (max_tp is not None and tp > max_tp) or (max_dp is not None and dp > max_dp):
            continue
        for dp_shard in (p for p in powers if p <= dp):
            for zero in zero_levels if dp_shard > 1 else (3,):
                for sp in (False, True) if tp > 1 and allow_sp else (False,):
                    for ac in AC_CHOICES if allow_ac else (False,):
                        for offload in sorted(set(offload_levels)):
                            for ep in sorted(set(expert_degrees) | {1}) if tp == 1 else (1,):
                                if dp % ep:
                                    continue
                                s = Strategy(dp // dp_shard, dp_shard, zero, tp, ac, offload, sp, ep)
                                if not out or out[-1] != s:  # two levels may be equal once rounded to 0.001
                                    out.append(s)
    return out
