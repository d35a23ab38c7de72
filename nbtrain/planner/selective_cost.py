"""What per-op selective checkpointing (``ac=op``) costs a layer on one TP rank: the bytes it keeps, and the time
its backward spends recomputing what it did not keep. :class:`nbtrain.planner.cost.CostModel` calls these with
the profiled ``selective_bytes`` and ``recompute_bytes`` (:mod:`nbtrain.profiler.selective`).

    >>> kept_per_rank(selective=300, hidden=50, kind="block", tp=2, full=1000)   # 100 whole + 200 / 2
    200.0
"""

from __future__ import annotations

from nbtrain.profiler.hardware import Cluster

# ac=op on a GPU without a memory bandwidth in the catalog: the share of a transformer layer's forward time spent
# outside matmuls and attention (norms, element-wise ops). Ivanov et al. 2021 ("Data Movement Is All You Need",
# MLSys, Table 1, BERT-large on a V100 in PyTorch): normalisations 25.5% and element-wise ops 13.5% of the
# runtime beside 61% in tensor contractions; nbtrain takes 0.35 (fused kernels on newer GPUs spend less).
NON_MATMUL_SHARE = 0.35


def split_over_tp(nbytes: float, whole: float, tp: int) -> float:
    """Bytes one of ``tp`` tensor-parallel ranks holds of ``nbytes``, of which up to ``whole`` bytes (the
    hidden-sized tensors around the split matmuls) every rank holds whole and the rest is divided by ``tp``.

        >>> split_over_tp(300, whole=150, tp=2)
        225.0
    """
    if tp <= 1:
        return nbytes
    whole = min(nbytes, whole)
    return whole + (nbytes - whole) / tp


def kept_per_rank(selective: float, hidden: float, kind: str, tp: int, full: float) -> float:
    """Bytes one TP rank keeps under ``ac=op`` of the profiled ``selective`` bytes (the layer's input and the outputs
    of attention and every other projection), split as the executor splits them: the input (``hidden`` bytes) and a
    block's kept row-parallel output are whole on every rank, the heads' and the MLP's inner outputs divided by
    ``tp``. Of a block's two row-parallel projections (attention out, MLP down: partial sums of the whole hidden
    state before their all-reduce) every other matmul is kept, which is one of them in a Llama block (``o`` is the
    4th of 7, dropped; ``down`` the 7th, kept); nbtrain counts one. Never more than the ``full`` bytes the layer
    saves on that rank without checkpointing."""
    return min(split_over_tp(selective, (2 if kind == "block" else 1) * hidden, tp), full)


def recompute_seconds(written: float, hidden: float, kind: str, tp: int, cluster: Cluster, fwd: float,
                      slowdown: float = 1.0) -> float:
    """Seconds ``ac=op`` spends in backward recomputing the ops other than matmuls and attention: memory-bound,
    priced by the profiled bytes they ``written`` (split over TP like the activations: a block's norms and residual
    adds, four hidden states, are whole on every rank) at the memory bandwidth, times ``slowdown`` (the processes
    sharing the cores). On a CPU the bandwidth is the copy rate the cluster holds (measured by
    :func:`nbtrain.profiler.calibrate.copy_bandwidth` when calibrated); a cluster with a ``memory_bandwidth`` uses
    it (the catalog's GPUs have one); a GPU without one (a cluster saved before they had it) pays
    :data:`NON_MATMUL_SHARE` of the forward ``fwd``. Never
    more than ``fwd`` (full recomputation)."""
    written = split_over_tp(written, (4 if kind == "block" else 1) * hidden, tp)
    bandwidth = cluster.memory_bandwidth or (cluster.host_to_device_bandwidth if cluster.device == "cpu" else None)
    seconds = written / bandwidth * slowdown if bandwidth else NON_MATMUL_SHARE * fwd
    return min(seconds, fwd)


def matmul_recompute_seconds(flops: float, layer_flops: float, fwd: float, tp: int, cluster: Cluster,
                             by_kernel: bool) -> float:
    """Seconds ``ac=op`` spends in backward recomputing the projection matmuls it dropped (``flops`` of them, profiled
    as ``recompute_matmul_flops``) on one of ``tp`` ranks: at the achievable matmul rate where compute is priced by
    kernel (``by_kernel``: a catalog or detected GPU), else at the layer's own forward rate (``fwd`` seconds for its
    ``layer_flops``: measured here, or FLOPs over the sustained rate)."""
    if not flops:
        return 0.0
    if by_kernel:
        return flops / tp / cluster.sustained_flops
    return fwd * flops / layer_flops if layer_flops else 0.0
