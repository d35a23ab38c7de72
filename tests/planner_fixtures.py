"""Synthetic profiles and clusters with round numbers, for the cost-model and search tests.

No torch: a :class:`LayerProfile` is built from the coefficients of its :class:`Scaling` polynomials, so every
quantity of a layer is a number a test can write down by hand (``activation_bytes = 1000·b·s`` is
``Scaling((1000, 0, 0, 0, 0, 0))``).
"""

from __future__ import annotations

from nbtrain.profiler.hardware import Cluster
from nbtrain.profiler.result import QUANTITIES, RECOMPUTE_QUANTITIES, LayerProfile, ModelProfile, Scaling

KINDS = ("embedding", "block", "head")


def per_token(coefficient: float) -> Scaling:
    """A quantity proportional to the tokens of a micro-batch: ``coefficient · b · s``."""
    return Scaling((coefficient, 0, 0, 0, 0, 0))


def layer(name: str, kind: str, *, params: int, act: float, out: float, fwd: float, bwd: float | None = None,
          dtype_bytes: int = 2, scaling: dict[str, Scaling] | None = None) -> LayerProfile:
    """A layer whose per-token activation bytes, output bytes and FLOPs are ``act``, ``out``, ``fwd``, ``bwd``
    (backward defaults to twice the forward); ``scaling`` replaces any of the polynomials (``selective_bytes`` and
    ``recompute_bytes``, what ``ac=op`` keeps and recomputes, default to ``act``)."""
    # ac=op: unless given, it keeps everything and recomputes as many bytes (never better than no checkpointing,
    # as for a profile saved before nbtrain counted it)
    polys = {"flops_fwd": per_token(fwd), "flops_bwd": per_token(2 * fwd if bwd is None else bwd),
             "activation_bytes": per_token(act), "output_bytes": per_token(out), "selective_bytes": per_token(act),
             "recompute_bytes": per_token(act), **(scaling or {})}
    assert set(QUANTITIES) <= set(polys) <= set(QUANTITIES + RECOMPUTE_QUANTITIES)
    return LayerProfile(name=name, kind=kind, params=params, param_bytes=params * dtype_bytes,
                        **{q: polys[q](1, 1) for q in QUANTITIES}, scaling=polys)


def profile(layers, *, seq_len: int = 100, dtype: str = "bfloat16", n_head: int = 8, n_kv_head: int | None = None,
            model: str = "toy") -> ModelProfile:
    """A model of ``layers`` profiled at batch 1 and ``seq_len`` tokens (the cost model reads only the scaling)."""
    layers = tuple(layers)
    return ModelProfile(model=model, family="synthetic", batch_size=1, seq_len=seq_len, dtype=dtype, layers=layers,
                        params=sum(x.params for x in layers),
                        arch={"n_head": n_head, "n_kv_head": n_head if n_kv_head is None else n_kv_head})


def cluster(num_devices: int = 8, devices_per_node: int = 8, **changes) -> Cluster:
    """Round numbers: 1 TFLOP/s sustained (efficiency 1), 1 GB/s for every link, 8 G params/s of CPU AdamW per
    node, 1 TB of device and host memory, so a test can write the expected seconds and bytes by hand."""
    fields = dict(device="H100", num_devices=num_devices, devices_per_node=devices_per_node,
                  device_memory=10**12, peak_flops=1e12, flops_efficiency=1.0, intra_node_bandwidth=1e9,
                  inter_node_bandwidth=1e9, host_memory=10**12, host_to_device_bandwidth=1e9,
                  cpu_optimizer_rate=8e9)
    return Cluster(**{**fields, **changes})
