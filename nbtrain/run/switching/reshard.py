"""Move a model's tensors from one layout to another: the finest common slices, kept where held, the rest sent.

    >>> plan = Resharding(src_model.parameters(), dst_model.parameters())   # collective, once per pair
    >>> plan.run([local_shard(p) for p in src_params], [local_shard(p) for p in dst_params])  # weights, src → dst
    >>> plan.seconds, plan.bytes_received                                    # the last run, this rank

Two models of the same architecture parallelized two ways (DDP: every rank holds every element; FSDP2 ``dp_shard``
or tensor parallel: DTensors, each rank a box of each tensor) hold the same global tensors in different boxes per
rank. DTensor's ``redistribute`` cannot cross meshes (STACK.md), so this does what HotSPa does. Each rank's box of
each tensor under each layout comes from the DTensor's spec (``compute_local_shape_and_global_offset``: the one
DCP uses for sharded checkpoints, strided FSDP-over-TP shards included) or is the whole tensor for a plain one; one
``all_gather_object`` tells every rank every box. Every rank then cuts each destination box by the boundaries of
the source boxes that overlap it (the finest common slices) and gives each slice a source: the rank itself when it
holds the slice already (a local copy), else, among the holders, the one that has sent the fewest bytes so far
(balancing replicated sources). All slices from one rank to another travel as one flat buffer; all of a rank's
sends and receives of a run are posted together with ``batch_isend_irecv``. The plan is the same on every rank
(computed from the same boxes in the same order) and is cached by the caller per (from, to) pair.

A pipelined layout holds each tensor only on the ranks of its stage: elsewhere the tensor is given as ``None``, a
rank with no box of it (no slice to send from, none to receive into). A tied embedding held by the first and the
last stage has two holders of the same values, and is a source on both.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from nbtrain.run.placement import synchronize

Box = tuple[tuple[int, int], ...]
"""Per dimension ``(start, stop)`` of a tensor's global index space."""


def local_box(t: torch.Tensor | None) -> Box | None:
    """The part of the global tensor this rank holds: a DTensor's local shard, all of a plain tensor, or None (this
    rank holds none of it: another pipeline stage's)."""
    if t is None:
        return None
    if isinstance(t, DTensor):
        if any(placement.is_partial() for placement in t.placements):
            raise ValueError(f"a Partial DTensor ({t.placements}) holds a share of a sum on each rank, not a slice: "
                             "redistribute it to Shard/Replicate placements (its parameter's) before moving it")
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return tuple((o, o + n) for o, n in zip(offset, shape))
    return tuple((0, n) for n in t.shape)


def _intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) else None


def _cells(box: Box, sources: list[Box]) -> list[Box]:
    """``box`` cut along every boundary of ``sources`` that falls inside it: slices each inside or outside each
    source (the finest common slices). An empty box has none."""
    cuts = []
    for d, (lo, hi) in enumerate(box):
        points = sorted({lo, hi} | {p for s in sources for p in s[d] if lo < p < hi})
        cuts.append(list(zip(points[:-1], points[1:])))
    return [tuple(cell) for cell in itertools.product(*cuts)]


def _slices(cell: Box, origin: Box) -> tuple[slice, ...]:
    """Index of ``cell`` in a local tensor holding ``origin``."""
    return tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(cell, origin))


@dataclass(frozen=True)
class _Move:
    tensor: int
    cell: Box
    src: int
    dst: int

    @property
    def numel(self) -> int:
        return math.prod(hi - lo for lo, hi in self.cell)


class Resharding:
    """Which slices of which tensors each rank keeps, sends and receives to go from one layout to another.

    ``src`` and ``dst``: the same tensors (same global shapes, same order) in the two layouts, None where this rank
    holds none (module docstring). Collective over ``group`` (default: the world), which must hold every rank of
    both layouts."""

    def __init__(self, src, dst, group=None):
        src, dst = list(src), list(dst)
        if len(src) != len(dst) or any(a is not None and b is not None and a.shape != b.shape
                                       for a, b in zip(src, dst)):
            raise ValueError("the two layouts must hold the same tensors, in the same order, with the same shapes")
        self.group = group
        self.rank = dist.get_rank(group)
        boxes = [None] * dist.get_world_size(group)
        dist.all_gather_object(boxes, ([local_box(t) for t in src], [local_box(t) for t in dst]), group=group)
        self.src_boxes = [b[0] for b in boxes]  # [rank][tensor]
        self.dst_boxes = [b[1] for b in boxes]
        self.moves = self._assign(len(src))
        self.elements_received = sum(m.numel for m in self.moves if m.dst == self.rank and m.src != self.rank)
        """Elements this rank receives per run (the rest of its destination boxes it already holds)."""
        self.seconds, self.bytes_received = 0.0, 0
        """Of the last run: its wall time on this rank, and the bytes this rank received."""

    def _assign(self, count: int) -> list[_Move]:
        world = len(self.src_boxes)
        sent = [0] * world
        moves = []
        for i in range(count):
            holders = [(r, self.src_boxes[r][i]) for r in range(world) if self.src_boxes[r][i] is not None]
            for dst in range(world):
                if self.dst_boxes[dst][i] is None:
                    continue
                for cell in _cells(self.dst_boxes[dst][i], [box for _, box in holders]):
                    owners = [r for r, box in holders if _intersect(box, cell) == cell]
                    if not owners:
                        raise ValueError(f"tensor {i}: no rank holds {cell} in the source layout")
                    src = dst if dst in owners else min(owners, key=lambda r: (sent[r], r))
                    move = _Move(i, cell, src, dst)
                    if src != dst:
                        sent[src] += move.numel
                    moves.append(move)
        return moves

    @torch.no_grad()
    def run(self, src: list[torch.Tensor], dst: list[torch.Tensor], *, add: bool = False) -> None:
        """Copy (``add``: add) the tensors ``src`` (this rank's local data under the source layout) into ``dst``
        (its local data under the destination layout). Every rank of the group calls it."""
        start = time.perf_counter()
        src_origin, dst_origin = self.src_boxes[self.rank], self.dst_boxes[self.rank]
        outgoing: dict[int, list[_Move]] = {}
        incoming: dict[int, list[_Move]] = {}
        for m in self.moves:
            if m.src == self.rank and m.dst == self.rank:
                part = src[m.tensor][_slices(m.cell, src_origin[m.tensor])]
                target = dst[m.tensor][_slices(m.cell, dst_origin[m.tensor])]
                target.add_(part) if add else target.copy_(part)
            elif m.src == self.rank:
                outgoing.setdefault(m.dst, []).append(m)
            elif m.dst == self.rank:
                incoming.setdefault(m.src, []).append(m)
        held = next((t for t in dst if t is not None), None)
        if held is None:  # this rank receives nothing (it still sends its slices)
            held = next(t for t in src if t is not None)
        dtype, device = held.dtype, held.device
        ops, buffers = [], {}
        for peer, moves in sorted(outgoing.items()):
            flat = torch.cat([src[m.tensor][_slices(m.cell, src_origin[m.tensor])].reshape(-1) for m in moves])
            ops.append(dist.P2POp(dist.isend, flat.to(dtype), self._global(peer), self.group))
        for peer, moves in sorted(incoming.items()):
            buffers[peer] = torch.empty(sum(m.numel for m in moves), dtype=dtype, device=device)
            ops.append(dist.P2POp(dist.irecv, buffers[peer], self._global(peer), self.group))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        for peer, moves in incoming.items():
            offset = 0
            for m in moves:
                target = dst[m.tensor][_slices(m.cell, dst_origin[m.tensor])]
                part = buffers[peer][offset:offset + m.numel].view(target.shape)
                target.add_(part) if add else target.copy_(part)
                offset += m.numel
        synchronize(device)  # NCCL's wait only orders the stream: the time is the copies' end, not their queueing
        self.seconds = time.perf_counter() - start
        self.bytes_received = self.elements_received * dtype.itemsize

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)
