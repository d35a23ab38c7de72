"""Pipeline parallelism with ``torch.distributed.pipelining``: cut the model where the plan says, run a schedule.

    >>> runner = PipelineRunner(model, plan, meshes, loss_fn)    # after parallelize(model, plan, meshes)
    >>> loss = runner.step(local_ids, local_targets)            # loss of this data-parallel slice, or None
    >>> loss = runner.evaluate(local_ids, local_targets)        # the same, forward only (the validation loss)

Stage ``i`` runs on devices ``[i·D, (i+1)·D)`` (pp is the outermost mesh axis); inside a stage the layers keep
their data-parallel and tensor-parallel strategies. The stage module holds the model's own submodules, so the
trained weights are the model's; a model whose stages are traced (:mod:`nbtrain.run.parallel.traced_stages`: BERT, ViT, T5,
a user's CNN) runs its traced graph through ``build_stage``, its first stage takes the batch's inputs as the model
does (a dict as keywords), and the loss gets the model's output structure back. GPipe runs every micro-batch forward, then every backward; 1F1B (Narayanan et
al. 2021) interleaves them so stage ``i`` holds at most ``pp − i`` micro-batches of activations. The loss function
weighs each micro-batch's loss by its share of the step's (``1/m`` when they count alike), so the accumulated
gradients are those of the mean loss, as one process computes them, as soon as the last backward has run (the
schedules' own division of the gradients by ``m`` after backward is off: a CPU update offload hands each gradient
over as the last backward produces it, :meth:`PipelineRunner.hand_over_to`).

A head tied to the token embedding in another stage (GPT-2's ``lm_head`` and ``wte``) is handled as Megatron-LM
does it (Shoeybi et al. 2019; Narayanan et al. 2021, §2.2, "the embedding group"): the first and the last stage
each hold the shared weight, identical at start; after backward, each rank of the first stage and the rank of the
last stage at the same data/tensor-parallel coordinate sum their gradients of it, so both apply the same update.
The gradient norm counts it once (the last stage leaves it out), and checkpoints hold it once, under the
embedding's name (``training_state.trained_tensors``).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, build_stage
from torch.distributed.tensor import DTensor

from nbtrain.models.description import described
from nbtrain.models.stages import stage_layers
from nbtrain.planner.plan import Plan
from nbtrain.profiler.trace import call_arguments
from nbtrain.run.batches import chunk_rows
from nbtrain.run.parallel.vocab_parallel import as_local
from nbtrain.run.parallel.mesh import PlanMeshes, local_shard
from nbtrain.run.parallel.parallelize import add_fsdp_root

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
KEPT_SCHEDULES = 8
"""Stages and schedules :meth:`PipelineRunner.run_rows` keeps, the most recently used (each holds its buffers)."""


class StageModule(nn.Module):
    """Layers ``[start, end)`` of the model as one module: the first stage takes token ids, the last returns
    logits, the others pass the hidden state on. Keywords given to every stage (hot switching's ``doc_ids`` for
    nbtrain's GPT, whose blocks keep attention inside each packed document) reach the layers whose forward names
    them; without them each layer gets the hidden state alone, as the static pipeline runs it."""

    def __init__(self, layers: list[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.keywords = [_keywords(layer) for layer in layers]

    def forward(self, x: torch.Tensor, **keywords) -> torch.Tensor:
        for layer, names in zip(self.layers, self.keywords):
            x = layer(x, **{k: v for k, v in keywords.items() if k in names})
        return x


def _keywords(layer: nn.Module) -> frozenset[str]:
    """The keyword arguments a layer's own forward takes besides its input (through a checkpoint wrapper)."""
    import inspect

    inner = getattr(layer, "_checkpoint_wrapped_module", layer)
    return frozenset(list(inspect.signature(inner.forward).parameters)[1:])


class PipelineRunner:
    """This process's pipeline stage and the plan's schedule over it."""

    def __init__(self, model: nn.Module, plan: Plan, meshes: PlanMeshes, loss_fn: Callable):
        start, end = plan.stage_ranges()[meshes.stage]
        description = described(model)
        device = meshes.device  # the stage's send and receive buffers are allocated there
        group = meshes.pp_mesh().get_group()
        self.traced = model.__dict__.get("_nbtrain_traced")  # parallelize traced and sharded it (traced_stages.py)
        if self.traced is not None:
            self.module = self.traced.module
            self.stage = build_stage(self.module, meshes.stage, self.traced.info, device, group)
            structured = self.traced.structured
            loss = lambda output, targets: loss_fn(structured(output), targets)  # noqa: E731
        else:
            self.module = StageModule(stage_layers(description, start, end))
            add_fsdp_root(self.module, description.layers, plan, meshes)
            self.stage = PipelineStage(self.module, meshes.stage, plan.pp, device, group=group)
            loss = loss_fn
        self.first, self.last = meshes.stage == 0, meshes.stage == plan.pp - 1
        self.microbatches = plan.microbatches
        self.schedule = SCHEDULES[plan.schedule](self.stage, n_microbatches=plan.microbatches, loss_fn=loss,
                                                 scale_grads=False)  # loss_fn weighs each micro-batch itself
        # hot switching's buckets: a stage and schedule per micro-batch count and shape (run_rows)
        self._where = (meshes.stage, plan.pp, device, group, plan.schedule, loss)
        self._buckets: dict = {}
        self._aside: dict = {}
        self._handed_to = None
        # a head tied to the embedding in another stage: the slots holding this stage's copy of the shared weight
        self.tied: list[tuple[nn.Module, str]] = []
        self.embedding_group = None
        pairs = description.ties  # parallelize re-tied both names to this stage's parameter
        if pairs:
            self.embedding_group = _embedding_group(plan, meshes)
            self.tied = [first for first, _ in pairs] if self.first else [last for _, last in pairs] \
                if self.last else []

    def tied_parameters(self) -> list[torch.Tensor]:
        """This stage's copies of weights shared with another stage (the embedding's, on the first and last)."""
        return [getattr(module, name) for module, name in self.tied]

    def counted_elsewhere(self) -> list[torch.Tensor]:
        """Parameters whose gradient another stage holds too, left out of this stage's part of the norm: the last
        stage's copy of the tied embedding (the first stage counts it)."""
        return self.tied_parameters() if self.last and not self.first else []

    def sync_tied(self) -> None:
        """Sum the first and the last stage's gradients of their shared weight (the embedding group), so that both
        copies take the same update; a no-op elsewhere."""
        if not self.tied:
            return
        for param in self.tied_parameters():
            if param.grad is None:  # (not seen: both stages use the weight) the peer waits for a tensor all the same
                param.grad = torch.zeros_like(param)
            grad = param.grad
            if isinstance(grad, DTensor) and grad.placements != param.placements:
                # a vocabulary-parallel embedding's gradient may come partial or replicated over tp: lay it out as the
                # weight, so that both stages' local shards are the same slice
                grad = param.grad = grad.redistribute(param.device_mesh, param.placements)
            with torch.no_grad():
                dist.all_reduce(local_shard(grad), group=self.embedding_group)

    def hand_over_to(self, optimizer, pipeline_group) -> None:
        """Let an offloaded optimizer (:class:`~nbtrain.run.offload.optimizer.OffloadedAdamW`) start each layer's
        CPU update during this stage's last micro-batch backward, as it does without a pipeline.

        The schedules run a stage's backward once per micro-batch through ``backward_maybe_with_nosync``; this
        stage's is wrapped so that every backward but the last runs under the optimizer's ``no_sync()`` (its hooks
        hand nothing over while gradients accumulate), and, under FSDP2, the last one reduce-scatters as it goes
        (torch's pipelining defers every reduction to after the last backward, which would leave the CPU nothing
        to overlap). The schedule's own reduction afterwards then finds nothing left to reduce (FSDP2's
        ``post_backward`` is a no-op for groups already reduced). The clipping norm sums over the stages, counting
        a tied embedding once; its copies' gradients are handed over in ``step()``, after :meth:`sync_tied`."""
        _hand_over(self.stage, optimizer)
        for stage, _ in self._buckets.values():
            _hand_over(stage, optimizer)
        self._handed_to = optimizer  # and the stages run_rows builds later
        optimizer.join_pipeline(pipeline_group, counted_elsewhere=self.counted_elsewhere(),
                                at_step=self.tied_parameters())

    def run_rows(self, ids, targets, microbatches: int, keywords: dict | None = None) -> torch.Tensor | None:
        """Forward and backward of this data-parallel slice's rows in ``microbatches`` micro-batches, for hot
        switching (:mod:`nbtrain.run.switching.layouts`): one layout's pipeline runs buckets of several row lengths,
        each in its own count. ``keywords``: tensors of the same rows every stage's layers take beside the hidden
        state (``doc_ids``), cut into the same micro-batches. The last stage returns the sum of the micro-batches'
        losses as ``loss_fn`` weighed them, as :meth:`step` does.

        torch's schedules size their send and receive buffers once, from their first step, so each (count, row
        shape) runs a stage and schedule of its own over this stage's module, built on first use (a few are kept).
        Their first step infers the shapes with a real forward and backward and then clears the gradients of the
        stage's FSDP2 modules; gradients already there (switched home, or an earlier bucket's) are set aside for it
        and put back. Gradients accumulate across calls; the tied weight's copies are not summed here: call
        :meth:`sync_tied` once, after the layout's last bucket."""
        keywords = keywords or {}
        key = (microbatches, tuple(ids.shape), tuple((k, tuple(v.shape)) for k, v in sorted(keywords.items())))
        if key not in self._buckets:
            self._buckets[key] = self._bucket_schedule(microbatches)
            self._aside = {p: p.grad for p in self.module.parameters() if p.grad is not None}
            for p in self._aside:
                p.grad = None
            while len(self._buckets) > KEPT_SCHEDULES:
                self._buckets.pop(next(iter(self._buckets)))
        _, schedule = self._buckets.pop(key)
        self._buckets[key] = (_, schedule)  # the most recent last
        losses: list[torch.Tensor] = []
        if self.first and self.last:
            schedule.step(ids, target=targets, losses=losses, **keywords)
        elif self.first:
            schedule.step(ids, **keywords)
        elif self.last:
            schedule.step(target=targets, losses=losses, **keywords)
        else:
            schedule.step(**keywords)
        return torch.stack([as_local(loss) for loss in losses]).sum().detach() if self.last else None

    def _bucket_schedule(self, microbatches: int):
        index, pp, device, group, kind, loss = self._where
        stage = PipelineStage(self.module, index, pp, device, group=group)
        cleanup = stage._post_metadata_inference_cleanup

        def keep_gradients():  # after torch's clean-up of the shape inference, what accumulated before it
            cleanup()
            for p, grad in self._aside.items():
                p.grad = grad
            self._aside = {}

        stage._post_metadata_inference_cleanup = keep_gradients
        if self._handed_to is not None:
            _hand_over(stage, self._handed_to)
        kind = kind if microbatches >= pp else "gpipe"  # 1F1B with fewer micro-batches than stages: GPipe's order
        return stage, SCHEDULES[kind](stage, n_microbatches=microbatches, loss_fn=loss, scale_grads=False)

    def step(self, ids, targets) -> torch.Tensor | None:
        """Forward and backward of this data-parallel slice's rows (token ids, or any tensor, tuple or dict of
        them: the first stage's inputs); the last stage returns their loss (the sum of the micro-batches' weighted
        losses: their mean when they count alike)."""
        loss = self._run(self.schedule.step, ids, targets)
        self.sync_tied()
        return loss.detach() if loss is not None else None

    def evaluate(self, ids, targets) -> torch.Tensor | None:
        """Forward only (the schedule's ``eval()``: no backward, no gradient reduction) of the rows :meth:`step`
        takes, cut into the same micro-batches; the last stage returns their loss as :meth:`step` does. The
        schedule sets its stage up again at each switch between eval and training (its receive buffers need
        gradients in training only): a cost only the steps that evaluate pay."""
        return self._run(self.schedule.eval, ids, targets)

    def _run(self, schedule, ids, targets) -> torch.Tensor | None:
        losses: list[torch.Tensor] = []
        args, kwargs = call_arguments(ids) if self.first else ((), {})
        if self.first and self.traced is not None:
            self.traced.check_shapes(chunk_rows(ids, self.microbatches)[0])
        if self.first and self.last:
            schedule(*args, target=targets, losses=losses, **kwargs)
        elif self.first:
            schedule(*args, **kwargs)
        elif self.last:
            schedule(target=targets, losses=losses)
        else:
            schedule()
        return torch.stack([as_local(loss) for loss in losses]).sum() if self.last else None


def _hand_over(stage: PipelineStage, optimizer) -> None:
    """Wrap ``stage``'s backward for an offloaded optimizer (:meth:`PipelineRunner.hand_over_to`)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.pipelining.stage import stage_backward

    inner = stage.backward_maybe_with_nosync

    def backward(backward_type, bwd_kwargs: dict, last_backward: bool = False):
        if not last_backward:
            with optimizer.no_sync():
                return inner(backward_type, bwd_kwargs, last_backward)
        if backward_type != "full" or not isinstance(stage.submod, FSDPModule):
            return inner(backward_type, bwd_kwargs, last_backward)
        stage.submod.set_is_last_backward(True)
        stage.submod.set_reshard_after_backward(True)
        stage.submod.set_requires_gradient_sync(True)
        return stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"],
                              bwd_kwargs["input_values"]), None

    stage.backward_maybe_with_nosync = backward


def _embedding_group(plan: Plan, meshes: PlanMeshes):
    """The process group of this rank and its peer at the same in-stage position in the other end stage (the first
    and the last stage); every rank creates every such group, in the same order (``new_group`` is collective)."""
    if plan.pp == 2:
        return meshes.pp_mesh().get_group()
    per, last = plan.devices_per_stage, plan.pp - 1
    groups = [dist.new_group([j, last * per + j]) for j in range(per)]
    return groups[meshes.rank % per]
