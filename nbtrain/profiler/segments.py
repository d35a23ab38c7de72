"""Know, at every moment of a forward and backward pass, which layer of the model is running.

A model is cut into segments: what runs before the first repeated block (embeddings), each block, and what
runs after the last one (final norm, head, loss). :class:`SegmentTracker` hooks the blocks so that

* in forward, entering block ``i`` starts segment ``i + 1`` and leaving it starts segment ``i + 2``;
* in backward, the gradient arriving at block ``i``'s output starts block ``i``'s backward, and the gradient
  arriving at block 0's input starts the backward of the embeddings.

Those are exactly the boundaries a pipeline stage or an activation checkpoint has, so whatever an observer
accumulates between two switches (FLOPs, saved bytes, seconds) belongs to one layer. Observers get
``observer.switch(segment, phase)`` calls; ``phase`` is ``"fwd"`` or ``"bwd"``.

    tracker = SegmentTracker(blocks, observers=[flops])
    with tracker:
        loss = loss_fn(model(ids))
        tracker.start_backward()
        loss.backward()
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_leaves


class SegmentObserver(Protocol):
    def switch(self, segment: int, phase: str) -> None:
        """The layer now running changed to ``segment`` in ``phase``; charge what came before to the old one."""


def tensors_in(value) -> list[torch.Tensor]:
    """Every tensor in ``value``, however nested in tuples, lists and dicts (an op's arguments, a model's output)."""
    return [leaf for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor)]


def first_tensor(value) -> torch.Tensor | None:
    """The hidden state of a block's input or output: its first tensor (HF blocks return tuples)."""
    for leaf in tree_leaves(value):
        if isinstance(leaf, torch.Tensor):
            return leaf
    return None


def logits_of(output) -> torch.Tensor | None:
    """The logits of a model's output: a ``ModelOutput``'s ``.logits``, else its first tensor (a tuple's, or the
    tensor itself)."""
    logits = getattr(output, "logits", None)
    return first_tensor(output) if logits is None else logits


class SegmentTracker:
    """Hooks ``blocks`` and reports segment switches to ``observers`` (see the module docstring)."""

    def __init__(self, blocks: Sequence[nn.Module], observers: Sequence[SegmentObserver]):
        self.blocks = list(blocks)
        self.observers = list(observers)
        self.num_segments = len(self.blocks) + 2 if self.blocks else 1
        self.current = 0
        self.phase = "fwd"
        self.block_input_bytes: dict[int, int] = {}
        self.block_output_bytes: dict[int, int] = {}
        self._handles: list = []

    # -- context ---------------------------------------------------------------------------------
    def __enter__(self) -> "SegmentTracker":
        self.current, self.phase = 0, "fwd"
        for i, block in enumerate(self.blocks):
            self._handles.append(block.register_forward_pre_hook(self._make_pre_hook(i), with_kwargs=True))
            self._handles.append(block.register_forward_hook(self._make_post_hook(i), with_kwargs=True))
        self._notify()
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._notify(segment=-1)  # charge what remains; -1 means "outside the model"

    def start_backward(self) -> None:
        """Call right before ``loss.backward()``: backward begins in the last segment."""
        self._set(self.num_segments - 1, "bwd")

    # -- hooks -----------------------------------------------------------------------------------
    def _make_pre_hook(self, i: int):
        def hook(module, args, kwargs):
            hidden = first_tensor((args, kwargs))
            if hidden is not None:
                self.block_input_bytes[i] = hidden.nbytes
                if i == 0 and hidden.requires_grad:
                    hidden.register_hook(self._backward_enters(0))
            self._set(i + 1, "fwd")
        return hook

    def _make_post_hook(self, i: int):
        def hook(module, args, kwargs, output):
            hidden = first_tensor(output)
            if hidden is not None:
                self.block_output_bytes[i] = hidden.nbytes
                if hidden.requires_grad:
                    hidden.register_hook(self._backward_enters(i + 1))
            self._set(i + 2, "fwd")
        return hook

    def _backward_enters(self, segment: int):
        def hook(grad):
            self._set(segment, "bwd")
        return hook

    # -- switching -------------------------------------------------------------------------------
    def _set(self, segment: int, phase: str) -> None:
        if (segment, phase) != (self.current, self.phase):
            self._notify(segment, phase)

    def _notify(self, segment: int | None = None, phase: str | None = None) -> None:
        segment = self.current if segment is None else segment
        phase = phase or self.phase
        for observer in self.observers:
            observer.switch(segment, phase)
        self.current, self.phase = segment, phase
