"""Expert parallelism: each rank of an ``ep`` group holds ``E/ep`` of a mixture-of-experts layer's experts, and every
token goes to its experts' ranks and comes back (torchtitan's and Megatron's ``ep``).

    >>> spread_experts(model.model.layers[0].mlp.experts, meshes.for_experts(s))   # inside a launched worker
    >>> model.model.layers[0].mlp.experts.num_experts, model.model.layers[0].mlp.experts.down_proj.to_local().shape[0]
    (2, 2)

The executor spreads a plan's expert layers so (:mod:`nbtrain.run.parallel.parallelize`), and the communication
benchmark times the same dispatch (:mod:`nbtrain.profiler.link_bench`): torch only, no other nbtrain module, so
both layers use it.

What is spread is an experts module as transformers writes them (Mixtral, Qwen3-MoE, OLMoE, DeepSeek-V3): one module
holding every expert's weights in 3-D tensors (expert first), called as ``experts(hidden, top_k_index,
top_k_weights)`` with the router's choices, and reading its expert count from ``num_experts``. Its weights become
DTensors ``Shard(0)`` over the ``ep`` axis (this rank's experts, the rest on the other ranks: a whole state dict
gathers them), ``num_experts`` the local count, and its call runs:

1. the token–expert pairs sorted by expert, so that each destination rank's pairs are contiguous;
2. the counts per expert exchanged (an all-to-all of ``E`` integers), so that each rank knows what it receives;
3. the pairs' hidden states sent to their experts' ranks (all-to-all, autograd: its backward is the reverse one);
4. the module's own forward on what arrived, with the local expert ids and unit weights;
5. the outputs sent back (all-to-all) and summed per token with the router's weights, in expert order as the
   module itself sums them.

The all-to-alls are ``torch.distributed``'s ``all_to_all_single``: NCCL's on GPUs, and gloo's on the CPU, which has
it for CPU tensors (torch's functional collectives, with autograd). A model whose experts are a ``ModuleList``
called one by one from its own loop cannot be spread this way (its loop decides, per rank, which experts it calls):
:func:`nbtrain.models.experts.expert_parallel_problem` says so before anything is launched.

Gradients: an expert's owner receives the gradients of the tokens of all ``ep`` ranks, and FSDP then averages over
the ``dp / ep`` ranks that hold the same experts; the trainer's loss is the mean over all ``dp`` ranks, so the
experts' gradients are scaled by ``1/ep`` on the way (exact: degrees are powers of two).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.nn.utils.stateless import _reparametrize_module



class _ScaleGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, scale):
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def spread_experts(module: nn.Module, mesh: DeviceMesh) -> None:
    """Keep this rank's ``E/ep`` experts of ``module`` as DTensors ``Shard(0)`` over ``mesh["ep"]`` and make its
    call dispatch tokens to their experts' ranks (see the module's docstring). In place."""
    ep_mesh = mesh["ep"]
    ep = ep_mesh.size()
    # gathering a spread expert's whole (a state dict) or its gradient's norm (clipping) runs one collective per mesh
    # axis, and torch logs a performance hint for each, on every rank, in the notebook's output; they are a few
    # calls a step at most, not worth a line each
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    per = module.num_experts // ep
    for name, param in list(module.named_parameters(recurse=False)):
        # every rank holds the same full weights here: each keeps its slice, nothing is sent (src_data_rank=None)
        shard = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
        module.register_parameter(name, nn.Parameter(shard, requires_grad=param.requires_grad))
    module.num_experts = per
    module.forward = functools.partial(_dispatch, module, type(module).forward, ep_mesh.get_group(), ep, per)


def _local_parameters(module: nn.Module, ep: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """This rank's experts as plain tensors in the compute dtype (FSDP2's mixed precision casts the experts it
    manages; experts no other rank holds are outside FSDP2 and cast here), their gradients scaled by ``1/ep``."""
    return {name: _ScaleGradient.apply(p.to_local() if isinstance(p, DTensor) else p, 1.0 / ep).to(dtype)
            for name, p in module.named_parameters(recurse=False)}


def _dispatch(module: nn.Module, forward, group, ep: int, per: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
              top_k_weights: torch.Tensor) -> torch.Tensor:
    k = top_k_index.shape[-1]
    chosen = top_k_index.reshape(-1)
    order = torch.argsort(chosen, stable=True)  # pairs by expert: each destination rank's are contiguous
    tokens = order // k
    counts = torch.bincount(chosen, minlength=ep * per)
    arriving = torch.empty_like(counts)
    dist.all_to_all_single(arriving, counts, group=group)  # [source rank, my expert]: what each rank sends me
    arriving = arriving.view(ep, per)
    sent, received = counts.view(ep, per).sum(1).tolist(), arriving.sum(1).tolist()
    inputs = funcol.wait_tensor(funcol.all_to_all_single_autograd(hidden[tokens], received, sent, group))
    local_ids = torch.arange(per, device=hidden.device).repeat(ep).repeat_interleave(arriving.reshape(-1))
    local = _local_parameters(module, ep, hidden.dtype)
    with _reparametrize_module(module, local):
        outputs = forward(module, inputs, local_ids[:, None],
                          torch.ones(len(local_ids), 1, dtype=top_k_weights.dtype, device=hidden.device))
    if not len(local_ids):  # no token reached this rank's experts: their gradients are zeros, not missing
        outputs = outputs + sum(p.sum() for p in local.values()) * 0
    back = funcol.wait_tensor(funcol.all_to_all_single_autograd(outputs, sent, received, group))
    weighted = (back * top_k_weights.reshape(-1)[order, None]).to(hidden.dtype)
    return torch.zeros_like(hidden).index_add_(0, tokens, weighted)
