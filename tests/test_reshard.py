"""A model's tensors move between any two of nbtrain's layouts and arrive whole: every element where the destination
layout puts it, each exactly once, whichever rank held it before.

Layouts are built by the executor itself (``parallelize`` of a uniform plan): plain data parallel (DDP, every rank
all of it), FSDP2 ``dp_shard`` (DTensor shards), tensor parallel (DTensor shards along other dimensions), and with 4
processes their mixes. The check is independent of the plan: the destination's full tensors (``full_tensor()``)
equal the source model's, and a rank receives nothing it held already.
"""

from __future__ import annotations

import pytest
import torch

from nbtrain.models import GPT
from tests.distributed_fixtures import GPT_TINY, gloo_worker, spawn_group

LAYOUTS_2 = ["dp_replicate=2", "dp_shard=2", "tp=2"]
LAYOUTS_4 = ["dp_replicate=4", "dp_replicate=2 tp=2", "tp=4", "dp_shard=2 tp=2"]


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _worker(rank, world, port, layouts, queue):
    with gloo_worker(rank, world, port, queue) as report:
        import torch.distributed as dist

        from nbtrain.planner.plan import Plan
        from nbtrain.run.parallel.mesh import PlanMeshes, local_shard
        from nbtrain.run.parallel.parallelize import parallelize
        from nbtrain.run.switching.reshard import Resharding

        models = {}
        for i, layout in enumerate(layouts):
            torch.manual_seed(i)  # different weights in each layout: a copy that did not happen shows
            model = GPT(GPT_TINY)
            plan = Plan.parse(layout, num_devices=world, num_layers=GPT_TINY.n_layer + 2)
            wrapped = parallelize(model, plan, PlanMeshes(plan))
            models[layout] = getattr(wrapped, "module", wrapped)
        results = {}
        for a, b in [(a, b) for a in layouts for b in layouts if a != b]:
            src, dst = list(models[a].parameters()), list(models[b].parameters())
            want = [full(p.detach()).clone() for p in src]
            plan = Resharding(src, dst)
            plan.run([local_shard(p.detach()) for p in src], [local_shard(p.detach()) for p in dst])
            got = [full(p.detach()) for p in dst]
            same = all(torch.equal(x, y) for x, y in zip(got, want))
            total = sum(local_shard(p).numel() for p in dst)
            results[a, b] = (same, plan.elements_received, total)
            torch.manual_seed(99)  # scramble the destination again for the next pair
            for p in dst:
                local_shard(p.detach()).normal_()
        gathered = [None] * world
        dist.all_gather_object(gathered, results)
        report(gathered)


def check(results_by_rank, layouts):
    for a, b in [(a, b) for a in layouts for b in layouts if a != b]:
        for rank, results in enumerate(results_by_rank):
            same, received, held = results[a, b]
            assert same, f"{a} → {b}: rank {rank}'s tensors differ from the source's"
            assert received <= held
            if a.startswith("dp_replicate") and "tp" not in a:  # the source held everything: nothing to receive
                assert received == 0, f"{a} → {b}: rank {rank} received {received} elements it held"


@pytest.mark.slow
def test_tensors_move_between_ddp_fsdp_and_tensor_parallel_layouts_on_two_ranks():
    check(spawn_group(_worker, 2, LAYOUTS_2), LAYOUTS_2)


@pytest.mark.slow
def test_tensors_move_between_data_and_tensor_parallel_mixes_on_four_ranks():
    check(spawn_group(_worker, 4, LAYOUTS_4), LAYOUTS_4)
