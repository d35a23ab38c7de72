"""Plain data parallelism (DDP) and the model's buffers: running statistics that training changes (BatchNorm) stay
the same on every rank, as DDP keeps them by default (rank 0's, broadcast before each forward); buffers that never
change (a RoPE table, a causal mask) are not broadcast before every forward, which cost a quarter of a small
transformers model's step here."""

from __future__ import annotations

import torch
from torch import nn

from tests.distributed_fixtures import gloo_worker, spawn_group


def _conv_net():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                         nn.Linear(8 * 8 * 8, 10))


def _worker(rank, world, port, queue):
    with gloo_worker(rank, world, port, queue) as report:
        import torch.distributed as dist

        from nbtrain.models.description import layer_slots
        from nbtrain.planner.plan import Plan
        from nbtrain.run.parallel.mesh import PlanMeshes
        from nbtrain.run.parallel.parallelize import parallelize
        from tests.distributed_fixtures import llama

        torch.manual_seed(0)
        model = _conv_net()
        plan = Plan.parse("dp_replicate=2", num_devices=world, num_layers=len(layer_slots(model)), global_batch=8)
        wrapped = parallelize(model, plan, PlanMeshes(plan))
        g = torch.Generator().manual_seed(rank)  # each rank its own rows, as in training
        for _ in range(2):
            wrapped(torch.randn(4, 3, 8, 8, generator=g)).sum().backward()
        wrapped.eval()  # the broadcast comes before a forward, which in training mode would update them again
        wrapped(torch.randn(4, 3, 8, 8, generator=g))
        stats = [torch.zeros(8) for _ in range(world)]
        dist.all_gather(stats, model[1].running_mean)
        lm = llama()
        plan = Plan.parse("dp_replicate=2", num_devices=world, num_layers=len(layer_slots(lm)), global_batch=8)
        ddp = parallelize(lm, plan, PlanMeshes(plan))
        report({"running_means": stats, "conv_broadcasts": wrapped.will_sync_module_buffers(),
                "llama_broadcasts": ddp.will_sync_module_buffers()})


def test_batchnorm_statistics_stay_the_same_on_every_rank_and_constant_buffers_are_not_broadcast():
    seen = spawn_group(_worker, 2)
    first, second = seen["running_means"]
    assert first.abs().sum() > 0
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    assert seen["conv_broadcasts"] and not seen["llama_broadcasts"]
