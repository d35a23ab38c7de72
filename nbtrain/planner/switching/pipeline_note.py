"""Why a bucket of a hot-switching plan runs in a pipeline: its time beside the fastest strategy without one, what
the pipeline pays (its bubble, the imbalance of its stages, the sends between them, its switches' bytes) and what
the other pays instead (tensor-parallel communication, FSDP's gathers, its own switches), all the cost model's.

    >>> from nbtrain.planner.switching.buckets import plan_buckets
    >>> slow = nbtrain.Cluster.from_catalog("A100", num_devices=4).replace(intra_node_bandwidth=1e8,
    ...                                                                    inter_node_bandwidth=1e8)   # 0.1 GB/s
    >>> hot = plan_buckets(nbtrain.profile("llama-tiny", batch_size=1, seq_len=256), slow, [(128, 32), (256, 4)])
    >>> hot.home.pp, len(hot.why)         # one line per pipelined bucket (none when none is)
    (2, 1)
    >>> print(hot.why[0])                 # doctest: +ELLIPSIS
    (0, 256] 'pp=2 ...': ... with a ... bubble (...) and ... of switches, beside ... for the fastest without a ...
"""

from __future__ import annotations

from nbtrain.planner.prediction import Time
from nbtrain.planner.switching.bucket_strategy import pp_of
from nbtrain.units import format_bytes, format_seconds


def _length(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def pipeline_notes(costs, buckets: list, strategies: list[int], home: int, choices: list[int]) -> tuple[str, ...]:
    """One line per pipelined bucket (``buckets``: their :class:`BucketCost`, ``strategies`` and ``choices``: the
    plan's indices into the space and :data:`MICRO_ROWS` per bucket, ``home``: the home's index)."""
    lines, lower = [], 0
    for b, j, c in zip(buckets, strategies, choices):
        if pp_of(costs.space[j]) > 1:
            lines.append(_why(costs, b, j, c, home, lower))
        lower = b.bound
    return tuple(lines)


def _switch_bytes(costs, home: int, j: int) -> float:
    if costs.layout_index[home] == costs.layout_index[j]:
        return 0.0
    return sum(x.bytes for x in costs.switches(costs.layouts[costs.layout_index[home]],
                                               costs.layouts[costs.layout_index[j]]))


def _alone(costs, b, j: int, c: int, home: int) -> float:
    """The bucket under ``j`` by itself: its passes, its sync and, away from home, its switches."""
    return float(b.passes[c, j] + b.sync[c, j] + costs.switch_s[home, j])


def _why(costs, b, j: int, c: int, home: int, lower: int) -> str:
    s = costs.space[j]
    where = f"({_length(lower)}, {_length(b.bound)}] '{s}'"
    found = costs.pipeline(b, j, c)
    mine = _alone(costs, b, j, c, home)
    parts = [f"{where}: {format_seconds(mine)}"]
    if found is not None:
        stages = [stage.time_per_microbatch for stage in found.stages]
        spread = max(stages) / min(stages) if min(stages) > 0 else 1.0
        m = int(b.microbatches[c, j])
        parts.append(f"with a {format_seconds(found.time.bubble)} bubble ({m} micro-batch{'es' * (m > 1)} over "
                     f"{pp_of(s)} stages, the slowest {spread:.2f}× the fastest, "
                     f"{format_seconds(found.time.pp_comm)} of sends between them not hidden)")
    parts.append(f"and {format_bytes(_switch_bytes(costs, home, j))} of switches")
    flat = [k for k, t in enumerate(costs.space) if pp_of(t) == 1 and not costs.home_only[k]]
    options = [(k, costs.choice(b, home, k, as_home=k == home)) for k in flat]
    options = [(k, ch) for k, ch in options if ch is not None]
    if not options:
        return " ".join(parts) + ", beside no strategy without a pipeline that fits beside the home's states"
    k, ch = min(options, key=lambda kc: _alone(costs, b, kc[0], kc[1], home))
    other = costs.space[k]
    spent = _layer_time(costs, b, k, ch)
    return (" ".join(parts) + f", beside {format_seconds(_alone(costs, b, k, ch, home))} for the fastest without a "
            f"pipeline, '{other}' ({format_seconds(spent.tp_comm)} of tensor-parallel communication, "
            f"{format_seconds(spent.zero3_comm)} of FSDP gathers not hidden, "
            f"{format_bytes(_switch_bytes(costs, home, k))} of switches)")


def _layer_time(costs, b, k: int, c: int) -> Time:
    """The bucket's time under a strategy without a pipeline, by category (the cost model's, Σ over layers)."""
    s, m = costs.space[k], int(b.microbatches[c, k])
    model = costs.model(s.dp * m * int(b.micro_rows[c, k]), b.bound)
    total = Time()
    for i, n in costs.kinds:
        total = total + model.layer(i, s, m).time.scaled(n * m)
    return total

