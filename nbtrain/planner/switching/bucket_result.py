"""What :func:`~nbtrain.planner.switching.buckets.plan_buckets` returns: a strategy per length bucket, the switches
between them and the predicted step, beside the best static plan; and what the search may choose.

    >>> from nbtrain.planner.switching.buckets import plan_buckets
    >>> hot = plan_buckets(nbtrain.profile("llama-tiny", batch_size=1, seq_len=256),
    ...                    nbtrain.Cluster.from_catalog("A100", num_devices=4), [(128, 32), (256, 4)])
    >>> isinstance(hot, BucketPlan), hot.buckets[-1].bound, hot.home == hot.buckets[-1].strategy  # longest: home
    (True, 256, True)
    >>> print(hot)              # one row per bucket, the switches, the update, the static plan and the speed-up
"""

from __future__ import annotations

from dataclasses import dataclass

from nbtrain.planner.cost import CostOptions, Memory
from nbtrain.planner.strategy import Strategy
from nbtrain.planner.switching.bucket_strategy import BucketStrategy, pp_of
from nbtrain.planner.switching.switch_cost import PredictedSwitch
from nbtrain.table import Table
from nbtrain.units import format_bytes, format_seconds


@dataclass(frozen=True)
class BucketOptions:
    """What :func:`plan_buckets` may choose: per bucket a strategy with or without a pipeline, and for the home its
    CPU update offload."""

    allow_ac: bool = True
    """Activation checkpointing may be chosen (per bucket, for every layer)."""
    zero_levels: tuple[int, ...] = (2, 3)
    """ZeRO levels a sharded strategy may take."""
    max_tp: int | None = None
    """A cap on the tensor-parallel degree (None: the node's size)."""
    merge: bool = True
    """Try merging adjacent buckets (False: the buckets as given)."""
    max_pp: int | None = None
    """A cap on a bucket's pipeline degree (None: the devices and the layers; 1: no pipeline)."""
    offload_levels: tuple[float, ...] = (0.0, 0.5, 1.0)
    """Fractions of the home's update that may run on the CPU (CoTrain's overlap with its last bucket's backward)."""
    cost: CostOptions = CostOptions()
    """The cost model's knobs (memory reserve, overlap slowdown, gradient bytes)."""


@dataclass(frozen=True)
class Bucket:
    """One bucket of the plan, as it runs each step."""

    lower: int
    """Lengths above this run here (the previous bucket's bound; 0 for the first)."""
    bound: int
    """Tokens per row."""
    rows: int
    """Rows of ``bound`` tokens per step (merged buckets: the shorter rows packed, rounded up); the empty rows that
    pad it to a multiple of its strategy's dp are priced in ``time_s`` and ``memory``, not counted here."""
    strategy: Strategy | BucketStrategy
    """One strategy for every layer while this bucket runs (a BucketStrategy: in a pipeline)."""
    time_s: float
    """Its forward and backward, plus its strategy's gradient sync when it is that strategy's last bucket."""
    memory: Memory
    """Bytes per device while it runs: the home layout's states plus what this bucket adds (module docstring)."""
    merged: int = 1
    """How many of the given buckets it holds."""
    microbatches: int = 1
    """Micro-batches of ``micro_rows`` rows on each rank (gradients accumulated): the fastest that fit."""
    micro_rows: int = 1
    """Rows per micro-batch on each rank."""

    @property
    def tokens(self) -> int:
        return self.bound * self.rows


@dataclass(frozen=True)
class StaticPlan:
    """The best single strategy under the same memory budget, with the better of two packings: the buckets as given,
    or every document packed into rows of the longest bound (one bucket: what a static system such as Megatron-LM
    does, paying attention over whole rows)."""

    strategy: Strategy | BucketStrategy
    step_time_s: float
    """Σ bucket passes, one gradient sync, the update."""
    memory_bytes: float
    """Its largest bucket's memory per device."""
    bounds: tuple[int, ...] = ()
    """The row lengths it packs into: the buckets' bounds, or only the longest."""
    times: tuple[float, ...] = ()
    """Per bound: its forward and backward (the longest's with the gradient sync)."""
    micro_rows: tuple[int, ...] = ()
    """Per bound: rows per micro-batch on each rank."""


@dataclass(frozen=True)
class BucketPlan:
    """Strategies per length bucket, the switches between them and the predicted step, beside the static plan."""

    model: str
    """The profiled model's name."""
    num_devices: int
    buckets: tuple[Bucket, ...]
    """Shortest first; the last runs under the home strategy."""
    switches: tuple[PredictedSwitch, ...]
    """Per step, in the order they run."""
    update_s: float
    """The optimizer update in the home layout."""
    step_time_s: float
    """Σ bucket times + Σ switch times + the update."""
    tokens: int
    """Tokens per step of the buckets as given (merging pads some rows; these are the data's)."""
    budget_bytes: float
    """Memory per device the plan was made for."""
    static: StaticPlan | None
    """None when no single strategy runs every bucket within the budget."""
    notes: tuple[str, ...] = ()
    """What the planner wants the user to know (how it searched many buckets)."""
    why: tuple[str, ...] = ()
    """Why each pipelined bucket runs in a pipeline: its time beside the fastest strategy without one, what the
    pipeline pays there (bubble, stage imbalance, switch bytes) and what it saves."""

    @property
    def home(self) -> Strategy | BucketStrategy:
        return self.buckets[-1].strategy

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_time_s

    @property
    def memory_bytes(self) -> float:
        return max(b.memory.total for b in self.buckets)

    @property
    def speedup(self) -> float | None:
        """Static step time / this plan's step time (None without a static plan)."""
        return None if self.static is None else self.static.step_time_s / self.step_time_s

    def strategies(self) -> dict[int, Strategy | BucketStrategy]:
        """Bucket bound → strategy: what :class:`nbtrain.run.switching.hot.HotSwitching` takes."""
        return {b.bound: b.strategy for b in self.buckets}

    def micro_rows(self) -> dict[int, int]:
        """Bucket bound → rows per micro-batch on each rank (HotSwitching's ``micro_rows``): what the memory was
        planned for, whatever the rows of a step."""
        return {b.bound: b.micro_rows for b in self.buckets}

    def summary(self) -> str:
        kinds = len({b.strategy for b in self.buckets})
        parts = [f"{len(self.buckets)} bucket{'s' * (len(self.buckets) > 1)}",
                 f"{kinds} strateg{'ies' if kinds > 1 else 'y'}", f"home {self.home}",
                 f"fits {format_bytes(self.memory_bytes)}/{format_bytes(self.budget_bytes)}",
                 f"{format_seconds(self.step_time_s)}/step"]
        if self.static is not None:
            parts.append(f"{self.speedup:.2f}× over static ({self.static.strategy})")
        return "hot switching: " + " · ".join(parts)

    def table(self) -> Table:
        table = Table(["lengths", "rows", "tokens", "strategy", "(dp, tp, pp)", "micro-batches", "time", "memory"],
                      align="lrrlcrrr")
        table.title = f"{self.model or 'model'} on {self.num_devices} devices, one strategy per length bucket"
        for b in self.buckets:
            home = " (home)" if b.strategy == self.home else ""
            table.add(f"({_length(b.lower)}, {_length(b.bound)}]", b.rows, f"{b.tokens:,}", f"{b.strategy}{home}",
                      hotspa_form(b.strategy), f"{b.microbatches} × {b.micro_rows}", format_seconds(b.time_s),
                      format_bytes(b.memory.total))
        table.footer += [f"switch {s}" for s in self.switches] or ["no switch: every bucket runs in the home layout"]
        if self.update_s:
            table.footer.append(f"update in the home layout: {format_seconds(self.update_s)}")
        table.footer.append(f"predicted: {format_seconds(self.step_time_s)} per step · {self.tokens_per_s:,.0f} "
                            f"tokens/s · memory {format_bytes(self.memory_bytes)} of "
                            f"{format_bytes(self.budget_bytes)} per device")
        if self.static is None:
            table.footer.append("static plan: no single strategy runs every bucket within the budget")
        else:
            s = self.static
            table.footer.append(f"static plan '{s.strategy}' for every bucket: {format_seconds(s.step_time_s)} per "
                                f"step, {format_bytes(s.memory_bytes)} per device; speed-up {self.speedup:.2f}×")
        table.footer += [f"why a pipeline: {why}" for why in self.why]
        table.footer += [f"note: {note}" for note in self.notes]
        return table

    def __str__(self) -> str:
        return str(self.table())

    def _repr_html_(self) -> str:
        return self.table()._repr_html_()


def hotspa_form(s) -> str:
    """A bucket's strategy as HotSPa writes it, ``(dp, tp, pp)``: ``hotspa_form(Strategy(dp_shard=8)) == "(8,1,1)"``."""
    return f"({s.dp},{s.tp},{pp_of(s)})"


def _length(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)
