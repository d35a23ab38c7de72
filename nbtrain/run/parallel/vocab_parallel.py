"""The vocabulary-parallel loss: under tensor parallelism a language model's head keeps its logits split over the
vocabulary, and the cross-entropy is taken on the split logits (Megatron-LM's parallel cross-entropy, Shoeybi et
al. 2019 §3; torch's ``loss_parallel``, torchtitan's default), instead of gathering whole logits on every rank.

    >>> model = parallelize(model, plan, meshes, split_logits=takes_vocab_parallel_loss(plan, lm_loss))  # tp=2
    >>> with loss_context(has_split_logits(model)):    # the loss and its backward on the split logits
    ...     loss = lm_loss(model(ids), targets)
    ...     loss.backward()
    >>> as_local(loss.detach()).shape                  # a plain tensor again (the loss is replicated)
    torch.Size([])

Why: a head's logits are the largest activation of a language model. Llama 3 70B at 16 × 8,192 tokens a rank
(torchtitan's FSDP 32 × TP 8 run) has 16.8 G logits: 34 GB in bf16 gathered whole on each of the 8 TP ranks, and
the fp32 loss holds two more copies of that in its backward; split, each rank holds 1/8 of it. The only
communication left is three all-reduces of one number per token (the maximum, the sum of exponentials and the
target's logit), against an all-gather of the logits forward.

It is used where nbtrain knows the loss: its own next-token loss (:func:`~nbtrain.profiler.model.lm_loss`, the
default) and the summed cross-entropy of hot switching. A user's ``loss_fn`` gets whole logits, as before: torch's
split cross-entropy supports ``F.cross_entropy`` without label smoothing, and an arbitrary loss may do anything
with the logits. The profile says which the plan will get (``arch["vocab_parallel_loss"]``), so the cost model
counts the head's logits split or whole as the executor will hold them.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel

from nbtrain.planner.plan import Plan
from nbtrain.profiler.model import lm_loss


SPLIT_LOGITS = "_nbtrain_split_logits"
"""The mark :func:`~nbtrain.run.parallel.parallelize.parallelize` leaves on a model whose head it split so."""


def has_split_logits(model: torch.nn.Module) -> bool:
    """Whether ``model`` (or the DDP wrapper of one) hands on logits split over the vocabulary."""
    return bool(getattr(model, "module", model).__dict__.get(SPLIT_LOGITS))


def takes_vocab_parallel_loss(plan: Plan, loss_fn: Callable | None) -> bool:
    """Whether a run of ``plan`` with ``loss_fn`` keeps the head's logits split: its head is tensor-parallel and the
    loss is nbtrain's own (None: the default, :func:`~nbtrain.profiler.model.lm_loss`)."""
    return plan.layers[-1].tp > 1 and (loss_fn is None or loss_fn is lm_loss)


def vocab_parallel_style() -> ColwiseParallel:
    """The head's style: its output features (the vocabulary) split, the logits handed on as a DTensor split along
    the last dimension, for :func:`loss_context`'s cross-entropy."""
    return ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)


def loss_context(split: bool):
    """Where the loss and its backward run: torch's ``loss_parallel()`` when the logits are split, else nothing."""
    return loss_parallel() if split else nullcontext()


def as_local(loss: torch.Tensor) -> torch.Tensor:
    """The loss as a plain tensor on this rank (the split cross-entropy returns it replicated over the TP ranks)."""
    return loss.full_tensor() if isinstance(loss, DTensor) else loss
