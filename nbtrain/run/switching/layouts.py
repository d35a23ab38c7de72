"""One layout of hot switching: the model parallelized once under a bucket's strategy, what this rank holds of it,
and a bucket's rows run forward and backward in it.

In every worker of 4 (``HotSwitching`` builds one per layout; the calls it makes)::

    layout = Layout(lambda: GPT(config), parse_bucket_strategy("pp=2 tp=2", num_devices=4), seed=0)
    layout.held                   # per parameter: this rank's (its pipeline stage's layers), or None (another stage's)
    share = layout.run(bucket, tokens=4096, micro_rows=2, last=True, keywords=True)
    layout.finish()               # after the layout's last bucket of the step: a tied weight's copies summed

A layout is ``parallelize`` of a uniform plan: DDP, FSDP2, tensor parallel or their mixes on every process, or a
pipeline of them (``pp > 1``, GPipe or 1F1B): stage ``i`` on ranks ``[i·D, (i+1)·D)`` holds its layers, cut evenly
by layer count, and none of the others' (a tied embedding's copy on the first and the last stage). A pipelined
layout runs its buckets through the static pipeline's runner (:class:`~nbtrain.run.parallel.pipeline.PipelineRunner`,
:meth:`~nbtrain.run.parallel.pipeline.PipelineRunner.run_rows`), each bucket in its own micro-batches, nbtrain
GPT's ``doc_ids`` handed to every stage; its models whose stages are traced graphs cannot (their shapes are fixed
when traced).

What a bucket's rows cost is the same either way: each data-parallel rank takes its rows (the bucket padded with
empty rows, whose targets are all -100, to whole micro-batches on every rank) and backpropagates ``Σ cross-entropy
of its rows × dp / tokens of the step`` (DDP and FSDP2 divide by dp), so the gradients are one process's over the
step. :meth:`Layout.run` returns this rank's share of the summed cross-entropy (each row's sum is held by its tp
ranks, and in a pipeline by the last stage's): summed over every rank, the step's total.

A layout's weights are freed by giving their storage back (``untyped_storage().resize_(0)``, as FSDP2 frees its
gathered weights): its parameters stay the same objects, so its wrappers and the switch plans hold. Other stages'
layers are never allocated in a pipelined layout of a model built on the meta device (as ``fit`` builds each
layout: :mod:`nbtrain.run.state.materialize`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nbtrain.errors import InvalidArgumentError
from nbtrain.models.description import described, layer_slots, slot_module
from nbtrain.planner.switching.bucket_strategy import bucket_plan, pp_of
from nbtrain.profiler.segments import logits_of
from nbtrain.run.parallel.mesh import PlanMeshes, local_shard
from nbtrain.run.parallel.parallelize import parallelize
from nbtrain.run.parallel.pipeline import PipelineRunner
from nbtrain.run.parallel.vocab_parallel import as_local, has_split_logits, loss_context
from nbtrain.run.placement import to_device
from nbtrain.run.trainer import gradient_sync


def padded(rows: torch.Tensor, multiple: int, fill: int) -> torch.Tensor:
    """``rows`` and empty rows of ``fill`` up to a multiple of ``multiple`` rows."""
    extra = -rows.shape[0] % multiple
    if not extra:
        return rows
    return torch.cat([rows, rows.new_full((extra, *rows.shape[1:]), fill)])


def _storages(tensors) -> list:
    found = {}
    for t in tensors:
        storage = local_shard(t.detach()).untyped_storage()
        if not t.is_meta and storage.nbytes():
            found.setdefault(storage.data_ptr(), (storage, storage.nbytes()))
    return list(found.values())


class Layout:
    """The model parallelized under one bucket's strategy (module docstring). ``build()`` makes the model on this
    process (under ``torch.manual_seed(seed)``); ``values``: where a meta model's tensors get their values."""

    def __init__(self, build: Callable[[], nn.Module], strategy, seed: int, values=None):
        torch.manual_seed(seed)
        model = build()
        self.strategy = strategy
        self.pp = pp_of(strategy)
        self.plan = bucket_plan(strategy, dist.get_world_size(), len(layer_slots(model)))
        self.meshes = PlanMeshes(self.plan)
        # the step's cross-entropy is nbtrain's own: on logits split over the vocabulary under TP (vocab_parallel.py)
        self.wrapped = parallelize(model, self.plan, self.meshes, values=values, split_logits=True)
        self.split_logits = has_split_logits(model)
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        """Every trained parameter of the model, in one order for every layout (the switches' tensors)."""
        self.pipeline, self._tokens = None, 1
        mine = {id(p) for p in self.params}
        if self.pp > 1:
            description = described(model)
            if description.stages == "traced":
                raise InvalidArgumentError(f"'{strategy}': {type(model).__name__}'s pipeline stages are traced graphs "
                                           "of fixed shapes, and a bucket's rows change from step to step; use a "
                                           "strategy without pp for its buckets")
            self.pipeline = PipelineRunner(model, self.plan, self.meshes, self._weighted_loss)
            start, end = self.plan.stage_ranges()[self.meshes.stage]
            mine = {id(p) for i in range(start, end) for parent, attr in description.layers[i]
                    for p in slot_module(parent, attr).parameters()}
        self.held = [p if id(p) in mine else None for p in self.params]
        """Per parameter, this rank's (a DTensor's shard or all of it), or None where another stage holds it."""
        self.trained = [p for p in self.held if p is not None]
        elsewhere = {id(p) for p in self.pipeline.counted_elsewhere()} if self.pipeline is not None else set()
        self.gradient_targets = [None if p is not None and id(p) in elsewhere else p for p in self.held]
        """Where gradients switched into this layout are added: a tied weight on its first stage's copy only (the
        two copies' gradients are summed after the step's buckets, :meth:`finish`)."""
        self.dp_rank = self.meshes.dp_rank(0)
        self._storages = _storages(self.trained)
        self.resident = True

    @property
    def pipeline_group(self):
        """The process group along the pipeline (the stages' norms sum over it), or None."""
        return self.meshes.pp_mesh().get_group() if self.pipeline is not None else None

    def shards(self, tensors=None) -> list:
        """This rank's local data of each parameter (or of ``tensors``, aligned with them), None where not held."""
        return [None if p is None else local_shard(p.detach()) for p in (self.held if tensors is None else tensors)]

    def free(self) -> None:
        """Give the weights' storage back (their values are gone: the next switch here writes them again)."""
        for p in self.params:
            p.grad = None
        for storage, _ in self._storages:
            storage.resize_(0)
        self.resident = False

    def restore(self) -> None:
        """Take the weights' storage again, to be written by a switch."""
        for storage, nbytes in self._storages:
            storage.resize_(nbytes)
        self.resident = True

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a bucket (padded by the caller to a multiple of dp)."""
        return t.chunk(self.strategy.dp)[self.dp_rank]

    def finish(self) -> None:
        """After the layout's last bucket of a step: a tied weight's two stage copies sum their gradients (Megatron's
        embedding group, as the static pipeline does after each step), so both hold the step's."""
        if self.pipeline is not None:
            self.pipeline.sync_tied()

    def run(self, bucket, *, tokens: int, micro_rows: int | None, last: bool, keywords: bool,
            offloaded=None) -> torch.Tensor:
        """Forward and backward of this rank's rows of ``bucket`` (``ids``, ``targets``, optionally ``doc_ids``)
        in micro-batches of ``micro_rows`` rows (None: all at once; in a pipeline, about one per stage), the
        gradient sync after the layout's ``last`` bucket (a pipeline syncs after each), an ``offloaded`` home
        optimizer's hand-over only in it; returns this rank's share of the summed cross-entropy (module docstring)."""
        s = self.strategy
        per_rank = -(-bucket.ids.shape[0] // s.dp)
        r = micro_rows or (max(1, -(-per_rank // self.pp)) if self.pipeline is not None else None)
        multiple = s.dp * (r or 1)  # every rank the same rows, in whole micro-batches (empty rows: no target)
        parts = [self.rows(padded(bucket.ids, multiple, 0)), self.rows(padded(bucket.targets, multiple, -100))]
        if keywords and getattr(bucket, "doc_ids", None) is not None:
            parts.append(self.rows(padded(bucket.doc_ids, multiple, -1)))
        parts = to_device(parts, self.meshes.device)  # only this rank's rows travel
        self._tokens = tokens
        if self.pipeline is not None:
            return self._pipelined(parts, r, last, offloaded)
        total = torch.zeros((), dtype=torch.float64, device=self.meshes.device)
        pieces = list(zip(*(t.split(r) if r else (t,) for t in parts)))
        for k, piece in enumerate(pieces):
            with gradient_sync(self.wrapped, last and k == len(pieces) - 1, offloaded):
                total += self._forward_backward(*piece)
        return total

    def _forward_backward(self, ids, targets, doc_ids=None) -> torch.Tensor:
        """Backward of these rows' weighted loss; returns their summed cross-entropy / tp."""
        with loss_context(self.split_logits):
            output = self.wrapped(ids) if doc_ids is None else self.wrapped(ids, doc_ids=doc_ids)
            summed = _summed_cross_entropy(output, targets)
            (summed * self.strategy.dp / self._tokens).backward()
        return as_local(summed.detach()).double() / self.strategy.tp

    def _weighted_loss(self, output, targets) -> torch.Tensor:
        """A pipelined micro-batch's loss as the schedule backpropagates it: its summed cross-entropy × dp / the
        step's tokens (set by :meth:`run` before the schedule runs)."""
        return _summed_cross_entropy(output, targets) * (self.strategy.dp / self._tokens)

    def _pipelined(self, parts, r: int, last: bool, offloaded) -> torch.Tensor:
        ids, targets, *doc_ids = parts
        microbatches = ids.shape[0] // r
        keywords = {"doc_ids": doc_ids[0]} if doc_ids else None
        # the pipeline syncs its gradients at each schedule's end; an offloaded home hands them over only in its
        # last bucket (the runner's backward enters no_sync per micro-batch as well: it nests)
        holding = offloaded.no_sync() if offloaded is not None and not last else nullcontext()
        with holding, loss_context(self.split_logits):
            weighted = self.pipeline.run_rows(ids, targets, microbatches, keywords)
        if weighted is None:  # not the last stage: the loss is the last stage's
            return torch.zeros((), dtype=torch.float64, device=self.meshes.device)
        # back to the summed cross-entropy (÷ tp: each slice's loss is held by its tp ranks)
        return weighted.double() * self._tokens / self.strategy.dp / self.strategy.tp


def _summed_cross_entropy(output, targets) -> torch.Tensor:
    logits = logits_of(output)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), ignore_index=-100,
                           reduction="sum")
