"""Communication and wrapper costs priced from what was measured on this machine, not from datasheet bandwidths.

    >>> links = Links((Link("fsdp_forward", 2, 2, 0.001, 1e9), Link("fsdp_backward", 2, 2, 0.002, 5e8)))
    >>> round(fsdp_seconds(links, 2, Strategy(dp_shard=2), "head", param_bytes=4e6), 6)   # 1 + 4 + 2 + 8 ms
    0.015

Each function returns ``None`` when the cluster has no measurement for that operation and group (a catalog cluster,
or a process count not measured): the cost model then uses its datasheet formula. The measurements
(:mod:`nbtrain.profiler.collectives`) are of the executor's own pieces — FSDP2 and DTensor wrapping real layers,
DDP beside a real backward — so they carry the overheads and the overlap the backend really gives, which a
bandwidth alone does not: on gloo, FSDP2's per-layer work is mostly fixed cost, and DDP hides almost nothing.
"""

from __future__ import annotations

from nbtrain.planner.strategy import Strategy
from nbtrain.profiler.collectives import Link, Links  # noqa: F401 (Link: the docstring's)


def tp_seconds(links: Links, world: int, s: Strategy, kind: str, *, hidden: float, output: float, pairs: int,
               gathers_output: bool, passes: int, sequence_parallel: bool = False) -> float | None:
    """What tensor parallelism adds to a layer per micro-batch: a transformer block as the measured whole block
    (read off the measured sizes, :meth:`~nbtrain.profiler.collectives.Link.as_measured`), another layer as
    ``pairs`` measured colwise → rowwise pairs; a gathered output (an LM head's logits) as an all-gather of
    ``output`` bytes; the recomputed forward (``passes == 3``) once more. ``sequence_parallel``: each
    of the ``pairs`` all-reduces per pass is an all-gather and a reduce-scatter instead (Korthikanti et al. 2022,
    §4.2.2); the measured block is the block without it, so what the split collectives cost beyond the all-reduce,
    as measured here, is added (nothing when they were not measured: then the all-reduce's time stands in, the
    same bytes through the same ring, a reduce-scatter then an all-gather, in one collective call instead of two)."""
    block = links.find("tp_block_forward", s.tp, world) if kind == "block" else None
    pair = links.find("tp_forward", s.tp, world)
    backward = links.find("tp_block_backward", s.tp, world) if block is not None else None
    if block is not None and backward is not None:
        seconds = block.as_measured(hidden) * (passes - 1) + backward.as_measured(hidden)
    elif pair is not None:
        seconds = pairs * (pair.seconds(hidden) * (passes - 1) + links.seconds("tp_backward", s.tp, hidden, world))
    else:
        return None
    if gathers_output:
        seconds += (passes - 1) * links.seconds("all_gather", s.tp, output, world)
    split = [links.find(op, s.tp, world) for op in ("all_gather", "reduce_scatter", "all_reduce")]
    if sequence_parallel and all(split):
        gather, scatter, reduce = split
        seconds += passes * pairs * max(0.0, gather.seconds(hidden) + scatter.seconds(hidden) - reduce.seconds(hidden))
    return seconds


def split_loss_seconds(links: Links, world: int, s: Strategy, *, tokens: float) -> float | None:
    """What the cross-entropy on logits split over the vocabulary adds to a micro-batch of ``tokens`` tokens, forward
    and backward (Megatron-LM's parallel cross-entropy, Shoeybi et al. 2019 §3: three all-reduces of one fp32 number
    a token, and on a CPU DTensor's work on every op of the loss), as measured here beside the cross-entropy of a
    rank's share of the logits; None when it was not."""
    link = links.find("tp_loss", s.tp, world)
    return None if link is None else link.as_measured(4 * tokens)


def gather_seconds(links: Links, world: int, group: int, nbytes: float) -> float | None:
    """One all-gather producing ``nbytes`` over ``group`` of ``world`` devices (the hidden state at a
    sequence-parallel boundary), as measured here; None when it was not."""
    gather = links.find("all_gather", group, world)
    return None if gather is None else gather.seconds(nbytes)


def fsdp_seconds(links: Links, world: int, s: Strategy, kind: str, *, param_bytes: float) -> float | None:
    """What FSDP2 adds to a layer sharded ``dp_shard`` ways per micro-batch: its forward gather and, under ZeRO-3,
    the backward gather, then the gradients' reduce-scatter, as measured on a transformer block (for a block) or
    on Linear layers (otherwise), read off the measured sizes themselves
    (:meth:`~nbtrain.profiler.collectives.Link.as_measured`): FSDP2's per-unit work is mostly fixed on a CPU, and a
    line through a block of 0.8 and one of 3 MiB put 2.4 ms under a 150 KB transformers Qwen2 block that FSDP2 added
    4.9-5.6 ms a step to (``bench/RESULTS.md``, "FSDP2, TP and DDP priced as a fine-tuned model's step pays them")."""
    if s.dp_shard <= 1:
        return None
    unit = "fsdp_block" if kind == "block" and links.find("fsdp_block_forward", s.dp_shard, world) else "fsdp"
    forward = links.find(f"{unit}_forward", s.dp_shard, world)
    if forward is None:
        return None
    backward = links.find(f"{unit}_backward" if s.zero == 3 else f"{unit}_backward_2", s.dp_shard, world)
    if backward is None:
        return None
    return forward.as_measured(param_bytes) + backward.as_measured(param_bytes)


def replica_seconds(links: Links, world: int, s: Strategy, *, grad_bytes: float, model_grad_bytes: float
                    ) -> float | None:
    """Once a step, the gradient all-reduce across ``dp_replicate`` replicas of a layer holding ``grad_bytes``:
    DDP as measured beside a real backward for the whole model's ``model_grad_bytes`` (read off the measured sizes
    themselves, :meth:`~nbtrain.profiler.collectives.Link.as_measured`), shared out by the layer's part of them; or,
    for a sharded layer, its shard's all-reduce.

    DDP's cost is not a line in the bytes on a CPU: measured on 2 gloo processes here, 4 Linear layers added
    1.1-2.4 ms at 64 KiB of gradients, 1.3-2.2 at 256 KiB, 2.8-3.4 at 1 MiB, 5.8 at 4 MiB and 14.9 at 9 MiB, and
    the line through them put 0.6 ms of fixed part under a 560 KB transformers Qwen2 that DDP added 2.7-4.1 ms to
    (``bench/RESULTS.md``, "The 2-process step taken apart again")."""
    if s.dp_replicate <= 1:
        return None
    ddp = links.find("ddp_backward", s.dp_replicate, world) if s.dp_shard == 1 else None
    if ddp is not None:
        return ddp.as_measured(model_grad_bytes) * grad_bytes / model_grad_bytes
    reduce = links.find("all_reduce", s.dp_replicate, world)
    return None if reduce is None else reduce.seconds(grad_bytes / s.dp_shard)


def clip_seconds(links: Links, world: int, s: Strategy, *, param_bytes: float, layers: int) -> float:
    """Clipping this layer's DTensor gradients (split by TP, or sharded by FSDP2) by the global norm, as the trainer
    does, measured on a transformer block against its whole (unsplit) ``param_bytes``: the bytes at the measured
    rate, the fixed part (a reduction per group of like DTensors, once a step) shared out over the model's
    ``layers``. Plain tensors (DDP): 0 here."""
    op, group = ("tp_clip", s.tp) if s.tp > 1 else ("fsdp_clip", s.dp_shard)
    clip = links.find(op, group, world) if group > 1 else None
    if clip is None:
        return 0.0
    return clip.latency_s / layers + param_bytes / clip.bandwidth


def schedule_seconds(links: Links, world: int, nodes: int = 1) -> float:
    """Seconds per micro-batch that a pipeline schedule itself costs each stage, as measured on this machine
    (``pp_microbatch``: ``torch.distributed.pipelining``'s own work per micro-batch; the hidden state's transfer is
    priced apart); 0 where it was not measured (a catalog cluster: there the schedule's host-side work runs ahead of a
    GPU's kernels). The work does not grow with the hidden state, but the wider measurements also carry two stages
    computing at once where their compute was timed alone, which a line through them can read as all bytes and no
    fixed part (measured on a slow 2-core machine: 1.45, 1.03, 9.7 ms at 32, 128, 512 KiB, a fit through 0): so the
    cheapest measured micro-batch less its two transfers (every point holds the fixed work), or the fit's fixed part
    where that is more."""
    measured = links.find("pp_microbatch", 2, world)
    if measured is None or nodes != 1:
        return 0.0
    transfer = links.find("p2p", 2, world)
    cheapest = min((seconds - (2 * transfer.seconds(nbytes) if transfer is not None else 0.0)
                    for nbytes, seconds in measured.points), default=0.0)
    return max(measured.latency_s, cheapest, 0.0)
