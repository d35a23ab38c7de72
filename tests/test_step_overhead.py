"""What a training step does besides the model's own work: nothing that costs per step what could be done once."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from tests.distributed_fixtures import GPT_TINY, batches, single_process_group
from nbtrain.models import GPT
from nbtrain.models.description import layer_slots
from nbtrain.planner.plan import Plan


def test_a_training_step_builds_no_device_mesh(monkeypatch):
    """Slicing a DeviceMesh (``world[("dp_replicate", "dp_shard", "tp")]``) builds a new mesh each time. The trainer
    asked for each step's data-parallel rank that way: two new meshes a step, 1.5 ms of a 17-19 ms 2-process DDP
    step of a small transformers Qwen2 under cProfile, where a bare DDP loop of the same model paid nothing."""
    from nbtrain.run.parallel.mesh import PlanMeshes
    from nbtrain.run.parallel.parallelize import parallelize
    from nbtrain.run.trainer import Trainer

    with single_process_group():
        torch.manual_seed(0)
        model = GPT(GPT_TINY)
        ids, targets = next(iter(batches(1)))
        plan = Plan.parse("dp_shard=1", num_devices=1, num_layers=len(layer_slots(model)),
                          global_batch=ids.shape[0], seq_len=ids.shape[1])
        meshes = PlanMeshes(plan)
        model = parallelize(model, plan, meshes)
        trainer = Trainer(model, plan, meshes, torch.optim.AdamW(model.parameters()))
        first = trainer.step(ids, targets).loss

        built = []
        real_init = DeviceMesh.__init__

        def counted(self, *args, **kwargs):
            built.append(1)
            real_init(self, *args, **kwargs)

        monkeypatch.setattr(DeviceMesh, "__init__", counted)
        later = [trainer.step(ids, targets).loss for _ in range(3)]
    assert built == []
    assert later[-1] < first  # the steps trained


def test_python_s_garbage_collector_waits_until_a_step_is_over():
    """A step allocates thousands of small objects, so Python's collector ran several times inside each, and each
    collection walked the tensors it found and the autograd graph behind them: on a transformers Llama of two blocks,
    two micro-batches on 2 CPU processes, 8 ms of a 25 ms step (under cProfile, in the saved-tensor hook that
    allocated). The collector is held off during the step and runs after it, and a collector the user turned off
    stays off."""
    import gc

    from nbtrain.run.parallel.mesh import PlanMeshes
    from nbtrain.run.parallel.parallelize import parallelize
    from nbtrain.run.trainer import Trainer

    inside, collections = [False], []

    def seen(phase, info):
        if phase == "start":
            collections.append(inside[0])

    with single_process_group():
        torch.manual_seed(0)
        model = GPT(GPT_TINY)
        ids, targets = next(iter(batches(1)))
        plan = Plan.parse("mb=2", num_devices=1, num_layers=len(layer_slots(model)),
                          global_batch=ids.shape[0], seq_len=ids.shape[1])
        meshes = PlanMeshes(plan)
        model = parallelize(model, plan, meshes)
        trainer = Trainer(model, plan, meshes, torch.optim.AdamW(model.parameters()))
        trainer.step(ids, targets)
        forward_backward = trainer._forward_backward

        def marked(*args):  # the micro-batches' forwards and backwards: where the step allocates
            inside[0] = True
            try:
                return forward_backward(*args)
            finally:
                inside[0] = False

        trainer._forward_backward = marked
        threshold = gc.get_threshold()
        gc.set_threshold(10)  # a collection every 10 allocations: many in a step, were the collector on
        gc.callbacks.append(seen)
        try:
            for _ in range(2):
                trainer.step(ids, targets)
            gc.disable()
            trainer.step(ids, targets)
            stays_off = not gc.isenabled()
        finally:
            gc.enable()
            gc.callbacks.remove(seen)
            gc.set_threshold(*threshold)
    assert True not in collections  # none while the step computed
    assert False in collections  # the collector ran, between the steps
    assert stays_off
