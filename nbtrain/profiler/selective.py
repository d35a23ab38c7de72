"""What per-op selective checkpointing (``ac=op``) keeps and what it recomputes, counted per layer on the profiler's
fake step.

``ac=op`` is torchtitan's "op" selective activation checkpointing (``torchtitan/distributed/activation_checkpoint.py``,
its default for Llama): in forward the outputs of attention and of every other matmul of a layer's linear
projections (the 1st, 3rd, 5th, ... ``mm``/``addmm`` of each checkpointed call, :func:`keeps`) are kept; the other
matmuls' and every other op's outputs are dropped and recomputed in backward. So a layer under it holds its input
(the recomputation starts there) and those outputs; its backward re-runs the dropped matmuls (their FLOPs) and the
other ops, whose cost is the bytes they write (they are memory-bound: norms, activations, residual adds, RoPE).
Keeping half the projections is torchtitan's trade: a Llama block's recomputed ``k``, ``o`` and ``up`` projections
cost about a third of its matmul forward and free about half of what keeping every matmul holds.

    >>> counter = SelectiveCounter()
    >>> x, w = torch.randn(8, 16), torch.randn(16, 32)
    >>> with counter:                            # on fake tensors in :func:`nbtrain.profiler.trace.count`
    ...     counter.switch(0, "fwd")             # the segment tracker's call: layer 0 runs forward
    ...     h = torch.relu(x @ w)                # 1st matmul kept, relu recomputed
    ...     y = h @ w.T                          # the 2nd matmul dropped...
    ...     counter.saved(y)                     # ...and recomputed, as backward needs its output
    >>> counter.kept[0], counter.recomputed[0], counter.recomputed_matmul_flops[0]
    (1024, 1024, 8192)

The executor's policy (:func:`nbtrain.run.parallel.parallelize.checkpoint_kwargs`) asks :func:`keeps` of each op, so
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
# Grouped matmuls (transformers' grouped experts) are recomputed: gpt-oss's experts add their bias into the grouped
# matmul's output in place, which a kept output cannot take (torch refuses to recompute from a mutated cache entry).
SAVED_OPS = frozenset(op.default for op in (
    aten.mm, aten.addmm, aten.bmm, aten.baddbmm,
    aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_flash_attention_for_cpu,
    getattr(aten, "_scaled_dot_product_cudnn_attention", None),
    getattr(aten, "_scaled_dot_product_fused_attention_overrideable", None),
) if op is not None)


LINEAR_MATMULS = frozenset((aten.mm.default, aten.addmm.default))
"""The matmuls of linear projections, of which ``ac=op`` keeps every other one (torchtitan counts ``aten.mm``, what a
bias-free projection runs; a projection with a bias runs ``addmm``, counted alike)."""


def keeps(op, linear_matmuls: int) -> bool:
    """Whether ``ac=op`` keeps the output of ``op``, the ``linear_matmuls``-th projection matmul of its checkpointed
    call so far (counting this one when it is one): attention and the odd-numbered projections, as torchtitan."""
    return op in SAVED_OPS and not (op in LINEAR_MATMULS and linear_matmuls % 2 == 0)


def matmul_flops(op, args) -> int:
    """FLOPs of one ``mm`` or ``addmm`` call (2·m·k·n)."""
    a, b = (args[0], args[1]) if op == aten.mm.default else (args[1], args[2])
    return 2 * a.shape[0] * a.shape[1] * b.shape[1]


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class SelectiveCounter(TorchDispatchMode):
    """Per forward segment: ``kept``, the bytes of the outputs ``ac=op`` keeps (:func:`keeps`; each storage once);
    ``recomputed``, the bytes the other ops but the projection matmuls write into storage of their own (views and
    in-place ops write none); and ``recomputed_matmul_flops``, the FLOPs of the projection matmuls it drops.

    The last two count only what backward really redoes: torch's non-reentrant checkpoint stops recomputing once
    every tensor the layer saved for backward is back (``torch.utils.checkpoint``'s early stop), so the ops after the
    layer's last saved tensor (a GPT block's dropped MLP projection and its residual add: the layer's output, which
    nothing in the layer saves) never run again. :meth:`saved` is told of each tensor autograd saves
    (:class:`~nbtrain.profiler.observers.SavedBytes` calls it), and what comes after the segment's last one is left
    out.

    Receives :meth:`switch` calls from a :class:`~nbtrain.profiler.segments.SegmentTracker` as the other
    observers do; counts only in forward, and only until :meth:`model_returned` (the loss is not in any layer's
    checkpoint)."""

    def __init__(self):
        super().__init__()
        self.kept: dict[int, int] = defaultdict(int)
        self.segment, self.phase = 0, "fwd"
        self.counting, self._returned = False, False  # from the tracker's first switch to the model's return
        self._ops: dict[int, int] = defaultdict(int)  # per segment: ops run so far in its forward
        self._linear_matmuls: dict[int, int] = defaultdict(int)  # per segment: projection matmuls so far
        self._redone: dict[int, list[tuple[int, int, int]]] = defaultdict(list)  # (op, FLOPs, bytes) not kept
        self._last_saved: dict[int, int] = {}  # per segment: ops run when autograd last saved a tensor

    def switch(self, segment: int, phase: str) -> None:
        self.segment, self.phase, self.counting = segment, phase, not self._returned

    def model_returned(self) -> None:
        self.counting, self._returned = False, True

    def saved(self, t: torch.Tensor) -> None:
        """Autograd saved ``t`` for backward (before the op saving it runs, or just after for an op saving its own
        output): the recomputation of this segment goes at least as far as the ops run so far."""
        if self.counting and self.phase == "fwd" and self.segment is not None and self.segment >= 0:
            self._last_saved[self.segment] = self._ops[self.segment]

    def _redone_sum(self, segment: int, which: int) -> int:
        last = self._last_saved.get(segment, 0)
        return sum(entry[which] for entry in self._redone.get(segment, ()) if entry[0] <= last)

    @property
    def recomputed(self) -> dict[int, int]:
        return defaultdict(int, {seg: self._redone_sum(seg, 2) for seg in self._redone})

    @property
    def recomputed_matmul_flops(self) -> dict[int, int]:
        return defaultdict(int, {seg: self._redone_sum(seg, 1) for seg in self._redone})

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.counting or self.phase != "fwd" or self.segment is None or self.segment < 0:
            return out
        segment = self.segment
        self._ops[segment] += 1
        if func in LINEAR_MATMULS:
            self._linear_matmuls[segment] += 1
        kept = keeps(func, self._linear_matmuls[segment])
        if func in LINEAR_MATMULS and not kept:
            self._redone[segment].append((self._ops[segment], matmul_flops(func, args), 0))
            return out
        # storages are told apart only within one call: a freed fake storage's address is reused by later ones
        seen = {_key(t) for t in tensors_in((args, kwargs))}
        written = 0
        for t in tensors_in(out):
            key = _key(t)
            if key in seen:
                continue
            seen.add(key)
            written += t.untyped_storage().nbytes()
        if kept:
            self.kept[segment] += written
        elif written:
            self._redone[segment].append((self._ops[segment], 0, written))
        return out
