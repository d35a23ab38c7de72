"""Count a training step by kernel: matmul FLOPs and bytes, attention FLOPs, the bytes of every other (memory-bound)
op, and the number of kernels, per segment and direction, on the fake-tensor step the profiler already runs.

    >>> from torch._subclasses.fake_tensor import FakeTensorMode
    >>> counter = KernelCounter()                  # trace.count() runs the step so, switching segments
    >>> with FakeTensorMode(), counter:
    ...     x = torch.empty(4096, 4096, dtype=torch.bfloat16)
    ...     y = torch.nn.functional.gelu(x @ x)
    >>> counts = counter.finish(1)
    >>> counts["matmul_flops_fwd"][0] == 2 * 4096**3, counts["memory_bytes_fwd"][0], counts["kernels_fwd"][0]
    (True, 67108864, 2)

Why by kernel: a GPU runs a matmul at up to its tensor-core rate, an attention kernel at a fraction of it, a norm or
an activation at its memory bandwidth, and no kernel in less than its launch time. The planner prices each class at
its own rate (:mod:`nbtrain.planner.compute_time`); a flat fraction of peak is right for none of them.

What counts as a kernel: every aten op the step dispatches that is not a view (``view``, ``transpose``, ``expand``
share storage and launch nothing) nor a bare allocation (``empty``). That is what eager PyTorch launches, one
kernel per op (the CUDA caching allocator makes ``empty`` free; ``torch.compile`` would fuse the memory-bound ops,
which this count does not assume).
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, shape_wrapper

from nbtrain.profiler.observers import CPU_ATTENTION_FLOPS
from nbtrain.profiler.result import KERNEL_QUANTITIES
from nbtrain.profiler.segments import tensors_in

aten = torch.ops.aten


# Fused attention kernels: the SDPA backends of torch (flash, memory-efficient, cuDNN) and the CPU flash kernel.
_ATTENTION = {packet for packet in (*flop_registry, *CPU_ATTENTION_FLOPS) if "scaled_dot_product" in str(packet)}
_FLOPS = {**flop_registry, **{packet: shape_wrapper(f) for packet, f in CPU_ATTENTION_FLOPS.items()}}
# Ops that launch no kernel although their schema does not say they alias: allocations and bookkeeping.
_NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "lift_fresh",
              "_unsafe_view", "_reshape_alias", "alias", "_local_scalar_dense", "sym_size", "sym_stride",
              "sym_numel", "sym_storage_offset", "is_same_size", "_has_compatible_shallow_copy_type", "set_",
              "resize_", "_to_copy_noop"}


def _nbytes(values) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_in(values))


def _argument(func, args, kwargs, name: str, default=None):
    """An op's argument by its schema name (``is_causal`` sits at a different position in each attention op)."""
    for i, argument in enumerate(func._schema.arguments):
        if argument.name == name:
            return args[i] if i < len(args) else kwargs.get(name, default)
    return default


class KernelCounter(TorchDispatchMode):
    """Per (segment, direction): matmul FLOPs and bytes read + written, attention FLOPs (halved when causal: the
    flash kernels skip the masked half, and FlashAttention's published rates count causal FLOPs so; Dao 2023,
    §4.1), memory-bound bytes read + written, and kernels. A segment observer (``switch``) as well as a mode."""

    def __init__(self):
        super().__init__()
        self.values: dict[str, dict[int, int]] = {q: defaultdict(int) for q in KERNEL_QUANTITIES}
        self.segment, self.phase = 0, "fwd"

    def switch(self, segment: int, phase: str) -> None:
        self.segment, self.phase = segment, phase

    def _add(self, quantity: str, value: float) -> None:
        if self.segment is not None and self.segment >= 0:
            self.values[f"{quantity}_{self.phase}"][self.segment] += int(value)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        if func.namespace != "aten" or func.is_view or packet.__name__ in _NO_KERNEL:  # prim.device: metadata
            return out
        self._add("kernels", 1)
        if packet in _ATTENTION:
            flops = _FLOPS[packet](*args, **kwargs, out_val=out)
            causal = bool(_argument(func, args, kwargs, "is_causal", False))
            self._add("attention_flops", flops / 2 if causal else flops)
        elif packet in _FLOPS:
            self._add("matmul_flops", _FLOPS[packet](*args, **kwargs, out_val=out))
            self._add("matmul_bytes", _nbytes((args, kwargs)) + _nbytes(out))
        else:
            self._add("memory_bytes", _nbytes((args, kwargs)) + _nbytes(out))
        return out

    def finish(self, segments: int) -> dict[str, dict[int, int]]:
        """Every quantity for segments ``0 .. segments - 1`` (zero where nothing ran)."""
        return {q: {i: int(self.values[q].get(i, 0)) for i in range(segments)} for q in KERNEL_QUANTITIES}
