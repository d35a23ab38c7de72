"""Profiles timed on this machine as its workers run, kept per model structure so that a second cell pays nothing.

    >>> prof = timed_profile(model, batch_size=4, seq_len=128)     # each layer timed, one intra-op thread
    >>> timed_profile(model, batch_size=4, seq_len=128) is prof     # the same structure and shape: from the cache
    True

On a CPU cluster each worker process runs one intra-op thread (``nbtrain.launch`` sets it), so its layers are timed
with one thread here too; the cost model then scales each layer's time by FLOPs to a plan's micro-batch
(Galvatron-BMW profiles compute the same way), less the part its rows do not scale (timed again at one row), which
every call pays whole, and by the processes that share a core. On a GPU the layers are
timed there, with CUDA events (:class:`~nbtrain.profiler.observers.Timer`), in the run's precision.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable

from torch import nn

from nbtrain.profiler.calibrate import intra_op_threads
from nbtrain.profiler.model import profile
from nbtrain.profiler.result import ModelProfile

_CACHE: dict[tuple, ModelProfile] = {}


def structure_key(model: nn.Module) -> tuple:
    """What a profile's numbers depend on: the module classes in order and every parameter's name, shape, dtype."""
    return (tuple(type(m).__qualname__ for m in model.modules()),
            tuple((name, tuple(p.shape), str(p.dtype)) for name, p in model.named_parameters()))


def timed_profile(model: nn.Module, *, batch_size: int, seq_len: int | None, inputs: Callable | None = None,
                  loss_fn: Callable | None = None, tp_plan: dict | None = None, threads: int = 1,
                  device: str = "cpu", dtype: str = "fp32") -> ModelProfile:
    """``nbtrain.profile(model, ..., measure=device)`` at ``batch_size`` sequences, cached by :func:`structure_key`,
    shape and the workload's functions: on the CPU timed with ``threads`` intra-op threads, on a GPU
    (``device="cuda"``) with CUDA events in ``dtype``."""
    key = (structure_key(model), batch_size, seq_len, inputs, loss_fn,
           tuple(sorted((tp_plan or {}).items())), threads, device, dtype)
    if key not in _CACHE:
        with intra_op_threads(threads) if device == "cpu" else nullcontext():
            _CACHE[key] = profile(model, batch_size=batch_size, seq_len=seq_len, dtype=dtype, measure=device,
                                  inputs=inputs, loss_fn=loss_fn, tp_plan=tp_plan)
    return _CACHE[key]


def forget(model: nn.Module) -> None:
    """Drop every timed profile of ``model``'s structure, so that the next one times its layers afresh (a run far
    from its prediction: :mod:`nbtrain.run.prediction_check`)."""
    key = structure_key(model)
    for cached in [k for k in _CACHE if k[0] == key]:
        del _CACHE[cached]
