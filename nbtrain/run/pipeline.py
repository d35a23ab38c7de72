"""Pipeline parallelism with ``torch.distributed.pipelining``: cut the model where the plan says, run a schedule.

    >>> runner = PipelineRunner(model, plan, meshes, loss_fn)    # after parallelize(model, plan, meshes)
    >>> loss = runner.step(local_ids, local_targets)            # mean loss of this data-parallel slice, or None

Stage ``i`` runs on devices ``[i·D, (i+1)·D)`` (pp is the outermost mesh axis); inside a stage the layers keep
their data-parallel and tensor-parallel strategies. The stage module holds the model's own submodules, so the
trained weights are the model's. GPipe runs every micro-batch forward, then every backward; 1F1B (Narayanan et
al. 2021) interleaves them so stage ``i`` holds at most ``pp − i`` micro-batches of activations. Both scale each
micro-batch's gradient by ``1/m``, which makes the gradient of the mean loss, as one process computes it.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from nbtrain.planner.strategy import Plan
from nbtrain.run.mesh import PlanMeshes, device_type
from nbtrain.run.parallelize import layer_modules, slot_module

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class StageModule(nn.Module):
    """Layers ``[start, end)`` of the model as one module: the first stage takes token ids, the last returns
    logits, the others pass the hidden state on."""

    def __init__(self, layers: list[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class PipelineRunner:
    """This process's pipeline stage and the plan's schedule over it."""

    def __init__(self, model: nn.Module, plan: Plan, meshes: PlanMeshes, loss_fn: Callable):
        start, end = plan.stage_ranges()[meshes.stage]
        layers = [slot_module(parent, attr) for (parent, attr), in layer_modules(model)[start:end]]
        self.module = StageModule(layers)
        self.first, self.last = meshes.stage == 0, meshes.stage == plan.pp - 1
        device = torch.device(device_type(), torch.cuda.current_device()) if device_type() == "cuda" else \
            torch.device("cpu")
        self.stage = PipelineStage(self.module, meshes.stage, plan.pp, device, group=meshes.pp_mesh().get_group())
        self.schedule = SCHEDULES[plan.schedule](self.stage, n_microbatches=plan.microbatches, loss_fn=loss_fn)

    def step(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward of this data-parallel slice's rows; the last stage returns their mean loss."""
        losses: list[torch.Tensor] = []
        if self.first and self.last:
            self.schedule.step(ids, target=targets, losses=losses)
        elif self.first:
            self.schedule.step(ids)
        elif self.last:
            self.schedule.step(target=targets, losses=losses)
        else:
            self.schedule.step()
        return torch.stack(losses).mean().detach() if self.last else None
