"""Scale a plan to the devices at hand: the plan for 64 GPUs is shown, a 2-process version of it runs here.

    >>> big = Plan.parse("pp=4 mb=8 | 0-5: dp_shard=8 tp=2 ac; 6-13: tp=16", num_devices=64, num_layers=14)
    >>> print(scale_plan(big, 2))
    pp=1 mb=2 | 0-5: tp=2 ac; 6-13: tp=2

Axes shrink from the outside in, each halved in turn, until the plan has as many devices as processes: first the
pipeline (``pp``, whose stages merge pairwise), then ``dp_replicate``, then ``dp_shard``, and ``tp`` last. The
inner axes are the ones that change how a layer computes (a tensor-parallel matmul, a sharded optimizer), so a
small run keeps as much of them as it can; checkpointing, ZeRO level, offload and schedule stay as planned, expert
parallelism over as many data-parallel ranks as are left (``dp_shard=32 ep=8`` on 2 devices: ``dp_shard=2 ep=2``), and
micro-batches shrink with the pipeline (as many per stage as planned: they were there to fill its bubble; a GPipe
plan with fewer micro-batches than stages keeps its count, which the search chose and the executor runs). A plan
for fewer devices than asked grows ``dp_replicate``: more copies of the same layout.
"""

from __future__ import annotations

from nbtrain.checks import positive_int
from nbtrain.errors import InvalidArgumentError
from nbtrain.planner.plan import Plan
from nbtrain.planner.strategy import Strategy


def scale_plan(plan: Plan, num_devices: int, *, global_batch: int | None = None,
               seq_len: int | None = None) -> Plan:
    """``plan`` on ``num_devices`` devices (a power-of-two ratio to its own), with ``global_batch`` and
    ``seq_len`` when given (the global batch defaults to the smallest one every layer can split)."""
    positive_int(num_devices, f"num_devices must be a positive int, got {num_devices!r}")
    big, small = max(plan.num_devices, num_devices), min(plan.num_devices, num_devices)
    if big % small or (big // small) & (big // small - 1):
        raise InvalidArgumentError(f"a plan for {plan.num_devices} devices scales to a power-of-two multiple or "
                                   f"fraction of it, not to {num_devices}; launch {_nearest(plan, num_devices)} "
                                   "processes")
    pp, stages = plan.pp, list(plan.stages)
    while pp > 1 and pp * plan.devices_per_stage > num_devices:
        pp //= 2
        stages = [stages[i] + stages[i + 1] for i in range(0, len(stages), 2)]
    per_stage = num_devices // pp
    layers = tuple(_scale_strategy(s, per_stage) for s in plan.layers)
    mb = max(1, plan.microbatches * pp // plan.pp)  # as many micro-batches per stage as planned
    if pp > 1 and plan.schedule != "gpipe":
        mb = max(mb, pp)  # 1F1B runs at least one micro-batch per stage; GPipe runs any count, as planned
    rows = global_batch or mb * max(s.dp for s in layers)
    return plan.replace(num_devices=num_devices, layers=layers, pp=pp, stages=tuple(stages), microbatches=mb,
                        global_batch=rows, seq_len=seq_len or plan.seq_len)


def _scale_strategy(s: Strategy, devices: int) -> Strategy:
    degrees = {"dp_replicate": s.dp_replicate, "dp_shard": s.dp_shard, "tp": s.tp}
    while degrees["dp_replicate"] * degrees["dp_shard"] * degrees["tp"] > devices:
        axis = next(a for a in ("dp_replicate", "dp_shard", "tp") if degrees[a] > 1)
        degrees[axis] //= 2
    degrees["dp_replicate"] *= devices // (degrees["dp_replicate"] * degrees["dp_shard"] * degrees["tp"])
    ep = s.ep  # the experts stay spread, over as many of the data-parallel ranks left as divide them
    while (degrees["dp_replicate"] * degrees["dp_shard"]) % ep:
        ep //= 2
    return Strategy(**degrees, zero=s.zero, ac=s.ac, offload=s.offload, ep=ep if degrees["tp"] == 1 else 1)


def _nearest(plan: Plan, n: int) -> int:
    """The power-of-two multiple or fraction of the plan's devices closest to ``n`` (at least 1)."""
    candidate = plan.num_devices
    while candidate > n and candidate > 1:
        candidate //= 2
    while candidate * 2 <= n:
        candidate *= 2
    return candidate
