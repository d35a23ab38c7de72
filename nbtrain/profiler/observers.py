"""What the profiler measures per segment: FLOPs, bytes saved for backward, and wall-clock seconds.

Each observer receives :meth:`switch` calls from a :class:`~nbtrain.profiler.segments.SegmentTracker` and charges
what happened since the previous switch to the segment and phase that were running.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten


def _cpu_flash_fwd(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query, key, value)


def _cpu_flash_bwd(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


def _grouped_mm(mat_a, mat_b, *args, out_shape=None, **kwargs) -> int:
    """``torch._grouped_mm``, the kernel mixture-of-experts layers run their experts with (transformers'
    ``grouped_mm`` experts, torchtitan's MoE): the rows of ``mat_a`` go to groups of ``mat_b`` (an expert each), so
    every row is multiplied once, whatever the routing: 2 · numel(a) · N FLOPs, for each of its forms (2-D rows × 3-D
    experts, 3-D × 3-D, and the 2-D × 2-D of the weights' gradient, grouped along the contracted rows). The routing
    itself (the offsets) depends on the data; this count does not, so the fake-tensor profile counts it exactly."""
    numel = 1
    for size in mat_a:
        numel *= size
    return 2 * numel * mat_b[-1]


# torch's flop counter knows the CUDA attention kernels but not the CPU flash kernel that
# scaled_dot_product_attention picks on CPU; count it like the others (2 matmuls forward, 4 backward;
# causal masking is not subtracted, as in the 12·L·H·Q·T term of Chowdhery et al. 2022, appendix B). Nor (torch
# 2.13) the grouped matmul of mixture-of-experts layers.
CPU_ATTENTION_FLOPS = {
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_fwd,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_bwd,
    **({aten._grouped_mm: _grouped_mm} if hasattr(aten, "_grouped_mm") else {}),
}


class _Charger:
    """Base: remembers which (segment, phase) is running and charges a running total to it on each switch."""

    def __init__(self):
        self.fwd: dict[int, float] = defaultdict(float)
        self.bwd: dict[int, float] = defaultdict(float)
        self.segment, self.phase = None, None
        self._last = 0.0

    def reading(self) -> float:
        raise NotImplementedError

    def switch(self, segment: int, phase: str) -> None:
        now = self.reading()
        if self.segment is not None and self.segment >= 0:
            (self.fwd if self.phase == "fwd" else self.bwd)[self.segment] += now - self._last
        self._last = now
        self.segment, self.phase = segment, phase


class FlopObserver(_Charger):
    """FLOPs per segment from ``torch.utils.flop_counter.FlopCounterMode`` (enter it around the traced step)."""

    def __init__(self):
        super().__init__()
        self.counter = FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS)

    def reading(self) -> float:
        return float(self.counter.get_total_flops())


class Timer(_Charger):
    """Seconds per segment. On the CPU from the clock at each switch; on a GPU from CUDA events recorded on the
    stream at each switch and read once the step is done (:meth:`sync`), so that timing never stalls the GPU between
    segments and each segment is charged exactly the kernels queued while it ran."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.cuda = device.type == "cuda"
        self._marks: list[tuple[int | None, str | None, torch.cuda.Event]] = []

    def reading(self) -> float:
        return time.perf_counter()

    def switch(self, segment: int, phase: str) -> None:
        if not self.cuda:
            return super().switch(segment, phase)
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self._marks.append((self.segment, self.phase, event))  # the interval that ends here was theirs
        self.segment, self.phase = segment, phase

    def sync(self) -> None:
        """Wait for the GPU and charge each interval between two events to the segment that ran in it."""
        if not self.cuda or not self._marks:
            return
        self._marks[-1][2].synchronize()
        for (_, _, start), (segment, phase, stop) in zip(self._marks, self._marks[1:]):
            if segment is not None and segment >= 0:
                (self.fwd if phase == "fwd" else self.bwd)[segment] += start.elapsed_time(stop) / 1e3  # ms
        self._marks = []


class SavedBytes:
    """Bytes saved for backward per forward segment, via ``torch.autograd.graph.saved_tensors_hooks``.

    A storage saved by several ops (or as several views) is counted once, in the segment that saved it first;
    parameters are not activations and are skipped. ``head_shared`` keeps, of those bytes, the tensors that
    broadcast over the attention heads (4-D with a size-1 second dimension: a ``[batch, 1, T, T]`` mask, which
    ``F.scaled_dot_product_attention`` saves as a float bias; a ``[batch, 1, T, d]`` RoPE table): tensor
    parallelism splits the heads and leaves them whole on every rank.
    """

    def __init__(self, parameters, also=None):
        self.per_segment: dict[int, int] = defaultdict(int)
        self.head_shared: dict[int, int] = defaultdict(int)
        self.segment = 0
        self._seen = {self._key(p) for p in parameters}
        self._also = also  # told of every saved tensor (SelectiveCounter.saved: how far a recomputation goes)

    @staticmethod
    def _key(t: torch.Tensor) -> int:
        return t.untyped_storage()._cdata

    def switch(self, segment: int, phase: str) -> None:
        self.segment = segment

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if self._also is not None:
            self._also(t)
        key = self._key(t)
        if key not in self._seen:
            self._seen.add(key)
            self.per_segment[self.segment] += t.untyped_storage().nbytes()
            if t.dim() == 4 and t.shape[1] == 1:
                self.head_shared[self.segment] += t.untyped_storage().nbytes()
        return t

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s storage was saved already (or is a parameter's)."""
        return self._key(t) in self._seen

    def mark(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage as saved without charging it: what a block that stands in for its twin
        (:mod:`nbtrain.profiler.twins`) returns is saved when the twin's output was."""
        self._seen.add(self._key(t))

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
