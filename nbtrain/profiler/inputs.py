"""Profiler inputs shaped like a user's batch, for models that take no token ids (images, a dict of features).

    >>> import torch
    >>> batch = ({"pixel_values": torch.randn(4, 3, 16, 16)}, torch.randint(0, 10, (4,)))
    >>> inputs = inputs_like(batch)
    >>> args, targets = inputs(2, 8, "cpu")
    >>> tuple(args["pixel_values"].shape), tuple(targets.shape)
    ((2, 3, 16, 16), (2,))

``inputs(batch, seq, device)`` makes random tensors with the batch's structure, dtypes and shapes, ``batch`` rows,
and, for integer tensors as long as the batch's token ids (``input_ids``, their mask, labels), ``seq`` columns:
what :func:`nbtrain.profile` runs the model on, on fake tensors. Integers are drawn in ``[0, largest]`` of the
batch's (a ``-100`` label becomes a class: the profile counts shapes, not values).
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves, tree_map

TOKEN_DTYPES = (torch.long, torch.int32)


class BatchLikeInputs:
    """``inputs(batch, seq, device) -> (args, targets)`` shaped like one real batch (module docstring)."""

    def __init__(self, batch):
        inputs, targets = batch
        self._inputs, self._targets = _describe(inputs), _describe(targets)
        leaves = [t for t in tree_leaves(batch) if isinstance(t, torch.Tensor)]
        self._length = next((t.shape[1] for t in leaves if t.dtype in TOKEN_DTYPES and t.dim() >= 2), None)
        self.key = repr((self._inputs, self._targets))
        """The batch's structure, dtypes and shapes: equal keys, equal profiles."""

    def __call__(self, batch: int, seq: int, device):
        return self._make(self._inputs, batch, seq, device), self._make(self._targets, batch, seq, device)

    def _make(self, described, batch: int, seq: int, device):
        def make(leaf):
            if not isinstance(leaf, _Leaf):
                return leaf
            shape = [batch, *leaf.shape[1:]]
            if leaf.dtype in TOKEN_DTYPES and len(shape) >= 2 and leaf.shape[1] == self._length:
                shape[1] = seq
            if leaf.dtype.is_floating_point:
                return torch.randn(shape, dtype=leaf.dtype, device=device)
            if leaf.dtype == torch.bool:
                return torch.ones(shape, dtype=torch.bool, device=device)
            return torch.randint(0, leaf.high + 1, shape, dtype=leaf.dtype, device=device)

        return tree_map(make, described)


class _Leaf:
    def __init__(self, t: torch.Tensor):
        self.shape, self.dtype = tuple(t.shape), t.dtype
        integer = not t.dtype.is_floating_point and t.dtype != torch.bool and t.numel()
        self.high = max(0, int(t.max())) if integer else 0

    def __repr__(self) -> str:
        return f"{self.dtype}{list(self.shape)}<={self.high}"


def _describe(tree):
    return tree_map(lambda t: _Leaf(t) if isinstance(t, torch.Tensor) else t, tree)


def inputs_like(batch) -> BatchLikeInputs:
    """Profiler inputs shaped like ``batch`` (an ``(inputs, targets)`` pair, as ``fit`` and ``--data`` take)."""
    return BatchLikeInputs(batch)
