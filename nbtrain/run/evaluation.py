"""Evaluation during training: a held-out loss under the run's plan, beside the training loss.

    >>> import torch
    >>> model = nbtrain.build_preset("llama-tiny", device="cpu")
    >>> windows = torch.randint(0, 512, (6, 4, 33), generator=torch.Generator().manual_seed(0))
    >>> batches = [(w[:, :-1], w[:, 1:]) for w in windows]         # 6 batches of 4 rows × 32 tokens
    >>> result = nbtrain.fit(model, batches[:4], plan="pp=2 mb=2", steps=4, num_processes=2, progress=False,
    ...                      eval_data=batches[4:], eval_every=2)    # 2 held out
    >>> sorted(result.eval_losses)                  # the validation loss after steps 2 and 4
    [2, 4]
    >>> result.eval_loss == result.eval_losses[4]   # the last: the trained model's
    True

``eval_data`` is a finite list of global batches, as ``fit``'s ``data`` holds them (``(inputs, targets)`` pairs, or
2-D token-id tensors for a language model with the next-token loss), checked here, before anything is launched,
as the training batches are (:func:`~nbtrain.run.batches.check_batch`): the plan's global batch of rows (a pipeline's
stages also take its sequence length: their buffers are shaped by the first step). Each evaluation goes through all
of them; ``eval_every=N`` evaluates after every N-th step and after the last, and by default once, after the last.

The validation loss is the mean of the batches' losses weighted by what each averages over: its targets that count
(not ``-100``) for integer targets, else its rows. So it is the mean over every counted target of the set, as one
process computes it on the whole set, whatever the plan cuts the batches into (each batch's loss is the training
step's, :meth:`~nbtrain.run.trainer.Trainer.evaluate`). A batch whose every target is ``-100`` adds nothing, and is
left out here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nbtrain.checks import positive_int
from nbtrain.errors import InvalidArgumentError
from nbtrain.run.batch_sources import is_token_window, split_window
from nbtrain.run.batches import batch_shape, cat_rows, check_batch
from nbtrain.run.trainer import counted_targets


@dataclass(frozen=True)
class EvalSet:
    """The held-out batches a run evaluates on, and when."""

    batches: list
    """Global batches as a step takes them (``accumulate`` batches of ``eval_data`` stacked by rows, as a step's)."""
    weights: list[int]
    """What each batch's mean loss averages over: its counted targets (integer targets), or its rows."""
    every: int | None = None
    """Evaluate after every ``every``-th step (and after the last); None: only after the last."""

    def due(self, step: int, steps: int) -> bool:
        """Whether the run evaluates after step ``step`` (numbered from 1) of ``steps``."""
        return step == steps or (self.every is not None and step % self.every == 0)


def check_eval_every(eval_every, eval_data) -> int | None:
    """``eval_every`` as a step count (None: once, after the last step), refused without ``eval_data``."""
    if eval_every is None:
        return None
    every = positive_int(eval_every, f"eval_every must be a positive integer (evaluate after every N-th step), "
                                     f"got {eval_every!r}")
    if eval_data is None:
        raise InvalidArgumentError(f"eval_every={eval_every} without eval_data: give the held-out batches to "
                                   "evaluate on, fit(..., eval_data=batches, eval_every=N)")
    return every


def eval_set(eval_data, *, shape: dict, windows: bool, accumulate: int = 1, every: int | None = None) -> EvalSet:
    """``eval_data`` checked and ready for the workers: ``shape`` is the training batches' check
    (:func:`~nbtrain.run.batches.check_batch`'s keywords), ``windows`` whether 2-D token-id tensors are split into
    inputs and next-token targets (a language model with the next-token loss), ``accumulate`` the training batches
    stacked per step (the eval batches are stacked alike: a pipeline's micro-batches keep their shape)."""
    if callable(eval_data) or isinstance(eval_data, (str, bytes, dict, torch.Tensor)) or \
            not hasattr(eval_data, "__iter__"):
        raise InvalidArgumentError(f"eval_data is a {type(eval_data).__name__}; give a list of (inputs, targets) "
                                   "global batches, held out from training (each evaluation goes through all of "
                                   "them, so it is a list, not a function of the step)")
    items = list(eval_data)
    if not items:
        raise InvalidArgumentError("eval_data holds no batches; give a list of (inputs, targets) global batches")
    if windows:
        items = [split_window(b) if is_token_window(b) else b for b in items]
    for i, batch in enumerate(items):
        items[i] = _checked(batch, i, shape)
    if len(items) % accumulate:
        raise InvalidArgumentError(f"eval_data holds {len(items)} batches, but accumulate={accumulate} stacks "
                                   f"{accumulate} batches per step and an evaluation as a step does; give a multiple "
                                   f"of {accumulate} batches")
    groups = [items[i:i + accumulate] for i in range(0, len(items), accumulate)]
    batches = [g[0] if len(g) == 1 else (cat_rows([b[0] for b in g]), cat_rows([b[1] for b in g])) for g in groups]
    weights = [_weight(ids, targets) for ids, targets in batches]
    kept = [(b, w) for b, w in zip(batches, weights) if w > 0]
    if not kept:
        raise InvalidArgumentError("every target of eval_data is -100 (a position the loss ignores): there is no "
                                   "loss to evaluate; hold out batches whose targets count")
    return EvalSet([b for b, _ in kept], [w for _, w in kept], every)


def _checked(batch, i: int, shape: dict) -> tuple:
    """Batch ``i`` of ``eval_data`` as a training batch is checked, its shape against the training batches'."""
    try:  # the same check as a training batch's, named as eval_data's
        ids, targets = check_batch(batch, step=i, **{**shape, "global_batch": None, "seq_len": None})
    except InvalidArgumentError as error:
        raise InvalidArgumentError(str(error).replace(f"batch of step {i}", f"eval_data batch {i}", 1)) from None
    rows, length = batch_shape(ids)
    if shape["global_batch"] is not None and rows != shape["global_batch"]:
        raise InvalidArgumentError(f"eval_data batch {i} has {rows} rows, but the training batches have "
                                   f"{shape['global_batch']} (the plan's global batch); hold out batches of "
                                   f"{shape['global_batch']} rows: an evaluation runs each as a step runs a batch")
    if shape["seq_len"] is not None and length != shape["seq_len"]:
        raise InvalidArgumentError(f"eval_data batch {i} has {length} tokens per row, but a pipeline's stages take "
                                   f"the training batches' {shape['seq_len']}; hold out rows of {shape['seq_len']} "
                                   "tokens")
    return ids, targets


def _weight(ids, targets) -> int:
    counted = counted_targets(targets)
    return batch_shape(ids)[0] if counted is None else counted
