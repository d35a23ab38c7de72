"""Move the hidden state between two layers whose (dp, tp) layouts differ, with exact gradients.

Under layout ``(dp, tp)`` the ``D = dp·tp`` ranks of a stage hold the micro-batch's rows in ``dp`` slices: rank
``r`` holds slice ``r // tp`` (tp is the innermost mesh axis), replicated over its ``tp`` ranks. To change layout,
every rank gathers the slices from one holder each and keeps the rows the next layout gives it. Backward does the
same with the gradient, in the other direction, so every tensor-parallel replica gets the whole gradient of its
rows (each replica's weight shard needs it).

Scale: each rank's loss is the mean over the rows of its slice *in the last layout*, and FSDP2 averages
gradients over a layer's own data-parallel ranks; a layer with ``dp_a`` slices feeding one with ``dp_b`` would see
its gradient scaled by ``dp_b / dp_a``, so backward multiplies by ``dp_a / dp_b``.

This gathers the whole micro-batch on every rank — more traffic than HotSPa's finest-common-slices transfer, and
simple; gloo has no all-to-all either (STACK.md).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def _move(x: torch.Tensor, src: tuple[int, int], dst: tuple[int, int], group) -> torch.Tensor:
    (dp_a, tp_a), (dp_b, tp_b) = src, dst
    rank = dist.get_rank(group)
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    whole = torch.cat([parts[j * tp_a] for j in range(dp_a)])
    return whole.chunk(dp_b)[rank // tp_b].contiguous()


class _Relayout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src, dst, group):
        ctx.src, ctx.dst, ctx.group = src, dst, group
        return _move(x, src, dst, group)

    @staticmethod
    def backward(ctx, grad):
        scale = ctx.src[0] / ctx.dst[0]
        return _move(grad, ctx.dst, ctx.src, ctx.group) * scale, None, None, None


def add_relayout(module: nn.Module, src: tuple[int, int], dst: tuple[int, int], group) -> None:
    """Make ``module`` move its first input from layout ``src`` to ``dst`` (each ``(dp, tp)``) before it runs.

    A forward pre-hook rather than a wrapper module, so parameter names (and state dicts) stay the model's. Other
    arguments (a Hugging Face block's RoPE tables) do not depend on the batch and pass as they are.
    """
    def hook(_, args, kwargs):
        return (_Relayout.apply(args[0], src, dst, group), *args[1:]), kwargs

    module.register_forward_pre_hook(hook, with_kwargs=True)
