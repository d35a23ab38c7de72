"""Profile → plan → report, once, for every face: ``nbtrain plan``, ``%%autoparallel`` and ``nbtrain demo`` call this.

    >>> from nbtrain.profiler.hardware import Cluster
    >>> from nbtrain.profiler.model import profile
    >>> job = plan_and_compare(profile("gpt-tiny", batch_size=1, seq_len=64), Cluster.from_catalog("H100", num_devices=8),
    ...                        global_batch=32)
    >>> [b.name for b in job.baselines][:2]
    ['DDP', 'FSDP (ZeRO-3)']
    >>> for part in job.report():                      # the plan table, the comparison, notes, the summary
    ...     print(part)

The plan is the search's recommendation, or a plan the user typed (``strategy``) evaluated as it is; the baselines
(DDP, FSDP, Megatron, ...) are predicted on the same cluster and memory budget beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

from nbtrain.planner.cost import CostOptions
from nbtrain.planner.plan import Plan
from nbtrain.planner.recommend import baselines, plan
from nbtrain.planner.report import comparison_table
from nbtrain.planner.search_space import SearchOptions
from nbtrain.profiler.hardware import Cluster
from nbtrain.profiler.result import ModelProfile


@dataclass(frozen=True)
class PlannedModel:
    """A model's profile, the cluster it was planned for, the plan and the baselines beside it."""

    profile: ModelProfile
    cluster: Cluster
    plan: Plan
    baselines: list
    label: str = "recommended"
    """``recommended`` (the search's), or ``your plan`` (a plan the user typed: never called recommended)."""

    def report(self, notes: tuple[str, ...] = ()) -> list:
        """What every face shows, in order: the plan's table, the comparison with the baselines, the plan's notes
        and ``notes`` (one ``note: ...`` line each), then the one-line summary."""
        lines = [f"note: {note}" for note in (*self.plan.notes, *notes)]
        return [self.plan.table(), comparison_table(self.plan, self.baselines, self.label), *lines, self.summary()]

    def summary(self) -> str:
        """The plan's one line, and which cluster it is for: ``... · for this machine: 2 × cpu (calibrated)`` or
        ``... · for 8 × H100 (catalog)``."""
        c = self.cluster
        where = f"this machine: {c.num_devices} × {c.device} ({c.source})" if c.source != "catalog" else \
            f"{c.num_devices} × {c.device} (catalog)"
        return f"{self.plan.summary(label=self.label)} · for {where}"


def plan_and_compare(profile: ModelProfile, cluster: Cluster, *, global_batch: int, seq_len: int | None = None,
                     memory=None, strategy: str | None = None, top: int = 3,
                     options: SearchOptions = SearchOptions(), cost_options: CostOptions = CostOptions(),
                     search_seconds: float | None = None, progress=None) -> PlannedModel:
    """Plan ``profile`` for ``cluster`` (:func:`~nbtrain.planner.recommend.plan`, with its time budget and progress
    reports) and predict the baselines beside it under the same memory budget and cost options (the allocator
    headroom among them)."""
    best = plan(profile, cluster, global_batch=global_batch, seq_len=seq_len, memory=memory, strategy=strategy,
                top=top, options=options, cost_options=cost_options, search_seconds=search_seconds,
                progress=progress)
    known = baselines(profile, cluster, global_batch=global_batch, seq_len=seq_len or profile.seq_len,
                      memory=best.predicted.budget_bytes, cost_options=cost_options)
    return PlannedModel(profile, cluster, best, known, "your plan" if strategy else "recommended")
