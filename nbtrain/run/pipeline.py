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

from nbtrain.models.adapters import detect_family
from nbtrain.planner.strategy import Plan
from nbtrain.run.mesh import PlanMeshes, device_type
from nbtrain.run.parallelize import add_fsdp_root, layer_modules, slot_module

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


class RotaryBlock(nn.Module):
    """A Hugging Face Llama decoder layer as a pipeline stage runs it: on the hidden state alone. The model's
    forward computes the RoPE tables once and hands them to every layer; a stage computes them for its layers
    (the same tables: they depend only on the positions) and relies on causal attention without a mask, as the
    model does when no padding mask is given."""

    def __init__(self, block: nn.Module, rotary: nn.Module):
        super().__init__()
        self.block, self.rotary = block, rotary

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        mask = None
        if getattr(self.rotary, "config", None) is not None and self.rotary.config._attn_implementation == "eager":
            mask = torch.full((x.shape[1], x.shape[1]), float("-inf"), dtype=x.dtype, device=x.device).triu(1)
            mask = mask[None, None]  # eager attention adds the mask; without one it would not be causal
        return self.block(x, attention_mask=mask, position_embeddings=self.rotary(x, positions),
                          position_ids=positions)


def stage_layers(model: nn.Module, start: int, end: int) -> list[nn.Module]:
    """Layers ``[start, end)`` of ``model`` (already parallelized) as modules that each take one tensor."""
    slots = layer_modules(model)[start:end]
    if detect_family(model).name != "hf-llama":
        return [slot_module(parent, attr) for (parent, attr), in slots]
    last = len(layer_modules(model)) - 1
    layers = []
    for i, group in enumerate(slots, start):
        modules = [slot_module(parent, attr) for parent, attr in group]
        if i == 0:
            layers.append(modules[0])  # embed_tokens
        elif i == last:
            layers.append(nn.Sequential(*modules))  # final norm, then the LM head
        else:
            layers.append(RotaryBlock(modules[0], model.model.rotary_emb))
    return layers


class PipelineRunner:
    """This process's pipeline stage and the plan's schedule over it."""

    def __init__(self, model: nn.Module, plan: Plan, meshes: PlanMeshes, loss_fn: Callable):
        start, end = plan.stage_ranges()[meshes.stage]
        self.module = StageModule(stage_layers(model, start, end))
        add_fsdp_root(self.module, model, plan, meshes)
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
