"""Device meshes for a plan: one world mesh ``pp × dp_replicate × dp_shard × tp`` (tp innermost), named views.

    >>> meshes = PlanMeshes(plan)                # in every worker, after the process group exists
    >>> mesh = meshes.for_layer(5)               # the (dp_replicate, dp_shard, tp) mesh of layer 5's stage
    >>> mesh["tp"], mesh["dp_shard"], meshes.dp_rank(5)

Layers may choose different degrees (``dp_shard=4`` here, ``dp_shard=2 tp=2`` there) over the same devices of a
stage, so each distinct layout gets its own world mesh ``(pp, dp_replicate, dp_shard, tp)``. Creating a mesh is
collective (every rank creates every process group), so all of them are built up front, in the plan's layer order,
by every rank; a layer then uses its stage's slice. The meshes are on this rank's device
(:func:`~nbtrain.run.placement.rank_device`): CUDA under NCCL, the CPU under gloo.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from nbtrain.errors import InvalidPlanError
from nbtrain.planner.plan import Plan
from nbtrain.planner.strategy import Strategy
from nbtrain.run.placement import rank_device

AXES = ("dp_replicate", "dp_shard", "tp")
EXPERT_AXES = ("edp_replicate", "edp_shard", "ep")
"""A layer's experts under ``ep``: the data-parallel ranks ``dp_replicate × dp_shard`` seen as ``edp_replicate ×
edp_shard × ep`` (ep innermost, as torchtitan borrows it from dp_shard), the experts spread over ``ep`` and
data-parallel (replicated × sharded) over the rest (:attr:`~nbtrain.planner.strategy.Strategy.expert_degrees`)."""


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """What this process holds of ``t``: a DTensor's local shard (a view: writing it writes the DTensor), or all of a
    plain tensor. The CPU update offload and the hot-switching re-layout both work on these."""
    if isinstance(t, DTensor):
        with torch.no_grad():
            return t.to_local()
    return t


class PlanMeshes:
    """The meshes a plan needs in this process: one per (stage, layout), over the stage's ranks."""

    def __init__(self, plan: Plan):
        world = dist.get_world_size()
        if world != plan.num_devices:
            raise InvalidPlanError(
                f"the plan is for {plan.num_devices} devices but {world} processes were launched; launch "
                f"{plan.num_devices} processes, or scale the plan to {world} devices")
        self.plan = plan
        self.rank = dist.get_rank()
        self.device = rank_device()
        """This rank's device: every tensor the plan computes on is there (:mod:`nbtrain.run.placement`)."""
        self.stage = self.rank // plan.devices_per_stage
        self._worlds: dict[tuple[int, int, int], DeviceMesh] = {}
        for s in plan.layers:  # the same order on every rank: mesh creation is collective
            shape = (s.dp_replicate, s.dp_shard, s.tp)
            if shape not in self._worlds:
                self._worlds[shape] = init_device_mesh(self.device.type, (plan.pp, *shape),
                                                       mesh_dim_names=("pp", *AXES))
        self._experts: dict[tuple[int, int, int, int], DeviceMesh] = {}
        for s in plan.layers:
            key = (s.dp_replicate, s.dp_shard, s.tp, s.ep)
            if s.ep > 1 and key not in self._experts:
                self._experts[key] = init_device_mesh(self.device.type, (plan.pp, *s.expert_degrees, s.ep, s.tp),
                                                      mesh_dim_names=("pp", *EXPERT_AXES, "tp"))

        # one group per stage, created by every rank in the same order (new_group is collective)
        groups = [dist.new_group(self.stage_ranks(i)) for i in range(plan.pp)] if plan.pp > 1 else [dist.group.WORLD]
        # slicing a DeviceMesh builds a new one each time (~0.5 ms under gloo; the trainer asks every step): each
        # view is sliced once
        self._views: dict[tuple, DeviceMesh] = {}
        self.stage_group = groups[self.stage]
        """The process group of this rank's pipeline stage (re-layouts between layers run over it)."""

    def stage_ranks(self, stage: int | None = None) -> list[int]:
        stage = self.stage if stage is None else stage
        per = self.plan.devices_per_stage
        return list(range(stage * per, (stage + 1) * per))

    def pp_mesh(self) -> DeviceMesh:
        """The pipeline axis through this rank (same position in every stage)."""
        return self._view(next(iter(self._worlds.values())), ("pp",))

    def for_strategy(self, s: Strategy) -> DeviceMesh:
        """The mesh ``(dp_replicate, dp_shard, tp)`` of this process's stage, for a layer of strategy ``s``."""
        return self._view(self._worlds[(s.dp_replicate, s.dp_shard, s.tp)], AXES)

    def for_experts(self, s: Strategy) -> DeviceMesh:
        """The mesh ``(edp_replicate, edp_shard, ep)`` of this process's stage for the experts of a layer of strategy
        ``s`` (``s.ep > 1``): the same ranks as :meth:`for_strategy`'s data-parallel axes, regrouped."""
        return self._view(self._experts[(s.dp_replicate, s.dp_shard, s.tp, s.ep)], EXPERT_AXES)

    def _view(self, world: DeviceMesh, axes: tuple[str, ...]) -> DeviceMesh:
        """``world[axes]`` for this rank, sliced the first time it is asked for."""
        key = (id(world), axes)
        if key not in self._views:
            self._views[key] = world[axes if len(axes) > 1 else axes[0]]
        return self._views[key]

    def for_layer(self, index: int) -> DeviceMesh:
        return self.for_strategy(self.plan.layers[index])

    def dp_rank(self, index: int) -> int:
        """Which slice of the batch this process holds at layer ``index``: its data-parallel coordinate."""
        s = self.plan.layers[index]
        mesh = self.for_strategy(s)
        return mesh.get_local_rank("dp_replicate") * s.dp_shard + mesh.get_local_rank("dp_shard")
