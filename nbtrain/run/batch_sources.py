"""Where a run's global batches come from: a list gone through again and again, or a function ``step -> batch``;
checked as they enter the run, and several stacked per step for gradient accumulation.

    >>> import torch
    >>> window = torch.randint(0, 512, (4, 9))
    >>> source = checked(batch_source([(window[:, :-1], window[:, 1:])]), batches=3,
    ...                  shape=dict(global_batch=4, seq_len=None, vocab_size=512, lm_targets=True))
    >>> ids, targets = AccumulatedBatches(source, 2)(step=1)     # batches 2 and 3 of the list, stacked
    >>> tuple(ids.shape)
    (8, 8)
"""

from __future__ import annotations

from typing import Callable

from nbtrain.errors import InvalidArgumentError
from nbtrain.run.batches import cat_rows, check_batch


class ListedBatches:
    """Batch ``step`` of a list, which the run goes through again and again."""

    def __init__(self, items):
        self.items = items

    def __call__(self, step: int) -> tuple:
        return self.items[step % len(self.items)]


class CheckedBatches:
    """A batch function whose every batch is checked (``check_batch``) before a step takes it."""

    def __init__(self, get_batch: Callable[[int], tuple], shape: dict):
        self.get_batch, self.shape = get_batch, shape

    def __call__(self, step: int) -> tuple:
        return check_batch(self.get_batch(step), step=step, **self.shape)


class AccumulatedBatches:
    """``accumulate`` batches of the source per step, stacked by rows: the step's gradient is their mean, as
    ``accumulate`` × the plan's micro-batches, each as large as before (gradient accumulation)."""

    def __init__(self, get_batch: Callable[[int], tuple], accumulate: int):
        self.get_batch, self.accumulate = get_batch, accumulate

    def __call__(self, step: int) -> tuple:
        batches = [self.get_batch(step * self.accumulate + j) for j in range(self.accumulate)]
        return cat_rows([b[0] for b in batches]), cat_rows([b[1] for b in batches])


def batch_source(data) -> Callable[[int], tuple]:
    """``data`` (a list or any re-iterable of batches, or a function ``step -> batch``) as a function of the step."""
    if callable(data):
        return data
    items = list(data) if not isinstance(data, (list, tuple)) else data
    if not items:
        raise InvalidArgumentError("no batches given: pass a list of (ids, targets) or a function step -> batch")
    return ListedBatches(items)


def checked(get_batch: Callable[[int], tuple], batches: int, shape: dict) -> Callable[[int], tuple]:
    """The source with every batch checked against ``shape`` (:func:`~nbtrain.run.batches.check_batch`'s keywords):
    a list here, all of the ``batches`` the run takes of it; batches a function makes, in the workers as they come."""
    if isinstance(get_batch, ListedBatches):
        for step in range(min(batches, len(get_batch.items))):
            check_batch(get_batch(step), step=step, **shape)
        return get_batch
    return CheckedBatches(get_batch, shape)
