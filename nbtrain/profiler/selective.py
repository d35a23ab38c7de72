"""What per-op selective checkpointing (``ac=op``) keeps and what it recomputes, counted per layer on the profiler's
fake step.

``ac=op`` is torchtitan's "op" selective activation checkpointing: in forward the outputs of the matmuls and of
attention (:data:`SAVED_OPS`) are kept, every other op's output is dropped and recomputed in backward. So a layer
under it holds its input (the recomputation starts there) and those outputs; its backward re-runs the other ops,
whose cost is the bytes they write (they are memory-bound: norms, activations, residual adds, RoPE).

    >>> counter = SelectiveCounter()
    >>> x, w = torch.randn(8, 16), torch.randn(16, 32)
    >>> with counter:                            # on fake tensors in :func:`nbtrain.profiler.trace.count`
    ...     counter.switch(0, "fwd")             # the segment tracker's call: layer 0 runs forward
    ...     y = torch.relu(x @ w)
    >>> counter.kept[0], counter.recomputed[0]  # the matmul's output (8 × 32 fp32) kept; relu's recomputed
    (1024, 1024)

The executor's policy (:func:`nbtrain.run.parallel.parallelize.save_matmuls`) keeps exactly :data:`SAVED_OPS`, so
what is counted here is what it saves.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nbtrain.profiler.segments import tensors_in

aten = torch.ops.aten

# The matmuls (what costs FLOPs to redo) and the attention kernels (FLOPs, and the softmax statistics their backward
# reads), as torchtitan's "op" SAC keeps them (torchtitan/distributed/activation_checkpoint.py, which also keeps
# reduce-scatters and maxima; nbtrain recomputes those with the rest). CPU flash attention is what SDPA runs on
# the CPU; the others are the GPU kernels (and the overridable one other accelerators register).
SAVED_OPS = frozenset(op.default for op in (
    aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_flash_attention_for_cpu,
    getattr(aten, "_scaled_dot_product_cudnn_attention", None),
    getattr(aten, "_scaled_dot_product_fused_attention_overrideable", None),
) if op is not None)


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class SelectiveCounter(TorchDispatchMode):
    """Per forward segment: ``kept``, the bytes of the outputs :data:`SAVED_OPS` compute (each storage once), and
    ``recomputed``, the bytes every other op writes into storage of its own (views and in-place ops write none).

    Receives :meth:`switch` calls from a :class:`~nbtrain.profiler.segments.SegmentTracker` as the other
    observers do; counts only in forward, and only until :meth:`model_returned` (the loss is not in any layer's
    checkpoint)."""

    def __init__(self):
        super().__init__()
        self.kept: dict[int, int] = defaultdict(int)
        self.recomputed: dict[int, int] = defaultdict(int)
        self.segment, self.phase = 0, "fwd"
        self.counting, self._returned = False, False  # from the tracker's first switch to the model's return

    def switch(self, segment: int, phase: str) -> None:
        self.segment, self.phase, self.counting = segment, phase, not self._returned

    def model_returned(self) -> None:
        self.counting, self._returned = False, True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.counting or self.phase != "fwd" or self.segment is None or self.segment < 0:
            return out
        # storages are told apart only within one call: a freed fake storage's address is reused by later ones
        seen = {_key(t) for t in tensors_in((args, kwargs))}
        for t in tensors_in(out):
            key = _key(t)
            if key in seen:
                continue
            seen.add(key)
            nbytes = t.untyped_storage().nbytes()
            (self.kept if func in SAVED_OPS else self.recomputed)[self.segment] += nbytes
        return out
