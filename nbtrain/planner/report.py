"""Show a plan: a table with one row per pipeline stage, a one-line summary, and the comparison with baselines.

    >>> print(best.summary())
    recommended: pp=2 · dp_replicate=1 · dp_shard=1 · tp=4 · sp on 31/34 · ac on 30/34 · offload 0% · fits 16.00 GiB/16.00 GiB · 1.95 s/step
    >>> print(best.table())
    >>> print(comparison_table(best, baselines(profile, cluster, global_batch=64)))
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from nbtrain.table import Table
from nbtrain.units import format_bytes, format_seconds

if TYPE_CHECKING:  # the plan module imports this one for its tables
    from nbtrain.planner.plan import Plan


def _layer_part(plan: Plan, start: int, end: int) -> str:
    """The compact strategies of layers [start, end): runs of equal strategies as ranges."""
    runs, i = [], start
    while i < end:
        j = i
        while j + 1 < end and plan.layers[j + 1] == plan.layers[i]:
            j += 1
        label = f"{i}" if i == j else f"{i}-{j}"
        runs.append(f"{label}: {plan.layers[i]}")
        i = j + 1
    return "; ".join(runs)


def _most_common(plan: Plan, attribute: str):
    return Counter(getattr(s, attribute) for s in plan.layers).most_common(1)[0][0]


def plan_summary(plan: Plan, label: str = "recommended") -> str:
    """One line: the main degrees, sequence parallelism (where used), checkpointing and offload, memory against the
    budget, time per step."""
    n = plan.num_layers
    ac = sum(bool(s.ac) for s in plan.layers)  # full or per-op ("op") checkpointing
    offload = sum(s.offload for s in plan.layers) / n
    parts = [f"pp={plan.pp}", f"dp_replicate={_most_common(plan, 'dp_replicate')}",
             f"dp_shard={_most_common(plan, 'dp_shard')}", f"tp={_most_common(plan, 'tp')}",
             f"ac on {ac}/{n}", f"offload {offload:.0%}"]
    sp = sum(s.sp for s in plan.layers)
    if sp:  # shown only where used, beside tp
        parts.insert(4, f"sp on {sp}/{n}")
    pred = plan.predicted
    if pred is not None:
        verdict = "fits" if pred.fits else "DOES NOT FIT"
        parts += [f"{verdict} {format_bytes(pred.memory_bytes)}/{format_bytes(pred.budget_bytes)}",
                  f"{format_seconds(pred.step_time_s)}/step"]
    return f"{label}: " + " · ".join(parts)


def plan_table(plan: Plan) -> Table:
    """One row per pipeline stage: its layers and strategies, memory per device by category, time."""
    pred = plan.predicted
    table = Table(["stage", "layers", "strategies", "params", "grads", "optimizer", "activations", "reserved",
                   "total", "time/µbatch"], align="llrrrrrrrr")
    table.title = f"{plan.model or 'plan'} on {plan.num_devices} devices: {plan}"
    for i, (start, end) in enumerate(plan.stage_ranges()):
        row = [str(i), f"{start}-{end - 1}", _layer_part(plan, start, end)]
        if pred is not None:
            stage = pred.stages[i]
            m = stage.memory
            row += [format_bytes(m.params), format_bytes(m.grads), format_bytes(m.optimizer),
                    format_bytes(m.activations + m.transient), format_bytes(m.reserve), format_bytes(m.total),
                    format_seconds(stage.time_per_microbatch)]
        table.add(*row)
    if pred is not None:
        t = pred.time
        table.footer.append(
            f"predicted: {format_seconds(pred.step_time_s)} per step · {pred.tokens_per_s:,.0f} tokens/s · "
            f"MFU {pred.mfu:.1%} · memory {format_bytes(pred.memory_bytes)} of {format_bytes(pred.budget_bytes)} "
            f"per device ({'fits' if pred.fits else 'does NOT fit'})")
        spent = [(name, getattr(t, name)) for name in ("compute", "tp_comm", "ep_comm", "zero3_comm", "dp_comm", "offload",
                                                       "update", "relayout", "pp_comm", "bubble")
                 if getattr(t, name) > 0]
        table.footer.append("time: " + " · ".join(f"{name} {format_seconds(v)}" for name, v in spent))
        host = max(stage.host_bytes for stage in pred.stages)
        if host:
            table.footer.append(f"host memory for offloaded optimizer state: {format_bytes(host)} per device "
                                f"(of {format_bytes(pred.host_budget_bytes)})")
        table.footer.append("activations include the transient peak of the largest layer's backward and recompute")
        table.footer.append(reserve_line(pred))
    table.footer += [f"note: {note}" for note in plan.notes]
    return table


def reserve_line(pred) -> str:
    """What the "reserved" column holds: memory per device taken before the model, by part, and where the figure
    comes from."""
    reserve = max((stage.memory.reserve for stage in pred.stages), default=0.0)
    parts = getattr(pred, "reserve_parts", ())
    if not reserve:
        return "reserved: nothing per device (no CUDA context or NCCL buffers on this device)"
    if len(parts) == 1 and parts[0][0] == "CostOptions.reserve_bytes":
        return f"reserved: {format_bytes(reserve)} per device before the model, as CostOptions.reserve_bytes says"
    what = " + ".join(f"{name} {format_bytes(nbytes)}" for name, nbytes in parts)
    return (f"reserved: {format_bytes(reserve)} per device before the model: {what} "
            "(nbtrain.planner.reserve.reserve_parts cites the figures)")


def compared_plans(recommended: Plan, baselines, label: str = "recommended") -> list[tuple[str, Plan | None, str]]:
    """``(name, plan or None, why)`` for the recommended plan, its alternatives and the baselines, in that order;
    ``why`` is a baseline's note where it has no plan. The comparison table and the notebook's chart show these."""
    rows = [(label, recommended, "")]
    rows += [(f"alternative {i + 1}", alt, "") for i, alt in enumerate(recommended.alternatives)]
    rows += [(b.name, b.plan, b.note if b.plan is None else "") for b in baselines]
    return rows


def executor_cannot_run(why: str) -> bool:
    """Whether a baseline without a plan has none because nbtrain's executor cannot run it on this model (its note
    says so), rather than because it does not apply to the cluster."""
    return "executor" in why


def comparison_table(recommended: Plan, baselines, label: str = "recommended") -> Table:
    """The recommended plan (``label="your plan"``: the one the user typed), its alternatives and the uniform
    baselines, with time, memory, and each step time relative to the first row's."""
    ratio = f"× {label}'s time"
    table = Table(["plan", "strategy", "step time", "memory/device", "fits", ratio], align="llrrlr")
    best = recommended.predicted.step_time_s
    rows = compared_plans(recommended, baselines, label)
    why = {name: reason for name, p, reason in rows if p is None and reason}
    for name, p, reason in rows:
        if p is None:
            table.add(name, "cannot run here" if executor_cannot_run(reason) else "does not apply", "", "", "", "")
            continue
        pred = p.predicted
        speedup = f"{pred.step_time_s / best:.2f}×" if pred.fits else ""
        table.add(name, str(p), format_seconds(pred.step_time_s), format_bytes(pred.memory_bytes),
                  "yes" if pred.fits else "no", speedup)
    table.footer.append(f"{ratio}: that plan's step time divided by {label}'s (2.00× takes twice as long, 0.50× "
                        "half as long)")
    table.footer += [f"{name}: {note}" for name, note in why.items()]
    return table
