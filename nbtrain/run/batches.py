"""Check a global batch before it reaches the workers: one clear line instead of a traceback from inside a step.

    >>> import torch, nbtrain
    >>> from nbtrain.run.batches import check_batch, model_vocab_size
    >>> model = nbtrain.build_preset("gpt-tiny", device="cpu")
    >>> window = torch.randint(0, 512, (8, 65))
    >>> ids, targets = check_batch((window[:, :-1], window[:, 1:]), step=0, global_batch=8, seq_len=64,
    ...                            vocab_size=model_vocab_size(model))          # 512
    >>> check_batch((ids.float(), targets), step=3, global_batch=8, seq_len=64, vocab_size=512)
    Traceback (most recent call last):
    ...
    nbtrain.errors.InvalidArgumentError: batch of step 3: ids have dtype torch.float32; token ids must be an integer tensor (torch.long) of shape (global_batch, seq_len) = (8, 64); convert them with ids.long()

A batch is a pair ``(inputs, targets)``. For a language model, ``inputs`` are token ids of shape
``(global_batch, seq_len)`` and ``targets`` the next-token loss's class indices, the same shape (``-100`` where the
loss ignores a position). With a ``loss_fn`` of the user's own (``lm_targets=False``), ``inputs`` may be any tensor,
a tuple of tensors (``model(*inputs)``) or a dict of them (``model(**inputs)``: a masked-LM batch with
``input_ids``, ``attention_mask``, ``labels``), and ``targets`` a tensor, a tuple or dict of them, or ``None``;
every tensor has one row per sample: the plan splits them all by rows. Unchecked, a float id or an id past the vocabulary fails inside a worker's embedding, with a torch traceback
from every rank; so batches are checked where they enter a run, before a worker sees them (``%%autoparallel
--launch --data NAME`` checks the first one before it scales the plan to it).

Cheap enough for every step: shapes and dtypes, and one min/max per tensor for the range (a second pass over the
targets only when they hold negative values, to tell ``-100`` from a wrong id).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves, tree_map

from nbtrain.data import IGNORE
from nbtrain.errors import InvalidArgumentError

TOKEN_DTYPES = (torch.long, torch.int32)
"""The index dtypes ``nn.Embedding`` takes."""


def model_vocab_size(model: nn.Module) -> int | None:
    """The token ids ``model`` takes (``0 .. vocab_size - 1``), or None for a model that takes no tokens.

        >>> model_vocab_size(nbtrain.build_preset("gpt-tiny", device="cpu"))
        512

    Read as the profiler reads it (:func:`nbtrain.models.adapters.detect_family`): the config of nbtrain's GPT
    and of Hugging Face GPT-2 and Llama models, else the rows of the model's first ``nn.Embedding``."""
    from nbtrain.models.adapters import detect_family

    return detect_family(model).vocab_size


def _shape(global_batch: int | None, seq_len: int | None) -> str:
    if global_batch is None and seq_len is None:
        return "(global_batch, seq_len)"
    known = [str(n) if n is not None else "any" for n in (global_batch, seq_len)]
    return f"(global_batch, seq_len) = ({', '.join(known)})"


def _dims(t: Tensor) -> str:
    return str(tuple(t.shape)).replace(",)", ")")


def tensors(tree) -> list[Tensor]:
    """The tensors of a batch's inputs or targets: a tensor, a tuple or list of them, or a dict of them."""
    return [t for t in tree_leaves(tree) if isinstance(t, Tensor)]


def map_rows(fn, tree):
    """``tree`` with ``fn`` applied to each tensor (``fn(t)`` takes rows of ``t``); anything else kept as it is."""
    return tree_map(lambda t: fn(t) if isinstance(t, Tensor) else t, tree)


def chunk_rows(tree, parts: int) -> list:
    """``tree`` cut into ``parts`` trees of equal rows (the rows of every tensor split alike)."""
    return [map_rows(lambda t, i=i: t.chunk(parts)[i], tree) for i in range(parts)]


def cat_rows(trees: list):
    """The trees stacked by rows, back into one (the inverse of :func:`chunk_rows`)."""
    return tree_map(lambda *parts: torch.cat(parts) if isinstance(parts[0], Tensor) else parts[0], *trees)


def is_token_ids(inputs) -> bool:
    """Whether a batch's inputs are token ids (one integer tensor), which the checks below know the shape of."""
    return isinstance(inputs, Tensor) and inputs.dtype in TOKEN_DTYPES


def batch_shape(inputs) -> tuple[int, int]:
    """``(rows, length)`` of a batch's inputs: the rows every tensor has, and the tokens per row of the first
    integer tensor with a second dimension (``input_ids``), or 1 for inputs without tokens (images, features)."""
    leaves = tensors(inputs)
    length = next((t.shape[1] for t in leaves if t.dtype in TOKEN_DTYPES and t.dim() >= 2), 1)
    return leaves[0].shape[0], length


def _check_structured(batch, where: str, global_batch: int | None, lm_targets: bool):
    """A batch whose inputs are not token ids: tensors (alone, in a tuple, or in a dict) with one row per sample."""
    inputs, targets = batch
    if lm_targets:
        raise InvalidArgumentError(f"{where}: the inputs are {_kind(inputs)}, not token ids, so the next-token loss "
                                   "cannot take them; give a loss_fn(output, targets) of your own (--loss NAME)")
    leaves = tensors(inputs)
    if not leaves or len(leaves) != len(tree_leaves(inputs)):
        raise InvalidArgumentError(f"{where}: inputs are {_kind(inputs)}; give a tensor, a tuple of tensors or a dict "
                                   "of tensors (the model is called as model(x), model(*x) or model(**x))")
    if targets is not None and (not tensors(targets) or len(tensors(targets)) != len(tree_leaves(targets))):
        raise InvalidArgumentError(f"{where}: targets are {_kind(targets)}; give a tensor, a tuple or dict of "
                                   "tensors, or None (a loss that reads the model's output alone)")
    rows = {t.shape[0] if t.dim() else None for t in leaves + tensors(targets)}
    if len(rows) != 1 or None in rows:
        raise InvalidArgumentError(f"{where}: the batch's tensors have {sorted(rows, key=str)} rows; every tensor of "
                                   "the inputs and targets needs one row per sample (the plan splits them by rows)")
    (n,) = rows
    if global_batch is not None and n != global_batch:
        raise InvalidArgumentError(f"{where}: the inputs have {n} rows but the plan's global batch is "
                                   f"{global_batch}; give every step {global_batch} samples, or plan for {n}")
    return inputs, targets


def _kind(tree) -> str:
    if isinstance(tree, Tensor):
        return f"a {tree.dtype} tensor of shape {_dims(tree)}"
    if isinstance(tree, dict):
        return f"a dict of {', '.join(f'{k}: {type(v).__name__}' for k, v in tree.items())}"
    return f"a {type(tree).__name__}"


def check_batch(batch, *, step: int, global_batch: int | None, seq_len: int | None, vocab_size: int | None,
                lm_targets: bool = True) -> tuple:
    """``batch`` as ``(ids, targets)``, or an :class:`InvalidArgumentError` naming the step, what is wrong and what
    to do. ``global_batch``, ``seq_len`` and ``vocab_size``, when not None, are the rows and columns every batch
    must have and the ids' bound. ``lm_targets``: the targets are the next-token loss's (same shape as ``ids``,
    integer ids or -100); False for a ``loss_fn`` of the user's own, whose targets need only one row per sequence.
    """
    where = f"batch of step {step}"
    shape = _shape(global_batch, seq_len)
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        what = f"has {len(batch)} items" if isinstance(batch, (tuple, list)) else f"is a {type(batch).__name__}"
        window = " (a 2-D tensor of token ids alone is taken as ids[:, :-1] → ids[:, 1:] for a language model " \
            "with nbtrain's next-token loss; with your own loss or model, make the pairs yourself)" \
            if isinstance(batch, Tensor) and batch.dim() == 2 else ""
        raise InvalidArgumentError(f"{where} {what}; a batch is a pair (ids, targets) of tensors of shape "
                                   f"{shape}{window}")
    ids, targets = batch
    if not lm_targets and not (is_token_ids(ids) and isinstance(targets, Tensor)) or \
            not isinstance(ids, Tensor) and tensors(ids):
        return _check_structured(batch, where, global_batch, lm_targets)
    for name, value in (("ids", ids), ("targets", targets)):
        if not isinstance(value, Tensor):
            raise InvalidArgumentError(f"{where}: {name} is a {type(value).__name__}, not a torch.Tensor; a batch "
                                       f"is a pair (ids, targets) of tensors of shape {shape}")
    if ids.dtype not in TOKEN_DTYPES:
        raise InvalidArgumentError(f"{where}: ids have dtype {ids.dtype}; token ids must be an integer tensor "
                                   f"(torch.long) of shape {shape}; convert them with ids.long()")
    if ids.dim() != 2 or ids.numel() == 0:
        one_row = "; one sequence is ids.unsqueeze(0)" if ids.dim() == 1 else ""
        raise InvalidArgumentError(f"{where}: ids have shape {_dims(ids)}; token ids are one row per sequence, "
                                   f"of shape {shape}, at least 1 × 1{one_row}")
    rows, columns = ids.shape
    if global_batch is not None and rows != global_batch:
        raise InvalidArgumentError(f"{where}: ids have {rows} rows but the plan's global batch is {global_batch}; "
                                   f"give every step {global_batch} sequences, or plan for a global batch of {rows}")
    if seq_len is not None and columns != seq_len:
        raise InvalidArgumentError(f"{where}: ids have {columns} tokens per row but the plan's sequence length is "
                                   f"{seq_len}; give every step rows of {seq_len} tokens")
    if lm_targets and targets.shape != ids.shape:
        raise InvalidArgumentError(f"{where}: targets have shape {_dims(targets)} but ids {_dims(ids)}; the "
                                   "next-token loss takes one target per token, the ids shifted by one (ids = "
                                   "window[:, :-1], targets = window[:, 1:]), or give a loss_fn that takes yours")
    if not lm_targets and (targets.dim() == 0 or targets.shape[0] != rows):
        got = "a scalar" if targets.dim() == 0 else f"{targets.shape[0]} rows"
        raise InvalidArgumentError(f"{where}: targets have {got} but ids {rows}; give one target row per "
                                   "sequence (the plan splits ids and targets by rows)")
    if lm_targets and targets.dtype not in TOKEN_DTYPES:
        raise InvalidArgumentError(f"{where}: targets have dtype {targets.dtype}; the next-token loss takes token "
                                   "ids (torch.long), -100 where it ignores a position; convert them with "
                                   "targets.long(), or give a loss_fn that takes yours")
    if vocab_size is not None:
        low, high = (int(v) for v in torch.aminmax(ids))
        if low < 0 or high >= vocab_size:
            larger = f", or build it with vocab_size ≥ {high + 1}" if low >= 0 else ""
            raise InvalidArgumentError(f"{where}: ids range from {low} to {high} but the model takes ids 0 to "
                                       f"{vocab_size - 1} (vocab_size={vocab_size}); tokenize for this model{larger}")
        if lm_targets:
            low, high = (int(v) for v in torch.aminmax(targets))
            if low < 0:  # -100 marks a position the loss ignores; any other negative value is a mistake
                negative = targets[targets < 0]
                wrong = negative[negative != IGNORE]
                low = int(wrong.min()) if wrong.numel() else 0
            bad = low if low < 0 else high if high >= vocab_size else None
            if bad is not None:
                raise InvalidArgumentError(f"{where}: targets hold {bad}, which is neither a token id 0 to "
                                           f"{vocab_size - 1} (vocab_size={vocab_size}) nor {IGNORE} (a position "
                                           "the loss ignores); make the targets from the same tokens as the ids")
    return ids, targets
