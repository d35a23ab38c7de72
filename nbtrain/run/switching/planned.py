"""What ``fit`` trains variable-length documents under: bucket bounds, a strategy and micro-batches per bucket, and
whether switching between them pays — planned for the model and machine at hand, or the user's own strategies.

    >>> docs = histogram_documents(WIKIPEDIA, 2000, scale=8, vocab_size=2048)     # lengths ÷ 8
    >>> chosen = plan_documents(model, docs, num_processes=2, memory="200MiB")     # on this machine, measured
    >>> print(chosen)                # the bucket plan, the static plan beside it, and which one is trained
    >>> chosen.strategies, chosen.micro_rows, chosen.bounds

The documents are bucketed by length (powers of two from 256 up to the model's context, by default) and each
bucket's rows per step are counted over the first steps of :func:`nbtrain.data.length_batches`;
:func:`~nbtrain.planner.switching.buckets.plan_buckets` then merges buckets, and chooses a strategy per bucket,
beside the best single strategy (the static plan). Switching is trained only when the planner predicts it at least
:data:`WORTH_SWITCHING` times faster; otherwise the static plan is, and the summary says so with both predictions.
A plan the user gives (``plan={512: "dp_replicate=2", 4096: "tp=2"}``, or one strategy for every bucket) is
priced the same way when a cluster is known.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

from torch import nn

from nbtrain.checks import positive_int
from nbtrain.data import as_documents, mean_bucket_rows, power_of_two_bounds
from nbtrain.errors import InvalidArgumentError
from nbtrain.models.adapters import detect_family
from nbtrain.planner.strategy import Strategy
from nbtrain.planner.switching.bucket_strategy import parse_bucket_strategy, pp_of
from nbtrain.planner.switching.bucket_search import SwitchingCostModel
from nbtrain.planner.switching.buckets import (BucketOptions, BucketPlan, MAX_BUCKETS, StaticPlan, plan_buckets,
                                              price_buckets, step_tokens)
from nbtrain.profiler.hardware import Cluster
from nbtrain.profiler.model import lm_loss, profile
from nbtrain.profiler.timed import timed_profile
from nbtrain.units import format_bytes, format_seconds

WORTH_SWITCHING = 1.05
"""The predicted speed-up over the static plan below which ``fit`` trains the static plan (no switches, one layout
resident)."""

SMALLEST_BOUND = 256
"""The shortest row length of the default buckets."""


@dataclass(frozen=True)
class DocumentPlan:
    """How a run over variable-length documents is laid out."""

    strategies: dict
    """Bucket bound → strategy (a Strategy, or a pipelined BucketStrategy; the longest is the home)."""
    micro_rows: dict[int, int | None]
    """Bucket bound → rows per micro-batch on each rank (None: all at once)."""
    tokens_per_step: int
    num_processes: int
    predicted: BucketPlan | None = None
    """The priced plan that is trained (None without a cluster to price it on)."""
    alternative: str = ""
    """What was not chosen, with its prediction (the static plan or the switching one)."""
    switching: bool = True
    """More than one strategy (or checkpointing per bucket): the run switches."""
    static: StaticPlan | None = None
    """The planner's best single strategy beside its switching plan (when it planned)."""
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def bounds(self) -> list[int]:
        return sorted(self.strategies)

    @property
    def home(self):
        return self.strategies[self.bounds[-1]]

    def describe(self) -> str:
        """``256: dp_replicate=2 · 4096: tp=2 ac (home)``."""
        return " · ".join(f"{b}: {s}" + (f" in {self.micro_rows[b]}-row micro-batches" if self.micro_rows[b] else "")
                          + (" (home)" if b == self.bounds[-1] else "") for b, s in self.strategies.items())

    def summary(self) -> str:
        kind = "hot switching" if self.switching else "one strategy for every bucket"
        line = f"{kind}: {self.describe()}; ~{self.tokens_per_step:,} tokens per step on {self.num_processes} processes"
        if self.predicted is not None:
            line += f"; predicted {format_seconds(self.predicted.step_time_s)} per step"
        return line

    def __str__(self) -> str:
        parts = [str(self.predicted)] if self.predicted is not None else []
        parts.append(self.summary())
        parts += [self.alternative] if self.alternative else []
        parts += [f"note: {note}" for note in self.notes]
        return "\n".join(parts)


def default_bounds(model: nn.Module, lengths: list[int]) -> list[int]:
    """Powers of two from :data:`SMALLEST_BOUND` to what the longest document needs, capped at the model's context
    (a longer document is cut there) and at :data:`MAX_BUCKETS` buckets (the longest ones kept)."""
    context = detect_family(model).max_seq_len
    largest = 1 << (context.bit_length() - 1) if context else None  # the largest power of two within it
    smallest = min(SMALLEST_BOUND, largest) if largest else SMALLEST_BOUND
    return power_of_two_bounds(lengths, smallest=smallest, largest=largest)[-MAX_BUCKETS:]


def given_strategies(plan, bounds: list[int], num_processes: int) -> dict:
    """A user's plan for the buckets: ``{bound: strategy}`` (text, a Strategy or a pipelined BucketStrategy:
    ``"tp=2"``, ``"pp=2 dp_replicate=2"``), or one strategy for all."""
    def parsed(value):
        return parse_bucket_strategy(value, num_processes)

    if isinstance(plan, dict):
        if not plan:
            raise InvalidArgumentError("plan={} gives no bucket; give {bound: strategy}, e.g. {512: 'dp_replicate=2', "
                                       "4096: 'tp=2'}")
        for bound in plan:
            positive_int(bound, f"plan's bucket bounds must be positive token counts, got {bound!r}")
        return {int(b): parsed(s) for b, s in sorted(plan.items())}
    one = parsed(plan)
    return {b: one for b in bounds}


def plan_documents(model: nn.Module, documents, *, num_processes: int, plan=None, bounds=None,
                   tokens_per_step: int | None = None, memory=None, cluster: Cluster | None = None, seed: int = 0,
                   progress=print, options: BucketOptions | None = None) -> DocumentPlan:
    """The layout ``fit`` trains ``documents`` under (module docstring). ``plan``: None (the planner chooses), one
    strategy (``"dp_shard=2"``) or ``{bound: strategy}``. ``bounds``: the candidate bucket bounds (powers of two;
    default :func:`default_bounds`). ``tokens_per_step``: default 8 rows of the longest bound. ``memory``: the
    budget per device (default the device's). ``cluster``: where to price it (default: this machine, measured).
    ``options``: what the planner may choose (:class:`~nbtrain.planner.switching.buckets.BucketOptions`; e.g.
    ``BucketOptions(max_pp=1)``: no pipelined bucket)."""
    docs = as_documents(documents)
    positive_int(num_processes, f"num_processes must be a positive integer, got {num_processes!r}")
    if isinstance(plan, dict):
        given = given_strategies(plan, [], num_processes)
        bounds = sorted(given)
    else:
        bounds = sorted(bounds) if bounds is not None else default_bounds(model, [len(d) for d in docs])
        given = None if plan is None else given_strategies(plan, bounds, num_processes)
    tokens_per_step = tokens_per_step or 8 * bounds[-1]
    positive_int(tokens_per_step, f"tokens_per_step must be a positive integer, got {tokens_per_step!r}")
    rows = mean_bucket_rows(docs, tokens_per_step=tokens_per_step, bounds=bounds, seed=seed)
    if cluster is None and given is not None:  # the user's plan, nothing to price it on
        return DocumentPlan(given, {b: None for b in given}, tokens_per_step, num_processes,
                            switching=len(set(given.values())) > 1)
    cluster = _cluster(cluster, num_processes, progress)
    prof = _profile(model, cluster, bounds[-1])
    if given is not None:
        priced = price_buckets(prof, cluster, rows, given, memory=memory, options=options)
        return DocumentPlan(given, priced.micro_rows(), tokens_per_step, num_processes, priced,
                            switching=len(set(given.values())) > 1)
    hot = plan_buckets(prof, cluster, rows, memory=memory, options=options)
    static = hot.static
    if static is not None and hot.speedup < WORTH_SWITCHING:
        strategies = {b: static.strategy for b in static.bounds}
        static_rows = mean_bucket_rows(docs, tokens_per_step=tokens_per_step, bounds=list(static.bounds), seed=seed)
        chosen = price_buckets(prof, cluster, static_rows, strategies, memory=memory, options=options)
        why = (f"switching does not pay here: predicted {format_seconds(hot.step_time_s)} per step with a strategy "
               f"per bucket, {format_seconds(static.step_time_s)} with '{static.strategy}' for all "
               f"({hot.speedup:.2f}×, under {WORTH_SWITCHING}×): training '{static.strategy}'")
        return DocumentPlan(strategies, chosen.micro_rows(), tokens_per_step, num_processes, chosen, why,
                            switching=False, static=static)
    static_text = "no single strategy fits every bucket" if static is None else \
        f"the static plan '{static.strategy}' would take {format_seconds(static.step_time_s)} per step " \
        f"({hot.speedup:.2f}× slower)"
    return DocumentPlan(hot.strategies(), hot.micro_rows(), tokens_per_step, num_processes, hot,
                        f"hot switching chosen: {static_text}", switching=len(set(hot.strategies().values())) > 1, static=static,
                        notes=hot.notes)


@dataclass(frozen=True)
class LongestBucketNeeds:
    """What the longest bucket needs per device, at the most micro-batches (one row each): the least under any
    strategy, and the least without tensor parallelism, checkpointing, a pipeline or offload."""

    least: float
    leanest: object
    """The strategy that needs the least (a Strategy, or a pipelined BucketStrategy)."""
    plain: float
    plain_strategy: Strategy

    def __str__(self) -> str:
        return (f"the longest bucket needs {format_bytes(self.least)} per device at the least ('{self.leanest}'), "
                f"{format_bytes(self.plain)} without TP, checkpointing, a pipeline or offload ('{self.plain_strategy}')")


def longest_bucket_needs(model: nn.Module, documents, *, num_processes: int, tokens_per_step: int | None = None,
                         bounds=None, cluster: Cluster | None = None, seed: int = 0) -> LongestBucketNeeds:
    """The memory the longest bucket of ``documents`` needs under the planner's model, for choosing a budget that
    binds (``memory=1.25 * needs.least``: the longest bucket then needs TP or checkpointing when ``needs.plain`` is
    larger), on ``cluster`` (default: this machine).

        >>> needs = longest_bucket_needs(model, docs, num_processes=2)
        >>> print(needs)          # the longest bucket needs ... at the least ('tp=2 ac'), ... without TP or ...
    """
    docs = as_documents(documents)
    bounds = sorted(bounds) if bounds is not None else default_bounds(model, [len(d) for d in docs])
    rows = mean_bucket_rows(docs, tokens_per_step=tokens_per_step or 8 * bounds[-1], bounds=bounds, seed=seed)
    cluster = _cluster(cluster, num_processes, print)
    costs = SwitchingCostModel(_profile(model, cluster, bounds[-1]), cluster, None, BucketOptions(),
                               step_tokens=step_tokens(rows))
    need = costs.home_memory(costs.bucket(*rows[-1])).min(axis=0)  # each strategy at its most micro-batches
    j = int(need.argmin())
    plain = [k for k, s in enumerate(costs.space) if s.tp == 1 and not s.ac and pp_of(s) == 1 and not s.offload]
    p = min(plain, key=lambda k: need[k])
    return LongestBucketNeeds(float(need[j]), costs.space[j], float(need[p]), costs.space[p])


def _cluster(cluster, num_processes: int, progress) -> Cluster:
    if cluster is None:
        return Cluster.this_machine(num_processes, progress=progress)
    if not isinstance(cluster, Cluster):
        raise InvalidArgumentError(f"cluster must be a Cluster, got {type(cluster).__name__} {cluster!r}; pass "
                                   "nbtrain.Cluster.this_machine(2) for this machine, or Cluster.load(FILE)")
    if cluster.num_devices != num_processes and cluster.num_nodes == 1:
        cluster = cluster.replace(num_devices=num_processes, devices_per_node=num_processes)
    if cluster.source != "catalog" and cluster.device == "cpu" and num_processes > 1 and not cluster.links:
        cluster = cluster.with_links(num_processes)
    return cluster


@dataclass(frozen=True)
class PackedRowInputs:
    """Token ids and ``doc_ids`` of packed rows, for a model that keeps attention inside each document: its
    attention then runs with a ``[T, T]`` mask (slower and larger than a causal kernel), as training will.
    Comparable, so that the timed profile's cache knows it again."""

    vocab_size: int
    name: str
    """The model's first argument (``idx`` for nbtrain's GPT)."""

    def __call__(self, batch: int, seq: int, device):
        import torch

        ids = torch.randint(0, self.vocab_size, (batch, seq + 1), device=device)
        doc_ids = (torch.arange(seq, device=device) * 4 // seq).expand(batch, seq)  # four documents a row
        return {self.name: ids[:, :-1], "doc_ids": doc_ids.contiguous()}, ids[:, 1:]


def takes_doc_ids(model: nn.Module) -> bool:
    return "doc_ids" in inspect.signature(model.forward).parameters


def _profile(model: nn.Module, cluster: Cluster, seq_len: int):
    """The layers' costs at one row of the longest bound, with the documents' attention mask where the model takes
    one: timed as a worker runs them on this machine's CPU."""
    workload = {}
    if takes_doc_ids(model):
        first = next(iter(inspect.signature(model.forward).parameters))
        workload = dict(inputs=PackedRowInputs(detect_family(model).vocab_size, first), loss_fn=lm_loss)
    if cluster.source != "catalog" and cluster.device == "cpu":
        return timed_profile(model, batch_size=1, seq_len=seq_len, **workload)
    return profile(model, batch_size=1, seq_len=seq_len, dtype="fp32", **workload)
