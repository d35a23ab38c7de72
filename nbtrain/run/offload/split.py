"""Which elements of a layer's AdamW update run on the CPU: the cut inside a layer (the planner chooses the fraction,
``nbtrain.planner.offload_split``).

    >>> w, b = torch.zeros(4, 3), torch.zeros(4)       # one layer's parameters: 16 elements
    >>> [(c.param is w, c.start, c.stop, c.on_cpu) for c in cut_layer([w, b], 0.5)]   # the CPU takes the last half
    [(True, 0, 8, False), (True, 8, 12, True), (False, 0, 4, True)]

The cut and the planner's split follow one observation (CoTrain, REFERENCE.md): backward produces gradients from the last layer to the first,
and the next forward needs the weights from the first layer to the last. What backward produces first can be
updated on the CPU while backward goes on; what it produces last (the first layers, also needed first by the next
forward) is best updated on the device, where it does not wait for a transfer or for the CPU's queue.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nbtrain.run.parallel.mesh import local_shard


@dataclass(frozen=True)
class Cut:
    """A contiguous run ``[start, stop)`` of one parameter's flattened elements, updated on one side."""

    param: torch.Tensor
    start: int
    stop: int
    on_cpu: bool

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.stop == local_shard(self.param).numel()


def cut_layer(params: list[torch.Tensor], fraction: float) -> list[Cut]:
    """Cut a layer's parameters so that ``round(fraction × its elements)`` are updated on the CPU (of a DTensor,
    of its local shard: each rank cuts what it holds).

    The CPU takes the *last* elements of the layer, in parameter order: backward reaches them first, so the CPU
    part of the layer is complete earliest. At most one tensor is cut in two (AdamW is elementwise, so a tensor
    updated in two pieces, each with its own moments, gives exactly the same result as in one)."""
    total = sum(local_shard(p).numel() for p in params)
    boundary = total - round(fraction * total)  # flat position where the CPU part starts
    cuts, offset = [], 0
    for p in params:
        n = local_shard(p).numel()
        split = min(max(boundary - offset, 0), n)
        if split > 0:
            cuts.append(Cut(p, 0, split, on_cpu=False))
        if split < n:
            cuts.append(Cut(p, split, n, on_cpu=True))
        offset += n
    return cuts
