"""Mixtures of experts on the profiler's fake tensors. Data-dependent routing: a mixture of experts that picks each expert's tokens with
``torch.where(chosen == e)`` (``nonzero``) asks for a number the fake step does not have. For a model with routed
experts (:func:`nbtrain.models.experts.expert_facts`), :class:`ExpectedRouting` answers with the expected one: a
routing mask holds its ``k`` choices per token over ``E`` experts, so each expert gets ``1/E`` of the mask's entries
(``k/E`` of the tokens), as a balanced router gives them. The profile says so in a note.

    >>> from torch._subclasses.fake_tensor import FakeTensorMode
    >>> with FakeTensorMode(), ExpectedRouting(experts=4) as routing:
    ...     rows, slots = torch.where(torch.empty(32, 2, dtype=torch.long) == 1)   # 32 tokens, top-2 of 4 experts
    >>> rows.shape, routing.used
    (torch.Size([16]), True)

A real run's load differs step to step and expert to expert; the profile counts the mean, which is what the step's
FLOPs add up to (every token still goes to ``k`` experts) and what a balanced router's memory is. And the grouped
matmul of transformers' experts: torch's fake kernel for ``_grouped_mm`` takes bf16 only (the CUDA kernel's rule), so
an fp32 profile (a CPU run's) gets an empty output of the shape the CPU kernel returns.
"""

from __future__ import annotations

import contextlib
import copy
import io
import warnings

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


class ExpectedRouting(TorchDispatchMode):
    """Answers ``nonzero`` on fake tensors with ``1/experts`` of the input's entries (at least one); ``used`` tells
    whether it had to."""

    def __init__(self, experts: int):
        super().__init__()
        self.experts = experts
        self.used = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is getattr(aten, "_grouped_mm", None):
            if args[0].dtype != torch.bfloat16:  # torch's fake kernel takes bf16 only (the CUDA kernel's rule);
                return _grouped_mm_like(*args, **(kwargs or {}))  # the CPU runs fp32 too
        if func is aten.nonzero.default:
            (mask,) = args
            self.used = True
            rows = max(1, round(mask.numel() / self.experts))
            return torch.zeros((rows, mask.dim()), dtype=torch.long, device=mask.device)
        return func(*args, **(kwargs or {}))


def _grouped_mm_like(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """An empty tensor of the shape ``torch._grouped_mm`` returns (its four forms: 2-D rows × 3-D experts → rows,
    3-D × 3-D → batched, 2-D × 2-D grouped along the contraction → one block per group, 3-D × 2-D → rows)."""
    if mat_a.dim() == 2 and mat_b.dim() == 3:
        shape = (mat_a.shape[0], mat_b.shape[-1])
    elif mat_a.dim() == 3 and mat_b.dim() == 3:
        shape = (mat_a.shape[0], mat_a.shape[1], mat_b.shape[-1])
    elif mat_a.dim() == 2 and mat_b.dim() == 2:
        shape = (offs.shape[0], mat_a.shape[0], mat_b.shape[-1])
    else:
        shape = (mat_a.shape[1], mat_b.shape[-1])
    return torch.empty(shape, dtype=out_dtype or mat_a.dtype, device=mat_a.device)


def why_not_traced(model: nn.Module, second_layer: str, args) -> str:
    """Why ``torch.distributed.pipelining.pipeline()`` cannot trace ``model`` on ``args`` (one small batch of real
    inputs: a tuple of positional arguments, or a dict of keyword ones) and cut it before ``second_layer``, as the
    executor's traced pipeline stages do (:mod:`nbtrain.run.parallel.traced_stages`); ``""`` when it can.

    Routing by value traces when the forward only computes with the picked tokens (``torch.export`` gives their
    count a symbol), and not when it branches on them (``if rows.numel():``). A copy is traced, so the model's own
    modules keep their forward (``pipeline()`` marks the split modules in place)."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    positional, keywords = ((), args) if isinstance(args, dict) else (tuple(args), {})
    try:  # a refusal prints the traced graph, and torch's pytree warns of its own deprecations: neither is for users
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            pipeline(copy.deepcopy(model), mb_args=positional, mb_kwargs=keywords,
                     split_spec={second_layer: SplitPoint.BEGINNING})
    except Exception as error:  # torch.export's refusals are long: the innermost cause's first line says what
        while error.__cause__ is not None:
            error = error.__cause__
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return f"{type(error).__name__}: {first}"
    return ""
