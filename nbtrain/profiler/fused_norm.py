"""What running a model's RMSNorms as fused kernels saves against the norms the profile traced
(:func:`fused_norm_facts`, kept in a profile's ``arch["fused_norm"]`` when ``profile(..., fused_norm=True)``)."""

from __future__ import annotations

import math

from torch import nn

from nbtrain.models.description import ModelDescription, slot_module
from nbtrain.profiler.kernels import KernelCounter
from nbtrain.profiler.observers import SavedBytes


FUSED_NORM_KERNELS = {"fwd": 1, "bwd": 2}
"""Kernels a fused RMSNorm launches: one forward; a backward for the input's gradient and a reduction of the
weight's (torchtitan's Triton ``fused_rmsnorm``: ``_rms_norm_bwd_kernel_sm``, then ``_dw.sum(0)``)."""


def fused_norm_bytes(width: int, dtype_bytes: int) -> dict[str, int]:
    """Bytes a token costs one fused RMSNorm of ``width`` in a ``dtype_bytes`` compute dtype: saved for backward, and
    read and written by its forward and its backward kernels.

    torchtitan's ``TritonFusedRMSNorm`` (``torchtitan/models/norms.py`` at 6aac938, the Llama 2 13B run's norm) and
    torch's CUDA ``_fused_rms_norm`` (``derivatives.yaml``: backward from ``input``, ``result1`` = rstd,
    ``weight``) save the input in its own dtype and one fp32 rstd a row. The forward reads the input and writes the
    output and the rstd; the backward reads the output's gradient, the input and the rstd and writes the input's
    gradient (the weight's, a reduction over the rows, is a constant per call, not per token).

        >>> fused_norm_bytes(4096, 2)
        {'saved': 8196, 'memory_fwd': 16388, 'memory_bwd': 24580}
    """
    e = dtype_bytes
    return {"saved": e * width + 4, "memory_fwd": 2 * e * width + 4, "memory_bwd": 3 * e * width + 4}


def _rms_norms(module: nn.Module, hidden: int) -> list[nn.Module]:
    """The RMSNorms in ``module`` that normalise the hidden state, once a token (``nn.RMSNorm``, or a Python
    ``...RMSNorm`` without submodules as Hugging Face's ``LlamaRMSNorm``; a per-head norm, Qwen3's ``q_norm``, is
    narrower and runs once a head)."""
    found = []
    for m in module.modules():
        if isinstance(m, nn.RMSNorm) or (type(m).__name__.endswith("RMSNorm") and not any(True for _ in m.children())):
            weight = getattr(m, "weight", None)
            width = weight.numel() if weight is not None else math.prod(getattr(m, "normalized_shape", (0,)))
            if width == hidden:
                found.append(m)
    return found


def _traced_norm(norm: nn.Module, dtype, hidden: int) -> dict[str, float]:
    """What ``norm`` costs a token as it runs here (the ops the profiler counts in the model): the bytes it saves,
    and the bytes its ops read and write and the kernels they launch, forward and backward (bytes per token: the
    difference between 8 and 4 tokens over 4; kernels per call)."""
    import copy

    import torch

    one = copy.deepcopy(norm)
    if any(p.is_meta for p in one.parameters()):
        one = one.to_empty(device="cpu")
    one = one.to(device="cpu", dtype=dtype)
    with torch.no_grad():
        for p in one.parameters():
            p.fill_(1.0)
    counts = []
    for tokens in (4, 8):
        x = torch.randn(1, tokens, hidden, dtype=dtype, requires_grad=True)
        counter, saved = KernelCounter(), SavedBytes(one.parameters())
        with counter:
            counter.switch(0, "fwd")
            with saved.hooks():
                y = one(x)
            counter.switch(-1, "fwd")  # the output's gradient is the caller's, not the norm's
            grad = torch.ones_like(y)
            counter.switch(0, "bwd")
            torch.autograd.grad(y, [x, *one.parameters()], grad)  # no leaf's .grad to accumulate into
        values = counter.finish(1)
        counts.append({"saved": saved.per_segment[0],
                       **{f"{q}_{d}": values[f"{q}_{d}"][0] for q in ("memory_bytes", "kernels")
                          for d in ("fwd", "bwd")}})
    small, big = counts
    per_token = {q: (big[q] - small[q]) / 4 for q in ("saved", "memory_bytes_fwd", "memory_bytes_bwd")}
    return {"saved": per_token["saved"], "memory_fwd": per_token["memory_bytes_fwd"],
            "memory_bwd": per_token["memory_bytes_bwd"], "kernels_fwd": small["kernels_fwd"],
            "kernels_bwd": small["kernels_bwd"]}


def fused_norm_facts(description: ModelDescription, dtype, hidden: int | None) -> list[dict[str, float]]:
    """Per layer, what running its RMSNorms over the hidden state as one fused kernel each saves against the norms
    the profile traced (:func:`nbtrain.profiler.model.profile`'s ``fused_norm=True``): bytes a token saved for
    backward and read and written forward and backward, and kernels a call. A norm the profile saw run as ``nn.RMSNorm``
    does on a CPU (upcast to fp32, the fp32 input and the fp32 normalised value saved: 8 bytes a unit, and six kernels
    or more each way) saves ``8 - e`` bytes a unit and a token in a compute dtype of ``e`` bytes; one already fused
    saves nothing (never less than nothing). A layer without such a norm gets zeros."""
    import torch

    itemsize = torch.empty((), dtype=dtype).element_size()
    out = []
    for slots in description.layers:
        total = dict.fromkeys(("saved", "memory_fwd", "memory_bwd", "kernels_fwd", "kernels_bwd"), 0.0)
        norms = {id(m): m for parent, attr in slots for m in _rms_norms(slot_module(parent, attr), hidden or -1)}
        for norm in norms.values():
            traced, fused = _traced_norm(norm, dtype, hidden), fused_norm_bytes(hidden, itemsize)
            for q in ("saved", "memory_fwd", "memory_bwd"):
                total[q] += max(0.0, traced[q] - fused[q])
            for d in ("fwd", "bwd"):
                total[f"kernels_{d}"] += max(0, traced[f"kernels_{d}"] - FUSED_NORM_KERNELS[d])
        out.append(total)
    return out
