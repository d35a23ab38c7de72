"""The step loop of a parallelized model: data by data-parallel rank, micro-batches, clipping, records.

    >>> trainer = Trainer(model, plan, meshes, torch.optim.AdamW(model.parameters(), lr=3e-4), clip_norm=1.0)
    >>> for ids, targets in batches:             # each a global batch: (global_batch, seq_len)
    ...     record = trainer.step(ids, targets)  # StepRecord: loss (averaged over the whole batch), seconds, ...

A step trains exactly as one process on the whole global batch would: each data-parallel rank takes its rows,
cuts them into the plan's micro-batches, and accumulates ``loss / microbatches`` (the gradient of the mean over
its rows); FSDP2 averages the gradients over the data-parallel ranks, which makes the mean over the global batch.
Where integer targets hold ``-100`` (positions the loss skips: masked-LM labels, padding), micro-batches count
different numbers of targets, and a mean of their means is not the batch's mean: each micro-batch's loss is then
weighted by its share of the batch's counted targets (:meth:`Trainer._share`), as one process averages them.
Gradient clipping uses the norm over every parameter of the model, whatever mesh it is sharded on.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from nbtrain.data import IGNORE
from nbtrain.errors import InvalidArgumentError, NonFiniteLossError
from nbtrain.models.adapters import detect_family, set_training
from nbtrain.planner.plan import Plan
from nbtrain.profiler.model import lm_loss
from nbtrain.run.parallel.vocab_parallel import as_local, has_split_logits, loss_context
from nbtrain.gradients import clip_grad_norm
from nbtrain.profiler.trace import call_model
from nbtrain.gc_pause import collection_paused
from nbtrain.tensor_memory import count_where_needed, counting, state_bytes
from nbtrain.run.batches import batch_shape, chunk_rows, is_token_ids, map_rows
from nbtrain.run.parallel.mesh import PlanMeshes
from nbtrain.run.placement import peak_memory, reset_peak_memory, synchronize, to_device


@dataclass(frozen=True)
class StepRecord:
    """What one training step did, as rank 0 saw it."""

    step: int
    loss: float
    """Mean loss over the whole global batch."""
    seconds: float
    tokens_per_s: float
    """Tokens per second; samples per second for inputs that are not token ids (images, a dict of features)."""
    peak_memory_bytes: int
    """Peak allocated device memory (CUDA), or this process's peak resident memory on the CPU."""
    grad_norm: float | None = None
    """Total gradient norm before clipping, when clipping is on."""
    tensor_bytes: int | None = None
    """What the plan's tensors took on rank 0 at the step's peak: the allocator's peak on a GPU; on the CPU this
    rank's parameters, gradients and optimizer state plus the peak of the activations saved for backward
    (:mod:`nbtrain.tensor_memory`), the quantity the cost model predicts."""
    skipped: bool = False
    """The loss was not finite and the update was skipped (``on_nonfinite="skip"``)."""
    checkpoint_s: float | None = None
    """Seconds a checkpoint saved after this step took (not in ``seconds``), when one was."""
    eval_loss: float | None = None
    """The validation loss after this step, when the run evaluated then (``fit(..., eval_data=)``): the mean over
    every counted target of the held-out batches, the model in eval mode (:meth:`Trainer.evaluate`)."""
    eval_s: float | None = None
    """Seconds that evaluation took (not in ``seconds``)."""


def gradient_sync(model: nn.Module, enabled: bool, offloaded=None):
    """A context in which backward reduces gradients over data-parallel ranks (``enabled``: the step's last
    micro-batch) or accumulates them. DDP accumulates whole gradients (``no_sync()``; it holds them whole anyway).
    FSDP2 syncs every micro-batch, as torchtitan accumulates (issue 45): no layer's whole gradient is held from one
    micro-batch to the next, only its fp32 shard, which is what the planner prices (one layer's whole gradient in
    flight, the sync's time each micro-batch). (FSDP2's ``set_requires_all_reduce(False)``, which would keep an
    HSDP all-reduce to the last micro-batch, fails in torch 2.13 on a group of two parameters: it adds the head's
    partial shard to the norm's.) With an offloaded optimizer FSDP2 syncs at the last micro-batch only (its
    reduce-scatter hands the gradients over), and the optimizer's own ``no_sync()`` holds its hooks back until
    then."""
    if isinstance(model, DistributedDataParallel):
        return nullcontext() if enabled else model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(enabled or offloaded is None)
    if offloaded is not None:
        return nullcontext() if enabled else offloaded.no_sync()
    return nullcontext()


def check_on_nonfinite(value: str) -> str:
    """``value`` if it is what a run does with a NaN or infinite loss: ``"stop"`` or ``"skip"``."""
    if value not in ("stop", "skip"):
        raise InvalidArgumentError(f"on_nonfinite must be 'stop' or 'skip', got {value!r}")
    return value


def counted_targets(targets) -> int | None:
    """How many of ``targets`` a mean loss averages over: the entries that are not ``-100`` (``IGNORE``, which
    ``F.cross_entropy`` and Hugging Face's losses skip: masked-LM labels, padding), for integer targets; None for
    any other targets (a mean over a fixed count per row)."""
    if not isinstance(targets, torch.Tensor) or targets.is_floating_point() or targets.dtype == torch.bool:
        return None
    return int((targets != IGNORE).sum())


def _numel(targets) -> int:
    return targets.numel() if isinstance(targets, torch.Tensor) else -1


def _varying_count(targets) -> int | None:
    """The global batch's counted targets where micro-batches may count differently (some ``-100``), else None:
    every micro-batch's share is then ``1/m``, exactly (:meth:`Trainer._share`)."""
    counted = counted_targets(targets)
    return counted if counted is not None and counted not in (0, _numel(targets)) else None


@contextmanager
def held_out(modules: list[nn.Module], device: torch.device):
    """A pass that leaves training as it was: ``modules`` in eval mode (each module's own ``training`` flag put
    back after, as torch defines it: :func:`~nbtrain.models.adapters.set_training`), no gradients, and the RNG
    forked (the dropout masks of later steps are those of a run without the pass). FSDP2 keeps a root module's
    parameters gathered after a forward, for the backward that follows; none follows here, so every FSDP2 module
    frees them after the pass."""
    flags = {id(m): (m, m.training) for root in modules for m in root.modules()}
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
            for root in modules:
                set_training(root, False)
            yield
        for module, _ in flags.values():
            if isinstance(module, FSDPModule):
                module.reshard()
    finally:
        for module, mode in flags.values():
            module.training = mode


def progress_bar(steps: int, done: int = 0):
    """A text progress bar over ``steps`` training steps (from ``done``), or None under NBTRAIN_NONINTERACTIVE."""
    import os
    import sys

    if os.environ.get("NBTRAIN_NONINTERACTIVE"):
        return None
    # the text bar, not tqdm.auto's widget: this runs in a forked worker, whose printed lines the kernel forwards to
    # the cell, but which must not talk to the notebook over the kernel's own sockets (not fork-safe)
    from tqdm.std import tqdm

    return tqdm(total=steps, initial=done, desc="training", unit="step", file=sys.stdout, mininterval=0.5)


class Trainer:
    """Runs steps of ``model`` (already parallelized under ``plan``) with ``optimizer``."""

    def __init__(self, model: nn.Module, plan: Plan, meshes: PlanMeshes, optimizer: torch.optim.Optimizer, *,
                 loss_fn: Callable = lm_loss, clip_norm: float | None = None,
                 lr_schedule: Callable[[int], float] | None = None, precision: str = "fp32",
                 on_nonfinite: str = "stop", fsdp_casts: bool = False):
        if precision not in ("fp32", "bf16"):
            raise InvalidArgumentError(f"precision must be 'fp32' or 'bf16', got {precision!r}")
        self.on_nonfinite = check_on_nonfinite(on_nonfinite)
        self.model, self.plan, self.meshes, self.optimizer = model, plan, meshes, optimizer
        self.device = meshes.device
        """Where this rank computes: each micro-batch is moved there on the way in (:mod:`nbtrain.run.placement`)."""
        self.loss_fn, self.clip_norm = loss_fn, clip_norm
        # bf16: weights and optimizer state stay fp32 (the master copy). fsdp_casts: FSDP2's MixedPrecisionPolicy
        # wraps every layer (fit_worker.mixed_precision, as torchtitan runs FSDP plans), gathers the weights in bf16,
        # computes in them and reduces gradients in fp32: no autocast. Elsewhere autocast computes in bf16 over the
        # fp32 weights (a bf16 copy of each matmul weight)
        self.autocast = torch.autocast(device_type=self.device.type, dtype=torch.bfloat16,
                                       enabled=precision == "bf16" and not fsdp_casts)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule) if lr_schedule else None
        self.steps_done = 0
        from nbtrain.run.offload.optimizer import OffloadedAdamW

        self.offloaded = isinstance(optimizer, OffloadedAdamW)
        if self.offloaded and on_nonfinite == "skip":
            raise InvalidArgumentError("on_nonfinite='skip' cannot undo the CPU updates an offloaded optimizer starts "
                                       "during backward; use on_nonfinite='stop' with offload, or plan without it")
        if self.offloaded and optimizer.clip_norm != clip_norm:
            raise InvalidArgumentError(f"the offloaded optimizer clips at {optimizer.clip_norm} but the Trainer was "
                                       f"given clip_norm={clip_norm}; build it with OffloadedAdamW(..., "
                                       f"clip_norm={clip_norm})")
        self.pipeline = None
        if plan.pp > 1:
            from nbtrain.run.parallel.pipeline import PipelineRunner

            self.pipeline = PipelineRunner(model, plan, meshes, self._pipeline_loss)
            if self.offloaded:
                self.pipeline.hand_over_to(optimizer, meshes.pp_mesh().get_group())
        # what every training forward passes (use_cache=False: a Hugging Face model builds no KV cache in training)
        self.forward_kwargs = detect_family(getattr(model, "module", model)).forward_kwargs
        self.split_logits = has_split_logits(model)  # the loss runs on logits split over the vocabulary
        self._counted: int | None = None  # targets that count in this step's global batch (see counted_targets)

    @property
    def schedule_epoch(self) -> int:
        """Steps the learning-rate schedule has taken (a skipped step takes none)."""
        return self.scheduler.last_epoch if self.scheduler is not None else self.steps_done

    def restore_progress(self, steps_done: int, schedule_epoch: int) -> None:
        """Go on from a checkpoint: number the next step ``steps_done + 1`` and put the learning-rate schedule at
        ``schedule_epoch`` (``LambdaLR`` computes its factor from the epoch alone)."""
        self.steps_done = steps_done
        if self.scheduler is not None and schedule_epoch:
            import warnings

            self.scheduler.last_epoch = schedule_epoch - 1
            with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": on purpose here
                warnings.simplefilter("ignore", UserWarning)
                self.scheduler.step()

    def _local_rows(self, t: torch.Tensor, layer: int) -> torch.Tensor:
        """This process's rows of a global batch, as ``layer``'s layout gives them out.

        The batch is cut into the plan's micro-batches first, then each micro-batch into data-parallel slices, and
        this process's slices are stacked (so ``chunk(microbatches)`` gives them back): a re-layout between layers
        regathers one micro-batch in global row order, and the targets, taken in the last layer's layout, line up.
        """
        m, s = self.plan.microbatches, self.plan.layers[layer]
        if t.shape[0] % (s.dp * m):
            raise InvalidArgumentError(
                f"a batch of {t.shape[0]} rows does not split into microbatches × dp = {m} × {s.dp} = {s.dp * m} "
                f"equal parts; give batches of {self.plan.global_batch} rows (the plan's global batch)")
        rank = self.meshes.dp_rank(layer)
        return torch.cat([micro.chunk(s.dp)[rank] for micro in t.chunk(m)])

    def _local_batch(self, tree, layer: int):
        """:meth:`_local_rows` of every tensor of a batch's inputs or targets (a tensor, tuple or dict)."""
        return map_rows(lambda t: self._local_rows(t, layer), tree)

    def step(self, ids, targets) -> StepRecord:
        """One optimizer step over a global batch ``(inputs, targets)``; every rank passes the same global batch.
        Inputs are token ids, or any tensor, tuple or dict of tensors (:mod:`nbtrain.run.batches`); targets any
        of those, or None. Python's garbage collector waits until the step is over (:mod:`nbtrain.gc_pause`)."""
        with collection_paused():
            return self._step(ids, targets)

    def _step(self, ids, targets) -> StepRecord:
        started = time.perf_counter()
        reset_peak_memory(self.device)
        tokens = ids.numel() if is_token_ids(ids) else batch_shape(ids)[0]  # tokens, or samples
        self._counted = _varying_count(targets)
        ids, targets = self._rows_here(ids, targets)
        # on a GPU the allocator's peak counts the tensors; the CPU has no allocator to ask
        saved = count_where_needed(self.device, exclude=self.model.parameters())
        with counting(saved):
            total = self._forward_backward(ids, targets)
        pp_group = self.meshes.pp_mesh().get_group() if self.pipeline is not None else None
        dist.all_reduce(total)  # every rank of a data-parallel slice holds that slice's loss: average them all
        loss = float(total) / self._per_stage
        if not math.isfinite(loss):  # the same value on every rank: all stop (or skip) before the update
            # (an offloaded optimizer's CPU updates may have started during backward; the run stops all the same)
            if self.on_nonfinite == "stop":
                raise NonFiniteLossError(self.steps_done + 1, loss)
            self.optimizer.zero_grad(set_to_none=True)
            self.steps_done += 1
            seconds = time.perf_counter() - started
            return StepRecord(self.steps_done, loss, seconds, tokens / seconds, peak_memory(self.device), None,
                              skipped=True)
        if self.offloaded:  # it clips itself, exactly: its CPU updates started during backward (run/offload/optimizer.py)
            self.optimizer.step()
            norm = self.optimizer.last_grad_norm if self.clip_norm else None
        else:
            shared = self.pipeline.counted_elsewhere() if self.pipeline is not None else ()
            norm = clip_grad_norm(list(self.model.parameters()), self.clip_norm, pp_group, shared) \
                if self.clip_norm else None
            self.optimizer.step()
        tensors = torch.cuda.max_memory_allocated(self.device) if saved is None else \
            state_bytes(self.model, self.optimizer) + saved.peak
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        synchronize(self.device)  # the step's end is its last kernel's, not the host's
        seconds = time.perf_counter() - started
        self.steps_done += 1
        return StepRecord(self.steps_done, loss, seconds, tokens / seconds, peak_memory(self.device), norm,
                          tensor_bytes=tensors)

    @property
    def _per_stage(self) -> int:
        """The ranks whose summed losses make ``per_stage`` × the batch's (each slice's held by its TP ranks)."""
        return self.plan.devices_per_stage if self.pipeline is not None else dist.get_world_size()

    def _rows_here(self, ids, targets) -> tuple:
        """This rank's rows of a global batch, on its device: the inputs as its stage's first layer gives them out,
        the targets as the model's last layer does."""
        first = self.plan.stage_ranges()[self.meshes.stage][0]
        ids, targets = self._local_batch(ids, first), self._local_batch(targets, self.plan.num_layers - 1)
        return to_device((ids, targets), self.device)  # only this rank's rows travel

    def evaluate(self, batches: list, weights: list[int]) -> float:
        """The validation loss of ``batches`` (global batches, as :meth:`step` takes them) under the plan: the mean
        of their losses weighted by ``weights`` (what each averages over: its counted targets, or its rows), each
        batch's loss computed as :meth:`step` computes a training loss, forward only (a pipeline runs its schedule's
        ``eval()``). Every rank gets it. Training afterwards goes on as if this had not run: eval mode (dropout off,
        BatchNorm's running statistics left alone) and no gradients inside :func:`held_out`, the RNG forked around
        it, the optimizer, its schedule and the step count untouched."""
        if self.offloaded:  # the last step's CPU updates land before a forward reads the weights (offload/landing.py)
            self.optimizer.synchronize()
        modules = [self.model] + ([self.pipeline.module] if self.pipeline is not None else [])
        kept, totals = self._counted, []
        try:
            with held_out(modules, self.device):
                for ids, targets in batches:
                    self._counted = _varying_count(targets)  # the micro-batches' shares, as in a step
                    totals.append(self._forward_only(*self._rows_here(ids, targets)))
        finally:
            self._counted = kept
        total = torch.stack(totals)
        dist.all_reduce(total)  # one collective for the whole set; every rank gets every batch's loss
        losses = (total / self._per_stage).tolist()
        return sum(w * loss for w, loss in zip(weights, losses)) / sum(weights)

    def _forward_only(self, ids, targets) -> torch.Tensor:
        """The loss this rank holds of one global batch, forward only (zero where it holds none)."""
        if self.pipeline is not None:
            with self.autocast, loss_context(self.split_logits):
                loss = self.pipeline.evaluate(ids, targets)
            return loss if loss is not None else torch.zeros((), device=self.device)
        m, total = self.plan.microbatches, torch.zeros((), device=self.device)
        for x, y in zip(chunk_rows(ids, m), chunk_rows(targets, m)):
            with self.autocast, loss_context(self.split_logits):
                total += as_local(self.loss_fn(call_model(self.model, x, self.forward_kwargs), y) * self._share(y))
        return total

    def _forward_backward(self, ids, targets) -> torch.Tensor:
        """Forward and backward of this rank's share of the batch: the loss it holds (zero where it holds none)."""
        if self.pipeline is not None:
            with self.autocast, loss_context(self.split_logits):
                loss = self.pipeline.step(ids, targets)
            # the last stage's ranks hold their slice's loss; the others add nothing, and each slice's loss is
            # held by its D / dp tensor-parallel ranks: the sum over the world / D is the mean over the slices
            return loss if loss is not None else torch.zeros((), device=self.device)
        return self._accumulate(ids, targets)

    def _gradient_sync(self, enabled: bool):
        return gradient_sync(self.model, enabled, self.optimizer if self.offloaded else None)

    def _share(self, targets) -> float:
        """The weight of a micro-batch's mean loss in the step's: ``1 / m`` when every micro-batch counts as many
        targets, and ``n · dp / N`` when they differ (``n`` of its targets count, ``N`` of the global batch's, ``dp``
        slices): one process averages over the ``N`` targets of the whole batch, not over micro-batch means."""
        if not self._counted:
            return 1.0 / self.plan.microbatches
        return counted_targets(targets) * self.plan.layers[-1].dp / self._counted

    def _pipeline_loss(self, output, targets):
        return self.loss_fn(output, targets) * self._share(targets)  # the schedule sums the micro-batches

    def _accumulate(self, ids, targets) -> torch.Tensor:
        """Forward and backward of each micro-batch, gradients accumulated; returns the mean loss of the rows."""
        m = self.plan.microbatches
        total = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(zip(chunk_rows(ids, m), chunk_rows(targets, m))):
            with self._gradient_sync(i == m - 1), self.autocast, loss_context(self.split_logits):
                loss = self.loss_fn(call_model(self.model, x, self.forward_kwargs), y) * self._share(y)
                loss.backward()
            total += as_local(loss.detach())
        return total
