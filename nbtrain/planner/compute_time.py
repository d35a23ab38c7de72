"""A GPU layer's compute time by kernel class, for clusters nbtrain has not timed a model on (catalog GPUs).

    >>> from nbtrain.planner.compute_time import Work, seconds
    >>> h100 = Cluster.from_catalog("H100")
    >>> big = Work(matmul_flops=2 * 8192**3, matmul_bytes=3 * 2 * 8192**2, kernels=1)  # 1.1 TFLOP, 403 MB
    >>> round(seconds(big, h100) * 1e3, 3)              # ms: at the achievable 794.5 TFLOP/s
    1.384
    >>> tiny = Work(matmul_flops=2 * 64**3, matmul_bytes=3 * 2 * 64**2, kernels=1)
    >>> round(seconds(tiny, h100) * 1e6, 1)             # µs: the launch floor
    5.0

A layer's forward (or backward) is priced as its kernels run (Williams et al. 2009's roofline, per class):

* **matmuls**: no faster than their FLOPs at the achievable matmul rate (``peak_flops × flops_efficiency``,
  Bekman's MAMF table) nor than their bytes at the memory bandwidth: a small matmul is memory-bound;
* **attention**: the fused kernel's causal FLOPs at ``peak_flops × attention_efficiency`` (FlashAttention-2 and -3
  papers' measured fractions);
* **memory-bound ops** (norms, activations, residual adds, casts, the loss): their bytes read and written at
  ``memory_bandwidth × memory_efficiency``;
* and no less than ``kernels × kernel_latency_s``: eager PyTorch launches one kernel per op, and a kernel cannot
  take less than its launch, so a tiny model's step is latency-bound, not 4.8 µs.

Sources of each figure: :mod:`nbtrain.profiler.catalog`. What is counted: :mod:`nbtrain.profiler.kernels`.
"""

from __future__ import annotations

from dataclasses import dataclass

from nbtrain.profiler.hardware import Cluster
from nbtrain.profiler.result import KERNEL_QUANTITIES, LayerProfile

_CLASSES = ("matmul_flops", "matmul_bytes", "attention_flops", "memory_bytes", "kernels")


@dataclass(frozen=True)
class Work:
    """What one layer's forward or backward does on one device, by kernel class."""

    matmul_flops: float = 0.0
    """FLOPs of its matrix multiplications (``mm``, ``addmm``, ``bmm``, convolutions)."""
    matmul_bytes: float = 0.0
    """Bytes those matmuls read and write (operands and results)."""
    attention_flops: float = 0.0
    """FLOPs of its fused attention kernels, halved where causal (what the kernel computes)."""
    memory_bytes: float = 0.0
    """Bytes read and written by every other op (memory-bound)."""
    kernels: float = 0.0
    """Kernels launched (aten ops that are not views)."""

    def split(self, ways: int) -> "Work":
        """This work on one of ``ways`` tensor-parallel ranks: FLOPs and bytes divided, each rank launching every
        kernel."""
        return Work(self.matmul_flops / ways, self.matmul_bytes / ways, self.attention_flops / ways,
                    self.memory_bytes / ways, self.kernels)


def priced(cluster: Cluster) -> bool:
    """Whether ``cluster`` carries the figures to price by kernel (a GPU from the catalog or detected)."""
    return cluster.memory_bandwidth > 0 and cluster.memory_efficiency > 0


def seconds(work: Work, cluster: Cluster) -> float:
    """The time of ``work`` on one device of ``cluster`` (the module docstring gives the model)."""
    bandwidth = cluster.memory_bandwidth * cluster.memory_efficiency
    matmul = max(work.matmul_flops / cluster.sustained_flops, work.matmul_bytes / bandwidth)
    attention = work.attention_flops / (cluster.peak_flops * (cluster.attention_efficiency or
                                                              cluster.flops_efficiency))
    busy = matmul + attention + work.memory_bytes / bandwidth
    return max(busy, work.kernels * cluster.kernel_latency_s)


def counted_by_kernel(layer: LayerProfile) -> bool:
    """Whether the profile counted this layer's kernels (a profile saved before they were counted did not)."""
    return all(q in layer.scaling for q in KERNEL_QUANTITIES)


def by_kernel_class(layer: LayerProfile, cluster: Cluster, *, timed_here: bool) -> bool:
    """Whether the cost model prices ``layer``'s compute on ``cluster`` by kernel class: not timed on this machine
    (``timed_here``: the profile was measured where the cluster is, and the layer has its times), a cluster with the
    figures (a GPU), and a profile that counted the kernels."""
    return not (timed_here and layer.time_fwd_s is not None) and priced(cluster) and counted_by_kernel(layer)


def layer_work(layer: LayerProfile, batch: float, seq_len: int) -> tuple[Work, Work] | None:
    """A profiled layer's (forward, backward) work at ``batch`` sequences of ``seq_len`` on one device, or None
    for a profile saved before kernels were counted (the planner then prices FLOPs at the sustained rate)."""
    if not counted_by_kernel(layer):
        return None
    return tuple(Work(*(float(layer.scaling[f"{q}_{d}"](batch, seq_len)) if batch else 0.0 for q in _CLASSES))
                 for d in ("fwd", "bwd"))
