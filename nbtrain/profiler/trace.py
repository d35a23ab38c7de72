"""Run one training step of a model and read per-layer numbers off it: counted on fake tensors, or timed for real.

:func:`count` runs the step under ``FakeTensorMode`` (shapes and dtypes only, nothing allocated) with a FLOP counter,
a saved-tensor hook and a count of what per-op selective checkpointing keeps and recomputes
(:mod:`~nbtrain.profiler.selective`); :func:`time_step` runs it for real on a device with only a clock. Both cut the
step into segments with a :class:`~nbtrain.profiler.segments.SegmentTracker`.
"""

from __future__ import annotations

import statistics
import time
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call
from torch.utils._pytree import tree_map

from nbtrain.errors import ProfileError
from nbtrain.gc_pause import collection_paused
from nbtrain.models.adapters import ModelFamily
from nbtrain.profiler.routing import ExpectedRouting
from nbtrain.profiler.kernels import KernelCounter
from nbtrain.profiler.observers import FlopObserver, SavedBytes, Timer
from nbtrain.profiler.segments import SegmentTracker, first_tensor, tensors_in
from nbtrain.profiler.selective import SelectiveCounter
from nbtrain.profiler.twins import StandInPlan, StandIns
from nbtrain.tensor_memory import count_where_needed, counting


@dataclass
class Step:
    """Everything needed to run one training step of ``model``."""

    model: nn.Module
    family: ModelFamily
    blocks: list[nn.Module]
    inputs: Callable
    """``inputs(batch, seq, device) -> (args, targets)``; ``args`` as :func:`call_model` takes them."""
    loss_fn: Callable
    """``loss_fn(output, targets) -> scalar``."""
    dtype: torch.dtype
    experts: int = 0
    """Experts in each mixture-of-experts layer (:func:`~nbtrain.models.experts.expert_facts`; 0: none): routing
    that depends on the data is counted at the expected load over them (:mod:`nbtrain.profiler.routing`)."""
    twins: StandInPlan | None = None
    """Blocks that :func:`count` does not run but gives the figures of a structural twin
    (:mod:`nbtrain.profiler.twins`; ``None``: every block is counted)."""

    @property
    def num_segments(self) -> int:
        return len(self.blocks) + 2 if self.blocks else 1


@dataclass
class Counts:
    """Per-segment numbers of one fake step, keyed by quantity then segment index."""

    values: dict[str, dict[int, int]]
    module_segment: dict[nn.Module, int]
    """The segment in which each module first ran (to attribute parameters outside the blocks)."""
    expected_routing: bool = False
    """Whether data-dependent routing was answered with the expected load (:mod:`nbtrain.profiler.routing`)."""
    stood_in: bool = False
    """Whether blocks took their twins' figures (:attr:`Step.twins`) rather than being counted."""


def call_arguments(inputs, kwargs: dict | None = None) -> tuple[tuple, dict]:
    """``(args, kwargs)`` that call a model on a batch's ``inputs``: a tensor is its one argument, a tuple or list
    its arguments, a dict its keywords; ``kwargs`` (the family's ``use_cache=False``) where ``inputs`` does not
    name them."""
    kwargs = dict(kwargs or {})
    if isinstance(inputs, torch.Tensor):
        return (inputs,), kwargs
    if isinstance(inputs, dict):
        return (), {**kwargs, **inputs}
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), kwargs
    raise ProfileError(f"inputs(batch, seq, device) returned {type(inputs).__name__} arguments; return "
                       "(args, targets) with args a tensor, a tuple of tensors or a dict of keyword tensors")


def call_model(model: nn.Module, args, kwargs: dict, params: dict | None = None):
    """``model(args)`` for a tensor, ``model(*args)`` for a tuple or list, ``model(**args)`` for a dict, with the
    family's ``kwargs`` (``use_cache=False``) unless ``args`` names them; through ``params`` when given."""
    args, kwargs = call_arguments(args, kwargs)
    if params is None:
        return model(*args, **kwargs)
    return functional_call(model, params, args, kwargs, strict=False)


def _in_dtype(args, dtype: torch.dtype):
    """Float inputs (images, features) in the profile's dtype, as a bf16 model is fed them; ids and masks keep
    theirs. An ``inputs`` function does not know the dtype, and a conv or linear refuses a mix."""
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, args)


def _run(step: Step, observers, b: int, s: int, device, params: dict | None):
    args, targets = step.inputs(b, s, device)
    args = _in_dtype(args, step.dtype)
    tracker = SegmentTracker(step.blocks, observers)
    tracker.args = args  # the step's inputs: what the first layer keeps under checkpointing
    with tracker:
        out = call_model(step.model, args, step.family.forward_kwargs, params)
        for observer in observers:  # the loss is computed outside every layer
            getattr(observer, "model_returned", lambda: None)()
        loss = step.loss_fn(out, targets)
        tracker.start_backward()
        loss.backward()
    return tracker, out


def count(step: Step, b: int, s: int) -> Counts:
    """FLOPs, saved bytes and output bytes per segment at batch ``b``, length ``s``, without allocating.

    With ``step.twins``, only a few blocks of each group of twins run and the others take their figures, which are
    what counting them gives (:mod:`nbtrain.profiler.twins`); where that cannot be vouched for, or the shortened
    step fails at all, every block is counted."""
    if step.twins is not None:
        try:
            return _count(step, b, s, step.twins)
        except Exception:  # TwinsDiffer, or a forward that did not take a stand-in: the full count says what fails
            pass
    return _count(step, b, s, None)


def _count(step: Step, b: int, s: int, twins: StandInPlan | None) -> Counts:
    module_segment: dict[nn.Module, int] = {}
    current = {"segment": 0}

    class SegmentOfModule:
        def switch(self, segment, phase):
            current["segment"] = segment

    def note_module(module, args):
        module_segment.setdefault(module, current["segment"])

    with ExitStack() as stack:
        stack.enter_context(FakeTensorMode())
        stack.enter_context(step.family.fake_tracing())
        routing = stack.enter_context(ExpectedRouting(step.experts)) if step.experts else None
        params = {n: torch.empty(p.shape, dtype=step.dtype if p.is_floating_point() else p.dtype,
                                 requires_grad=p.requires_grad) for n, p in step.model.named_parameters()}
        buffers = {n: torch.empty(t.shape, dtype=t.dtype) for n, t in step.model.named_buffers()}
        selective, kernels = SelectiveCounter(), KernelCounter()
        flops, saved = FlopObserver(), SavedBytes(params.values(), also=selective.saved)
        stand_ins = stack.enter_context(StandIns(step.blocks, twins, saved)) if twins is not None else None
        stack.enter_context(torch.nn.modules.module.register_module_forward_pre_hook(note_module))
        stack.enter_context(flops.counter)
        stack.enter_context(kernels)  # inside the FLOP counter: it sees the ops as they are dispatched
        stack.enter_context(saved.hooks())
        stack.enter_context(selective)
        tracker, out = _run(step, [flops, saved, selective, kernels, SegmentOfModule()], b, s, "cpu",
                            {**params, **buffers})
    n = step.num_segments
    outputs = _output_bytes(tracker, out, n)
    # under ac=op a layer keeps its input (the step's inputs for the first; the one before's output for the rest)
    inputs = {i: outputs[i - 1] if i else sum(t.nbytes for t in tensors_in(tracker.args)) for i in range(n)}
    values = {
        "flops_fwd": {i: int(flops.fwd[i]) for i in range(n)},
        "flops_bwd": {i: int(flops.bwd[i]) for i in range(n)},
        "activation_bytes": {i: saved.per_segment[i] for i in range(n)},
        "head_shared_bytes": {i: saved.head_shared[i] for i in range(n)},
        "output_bytes": outputs,
        "selective_bytes": {i: inputs[i] + selective.kept[i] for i in range(n)},
        "recompute_bytes": {i: selective.recomputed[i] for i in range(n)},
        "recompute_matmul_flops": {i: selective.recomputed_matmul_flops[i] for i in range(n)},
        **kernels.finish(n),
    }
    if stand_ins is not None:
        stand_ins.fill(values)
    return Counts(values, module_segment, expected_routing=routing is not None and routing.used,
                  stood_in=stand_ins is not None)


def _output_bytes(tracker: SegmentTracker, out, n: int) -> dict[int, int]:
    """Embeddings hand block 0 its input; block i hands on its output; the last segment returns the output."""
    final = first_tensor(out)
    sizes = {n - 1: final.nbytes if final is not None else 0}
    if n > 1:
        sizes[0] = tracker.block_input_bytes.get(0, 0)
        sizes.update({i + 1: nbytes for i, nbytes in tracker.block_output_bytes.items()})
    return sizes


def time_step(step: Step, b: int, s: int, device: torch.device, repeats: int = 5) -> dict[str, dict[int, float]]:
    """Seconds per segment of a real step on ``device``: one warm-up, then the median of ``repeats``.

    The step runs as the trainer runs it, with no counting mode or hook but the tracker's and the trainer's own:
    Python's garbage collector held off inside each step (:mod:`nbtrain.gc_pause`), and off a GPU the count of the
    tensors saved for backward (:class:`~nbtrain.tensor_memory.SavedActivations`, ~10 µs a saved tensor, each
    layer's in its own time: on 2 processes here 0.9 ms of a transformers Qwen2's 16-18 ms data-parallel step, which
    no price held before). What no segment is charged with (the autograd engine between segments, the loss outside
    the model's last module) is shared out by each segment's part of the step, so that the segments add up to the
    whole step as timed.
    """
    runs, whole = [], []
    for i in range(repeats + 1):
        timer = Timer(device)
        with collection_paused():
            started = time.perf_counter()
            with counting(count_where_needed(device, exclude=step.model.parameters())):
                _run(step, [timer], b, s, device, params=None)
            timer.sync()
            elapsed = time.perf_counter() - started
        step.model.zero_grad(set_to_none=True)
        if i:
            runs.append(timer)
            whole.append(elapsed)
    n = step.num_segments
    fwd = {i: statistics.median(t.fwd[i] for t in runs) for i in range(n)}
    bwd = {i: statistics.median(t.bwd[i] for t in runs) for i in range(n)}
    charged = sum(fwd.values()) + sum(bwd.values())
    scale = max(1.0, statistics.median(whole) / charged) if charged else 1.0
    return {"time_fwd_s": {i: v * scale for i, v in fwd.items()},
            "time_bwd_s": {i: v * scale for i, v in bwd.items()}}


def time_with_fixed_part(step: Step, b: int, s: int, device: torch.device) -> dict[str, dict[int, float]]:
    """:func:`time_step` at ``b`` rows, and of each segment's seconds the part that rows do not scale
    (``time_fwd_fixed_s``, ``time_bwd_fixed_s``): timed again at one row, ``seconds(r) = fixed + r · per_row``
    through the two, kept within ``[0, seconds(1)]`` and ``seconds(b)`` (a busy moment may time one row slower
    than ``b``). On this machine's CPU a transformers Qwen2 of width 64 took
    17.2 ms at 16 rows and 9.4 at 8 (one thread): scaled by FLOPs from 16 rows, a data-parallel rank's 8 were priced
    8.6, and a micro-batch or a tensor-parallel split of it less still. A model that cannot take one row (a
    ``BatchNorm1d`` in training wants two) keeps no fixed part: its times scale as before."""
    times = time_step(step, b, s, device)
    try:
        one = time_step(step, 1, s, device) if b > 1 else times
    except Exception:  # nothing is lost but the split: the time at b rows stands
        step.model.zero_grad(set_to_none=True)
        one, b = times, 1
    for phase in ("fwd", "bwd"):
        whole, single = times[f"time_{phase}_s"], one[f"time_{phase}_s"]
        times[f"time_{phase}_fixed_s"] = {i: min(single[i], whole[i], max(0.0, (single[i] * b - whole[i]) / (b - 1)))
                                          if b > 1 else 0.0 for i in whole}
    return times
