"""Pipeline parallelism with ``torch.distributed.pipelining``: cut the model where the plan says, run a schedule.

    >>> runner = PipelineRunner(model, plan, meshes, loss_fn)    # after parallelize(model, plan, meshes)
    >>> loss = runner.step(local_ids, local_targets)            # mean loss of this data-parallel slice, or None

Stage ``i`` runs on devices ``[i·D, (i+1)·D)`` (pp is the outermost mesh axis); inside a stage the layers keep
their data-parallel and tensor-parallel strategies. The stage module holds the model's own submodules, so the
trained weights are the model's. GPipe runs every micro-batch forward, then every backward; 1F1B (Narayanan et
al. 2021) interleaves them so stage ``i`` holds at most ``pp − i`` micro-batches of activations. Both scale each
micro-batch's gradient by ``1/m``, which makes the gradient of the mean loss, as one process computes it.

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
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor

from nbtrain.models.adapters import detect_family
from nbtrain.planner.strategy import Plan
from nbtrain.run.mesh import PlanMeshes, device_type, local_shard
from nbtrain.run.parallelize import _tied, add_fsdp_root, layer_modules, slot_module, tied_slots

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


class GPT2Embeddings(nn.Module):
    """A Hugging Face GPT-2's first layer as a pipeline stage runs it: token and position embeddings, summed, then
    the embedding dropout (``GPT2Model.forward``'s first lines, for ids without padding or a cache)."""

    def __init__(self, wte: nn.Module, wpe: nn.Module, drop: nn.Module):
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        return self.drop(self.wte(ids) + self.wpe(positions))


class CausalBlock(nn.Module):
    """A Hugging Face GPT-2 block on the hidden state alone: causal attention without a mask (SDPA's ``is_causal``,
    as the model's forward leaves it when no padding mask is given), or an additive causal mask for eager attention."""

    def __init__(self, block: nn.Module, config):
        super().__init__()
        self.block, self.config = block, config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = None
        if getattr(self.config, "_attn_implementation", None) == "eager":
            mask = torch.full((x.shape[1], x.shape[1]), float("-inf"), dtype=x.dtype, device=x.device).triu(1)
            mask = mask[None, None]
        return self.block(x, attention_mask=mask)


def stage_layers(model: nn.Module, start: int, end: int) -> list[nn.Module]:
    """Layers ``[start, end)`` of ``model`` (already parallelized) as modules that each take one tensor."""
    slots = layer_modules(model)[start:end]
    family = detect_family(model).name
    last = len(layer_modules(model)) - 1
    if family == "hf-gpt2":
        layers = []
        for i, group in enumerate(slots, start):
            modules = [slot_module(parent, attr) for parent, attr in group]
            if i == 0:
                layers.append(GPT2Embeddings(*modules, model.transformer.drop))  # wte, wpe
            elif i == last:
                layers.append(nn.Sequential(*modules))  # final norm, then the LM head
            else:
                layers.append(CausalBlock(modules[0], model.config))
        return layers
    if family != "hf-llama":
        return [slot_module(parent, attr) for (parent, attr), in slots]
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
        # a head tied to the embedding in another stage: the slots holding this stage's copy of the shared weight
        layers = layer_modules(model)
        self.tied: list[tuple[nn.Module, str]] = []
        self.embedding_group = None
        if _tied(layers):
            self.embedding_group = _embedding_group(plan, meshes)
            pairs = tied_slots(layers)  # parallelize re-tied both names to this stage's parameter
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
        self.sync_tied()
        return torch.stack(losses).mean().detach() if self.last else None


def _embedding_group(plan: Plan, meshes: PlanMeshes):
    """The process group of this rank and its peer at the same in-stage position in the other end stage (the first
    and the last stage); every rank creates every such group, in the same order (``new_group`` is collective)."""
    if plan.pp == 2:
        return meshes.pp_mesh().get_group()
    per, last = plan.devices_per_stage, plan.pp - 1
    groups = [dist.new_group([j, last * per + j]) for j in range(per)]
    return groups[meshes.rank % per]
