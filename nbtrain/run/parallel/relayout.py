"""Move the hidden state between two layers whose (dp, tp, sp) layouts differ, with exact gradients.

    >>> whole((1, 2, True))                # what an embedding, a head or a pipeline stage boundary hands on
    (1, 2, False)

In a worker, ``parallelize`` calls ``add_relayout(block, (2, 1, False), (1, 2, True), meshes.stage_group,
meshes.for_strategy(s)["tp"])`` on the first layer of each new layout.

Under layout ``(dp, tp, sp)`` the ``D = dp·tp`` ranks of a stage hold the micro-batch's rows in ``dp`` slices: rank
``r`` holds slice ``r // tp`` (tp is the innermost mesh axis), replicated over its ``tp`` ranks, or with ``sp``
(sequence parallelism) split along the sequence over them, rank ``r`` holding part ``r % tp``. To change layout,
every rank gathers the parts from one holder each and keeps the rows (and the part of the sequence) the next layout
gives it. Backward does the same with the gradient, in the other direction, so every tensor-parallel replica gets
the whole gradient of its rows (each replica's weight shard needs it).

Scale: each rank's loss is the mean over the rows of its slice *in the last layout*, and FSDP2 averages
gradients over a layer's own data-parallel ranks; a layer with ``dp_a`` slices feeding one with ``dp_b`` would see
its gradient scaled by ``dp_b / dp_a``, so backward multiplies by ``dp_a / dp_b``. Splitting the sequence changes
no scale: the parts of a sequence are summed, not averaged.

This gathers the whole micro-batch on every rank — more traffic than HotSPa's finest-common-slices transfer, and
simple; gloo has no all-to-all either (STACK.md). When only ``sp`` differs (the same dp and tp: a sequence-parallel
layer beside a plain tensor-parallel one) the move is DTensor's own redistribution over the ``tp`` ranks, as
Megatron-SP does it at its boundaries (Korthikanti et al. 2022, §4.2.2): ``Shard(1) → Replicate()`` all-gathers the
sequence (its backward slices the gradient), ``Replicate() → Shard(1)`` slices it (its backward all-gathers).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from nbtrain.errors import InvalidArgumentError

Layout = tuple[int, int, bool]
"""(dp, tp, sp), as :attr:`nbtrain.planner.strategy.Strategy.layout`."""


def whole(layout: Layout) -> Layout:
    """The layout with the sequence whole on every tensor-parallel rank (what an embedding, a head or a pipeline
    stage boundary hands on or takes)."""
    return (layout[0], layout[1], False)


def _check_length(x: torch.Tensor, tp: int) -> None:
    if x.dim() < 2 or x.shape[1] % tp:
        raise InvalidArgumentError(f"sequence parallelism splits the sequence over tp={tp} ranks, but the hidden "
                                   f"state has shape {tuple(x.shape)}; use a sequence length divisible by {tp}, or "
                                   "leave out 'sp'")


def _move(x: torch.Tensor, src: Layout, dst: Layout, group) -> torch.Tensor:
    (dp_a, tp_a, sp_a), (dp_b, tp_b, sp_b) = src, dst
    rank = dist.get_rank(group)
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    rows = [torch.cat(parts[j * tp_a:(j + 1) * tp_a], dim=1) if sp_a else parts[j * tp_a] for j in range(dp_a)]
    mine = torch.cat(rows).chunk(dp_b)[rank // tp_b]
    if sp_b:
        _check_length(mine, tp_b)
        mine = mine.chunk(tp_b, dim=1)[rank % tp_b]
    return mine.contiguous()


class _Relayout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src, dst, group):
        ctx.src, ctx.dst, ctx.group = src, dst, group
        return _move(x, src, dst, group)

    @staticmethod
    def backward(ctx, grad):
        scale = ctx.src[0] / ctx.dst[0]
        return _move(grad, ctx.dst, ctx.src, ctx.group) * scale, None, None, None


def _sequence(x: torch.Tensor, sharded: bool, tp_mesh) -> torch.Tensor:
    """Gather (``sharded``: the input is this rank's part of the sequence) or slice the sequence over ``tp_mesh``."""
    if not sharded:
        _check_length(x, tp_mesh.size())
    src, dst = ((Shard(1),), (Replicate(),)) if sharded else ((Replicate(),), (Shard(1),))
    return DTensor.from_local(x, tp_mesh, src, run_check=False).redistribute(tp_mesh, dst).to_local()


def relayout(x: torch.Tensor, src: Layout, dst: Layout, group, tp_mesh=None) -> torch.Tensor:
    """``x`` (laid out as ``src``) laid out as ``dst``, differentiably; ``group``: the stage's ranks; ``tp_mesh``:
    this rank's tensor-parallel mesh, for a change of ``sp`` alone."""
    if src == dst:
        return x
    if src[:2] == dst[:2] and tp_mesh is not None:
        return _sequence(x, src[2], tp_mesh)
    return _Relayout.apply(x, src, dst, group)


def add_relayout(module: nn.Module, src: Layout, dst: Layout, group, tp_mesh=None, output: bool = False) -> None:
    """Make ``module`` move its first input (``output``: its output, or the first item of a tuple it returns) from
    layout ``src`` to ``dst`` (each ``(dp, tp, sp)``) before (after) it runs.

    A forward hook rather than a wrapper module, so parameter names (and state dicts) stay the model's. Other
    arguments (a Hugging Face block's RoPE tables) do not depend on the batch and pass as they are.
    """
    if output:
        def after(_, args, out):
            if isinstance(out, tuple):
                return (relayout(out[0], src, dst, group, tp_mesh), *out[1:])
            return relayout(out, src, dst, group, tp_mesh)

        module.register_forward_hook(after)
        return

    def hook(_, args, kwargs):
        return (relayout(args[0], src, dst, group, tp_mesh), *args[1:]), kwargs

    module.register_forward_pre_hook(hook, with_kwargs=True)
