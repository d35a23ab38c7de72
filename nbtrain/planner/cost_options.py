"""Knobs of the cost model (:mod:`nbtrain.planner.cost`): what the executor does by default, and what a user sets.

    >>> from nbtrain.planner.cost import CostOptions
    >>> CostOptions(headroom=0.05, offload_overlap=False).headroom
    0.05
"""

from __future__ import annotations

from dataclasses import dataclass

from nbtrain.errors import InvalidPlanError


@dataclass(frozen=True)
class CostOptions:
    """Knobs of the cost model; the defaults are what nbtrain's executor does."""

    reserve_bytes: int | None = None
    """Memory per device the model cannot use; ``None``: the CUDA context (512 MiB) and, on more than one device,
    NCCL's buffers (512 MiB) on a GPU, none on the CPU (:func:`reserve_parts`, which cites the figures)."""
    headroom: float | None = None
    """Fraction of each device's memory kept free for the caching allocator's fragmentation, on top of the
    reserve; ``None``: 10% on a GPU, none on the CPU (:data:`nbtrain.planner.reserve.HEADROOM`, which cites its reasons)."""
    overlap_slowdown: float = 1.3
    """Slowdown of a collective overlapped with compute (Galvatron-BMW's measured coefficient)."""
    offload_overlap: bool = True
    """CoTrain's schedule (update overlapped with backward) or ZeRO-Offload's (after backward)."""
    grad_reduce_bytes: int = 4
    """Bytes per gradient element in the data-parallel reduction (fp32, as the executor reduces)."""
    clip: bool = True
    """The step clips gradients by their global norm (``fit``'s default ``clip_norm=1.0``): on a CPU "device",
    three passes over the gradients at its copy rate."""
    measured_compute: bool = True
    """Use the profile's measured forward and backward times, when it was measured on this machine's kind of
    device and the cluster is this machine (detected, not from the catalog): Galvatron-BMW profiles compute time
    the same way. Otherwise (or ``False``) compute is FLOPs over the sustained rate."""

    def __post_init__(self):
        if self.headroom is not None and not (isinstance(self.headroom, (int, float)) and 0 <= self.headroom < 1):
            raise InvalidPlanError(f"headroom={self.headroom!r}: the allocator headroom is the fraction of each "
                                   "device's memory kept free, from 0 (none) to below 1, e.g. 0.1 for 10%")
