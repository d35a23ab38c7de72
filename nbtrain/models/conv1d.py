"""Megatron's split of GPT-2's linear layers, ``transformers``' ``Conv1D``, as torch ``ParallelStyle``\\ s.

``Conv1D`` holds its weight as ``(in_features, out_features)`` and computes ``x @ W + b``, the transpose of
``nn.Linear``, which torch's ``ColwiseParallel`` / ``RowwiseParallel`` do not take. The same split on the other
dimension: :class:`Conv1DColwise` shards the weight's output dimension 1 (and the bias), :class:`Conv1DRowwise`
its input dimension 0 (the bias is replicated and added once, after the partial products are summed). A packed
projection (``c_attn``: q | k | v along its output) has each part split on its own (``_StridedShard(1,
split_factor=3)``: rank r holds q_r | k_r | v_r, whole heads of each), so the DTensor's global view stays the
user's weight; its bias is replicated and each rank adds its parts of it (its gradient summed over tp).

    >>> from torch.distributed.tensor.parallel import parallelize_module
    >>> parallelize_module(block.attn.c_attn, tp_mesh, Conv1DColwise(packed=3))     # inside a launched worker
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard


class CopyToTensorParallel(torch.autograd.Function):
    """Megatron's f: the identity forward; backward sums the input's gradient over the tensor-parallel ranks (each
    rank's output columns contributed their part of it)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's g: sums the ranks' partial products forward; the identity backward (every rank needs the whole
    gradient of the output)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _colwise_forward(self, x: torch.Tensor) -> torch.Tensor:
    weight, bias = self.weight, self.bias  # DTensors over the tp mesh (FSDP2 gathers them over dp first)
    mesh = weight.device_mesh
    x = CopyToTensorParallel.apply(x, mesh.get_group())
    w, b = weight.to_local(), bias.to_local()
    if self._nbtrain_packed > 1:  # the whole packed bias, replicated: this rank's part of each third
        b = CopyToTensorParallel.apply(b, mesh.get_group())  # each rank's gradient fills its parts: summed
        rank, tp = mesh.get_local_rank(), mesh.size()
        b = torch.cat([part.chunk(tp)[rank] for part in b.chunk(self._nbtrain_packed)])
    out = torch.addmm(b, x.reshape(-1, x.size(-1)), w)
    return out.view(*x.shape[:-1], w.shape[1])


def _rowwise_forward(self, x: torch.Tensor) -> torch.Tensor:
    weight, bias = self.weight, self.bias
    w = weight.to_local()
    partial = torch.mm(x.reshape(-1, x.size(-1)), w)
    out = ReduceFromTensorParallel.apply(partial, weight.device_mesh.get_group()) + bias.to_local()
    return out.view(*x.shape[:-1], w.shape[1])


def _distribute(module: nn.Module, mesh, weight_placement, bias_placement) -> None:
    for name, placement in (("weight", weight_placement), ("bias", bias_placement)):
        param = getattr(module, name)
        module.register_parameter(name, nn.Parameter(distribute_tensor(param.data, mesh, (placement,)),
                                                     requires_grad=param.requires_grad))


class Conv1DColwise(ParallelStyle):
    """A ``Conv1D``'s output features split over the tp ranks (``packed`` parts each split on its own)."""

    def __init__(self, packed: int = 1):
        super().__init__()
        self.packed = packed

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        # a packed bias stays replicated over tp (each rank takes its parts in forward): FSDP2 shards its dimension 0,
        # and its layout of a _StridedShard on that same dimension is not the one the placements describe (seen:
        # the gathered bias permuted), while a weight's _StridedShard on dimension 1 composes with it
        if self.packed > 1:
            _distribute(module, device_mesh, _StridedShard(1, split_factor=self.packed), Replicate())
        else:
            _distribute(module, device_mesh, Shard(1), Shard(0))
        module.forward = types.MethodType(_colwise_forward, module)
        module._nbtrain_packed = self.packed
        module.nf = module.weight.to_local().shape[1]
        return module


class Conv1DRowwise(ParallelStyle):
    """A ``Conv1D``'s input features split over the tp ranks, the partial products summed, the bias added once."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        _distribute(module, device_mesh, Shard(0), Replicate())
        module.forward = types.MethodType(_rowwise_forward, module)
        module._nbtrain_packed = 1
        return module
