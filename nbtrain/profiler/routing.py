"""Data-dependent routing on the profiler's fake tensors: a mixture of experts that picks each expert's tokens with
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
FLOPs add up to (every token still goes to ``k`` experts) and what a balanced router's memory is.
"""

from __future__ import annotations

import torch
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
        if func is aten.nonzero.default:
            (mask,) = args
            self.used = True
            rows = max(1, round(mask.numel() / self.experts))
            return torch.zeros((rows, mask.dim()), dtype=torch.long, device=mask.device)
        return func(*args, **(kwargs or {}))
