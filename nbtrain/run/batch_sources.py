"""Where a run's global batches come from: a list gone through again and again, or a function ``step -> batch``;
checked as they enter the run, and several stacked per step for gradient accumulation. For a language model with
the next-token loss a batch may also be one 2-D tensor of token ids (:func:`split_window`).

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

import torch

from nbtrain.errors import InvalidArgumentError
from nbtrain.run.batches import TOKEN_DTYPES, cat_rows, check_batch


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


def is_token_window(batch) -> bool:
    """Whether a batch is one 2-D tensor of token ids (rows of at least two tokens), as people hold a causal-LM
    corpus (nanoGPT's ``get_batch``, a tokenised ``datasets`` column)."""
    return isinstance(batch, torch.Tensor) and batch.dtype in TOKEN_DTYPES and batch.dim() == 2 and \
        batch.shape[1] >= 2


def split_window(batch):
    """A 2-D tensor of token ids as the pair a causal language model trains on: inputs ``ids[:, :-1]`` and the next
    tokens ``ids[:, 1:]`` as targets (transformers' ``labels=input_ids``); any other batch as it is."""
    return (batch[:, :-1], batch[:, 1:]) if is_token_window(batch) else batch


class TokenWindows:
    """A batch source whose token-id tensors are split into (inputs, next-token targets) as the run takes them."""

    def __init__(self, get_batch: Callable[[int], object]):
        self.get_batch = get_batch

    def __call__(self, step: int) -> tuple:
        return split_window(self.get_batch(step))


def as_windows(get_batch: Callable[[int], object]) -> Callable[[int], tuple]:
    """The source with its token-id tensors split into pairs: a list's at once (so it is checked whole before the
    run), a function's as the run takes them."""
    if isinstance(get_batch, ListedBatches):
        return ListedBatches([split_window(b) for b in get_batch.items])
    return TokenWindows(get_batch)


def window_note(batch) -> str:
    """What a run says once when it splits token-id tensors into pairs."""
    return (f"note: each batch is a tensor of token ids ({batch.shape[0]} × {batch.shape[1]}): trained as inputs "
            f"ids[:, :-1] with the next tokens ids[:, 1:] as targets ({batch.shape[1] - 1} per row)")


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
