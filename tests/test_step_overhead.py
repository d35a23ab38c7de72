"""What a training step does besides the model's own work: nothing that costs per step what could be done once."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from tests.distributed_fixtures import GPT_TINY, batches, single_process_group
from nbtrain.models import GPT
from nbtrain.models.description import layer_slots
from nbtrain.planner.plan import Plan


def tiny_trainer(strategy: str):
    """nbtrain's tiny GPT parallelized under ``strategy`` on one process (inside ``single_process_group``), its
    trainer, and one batch."""
    from nbtrain.run.parallel.mesh import PlanMeshes
    from nbtrain.run.parallel.parallelize import parallelize
    from nbtrain.run.trainer import Trainer

    torch.manual_seed(0)
    model = GPT(GPT_TINY)
    ids, targets = next(iter(batches(1)))
    plan = Plan.parse(strategy, num_devices=1, num_layers=len(layer_slots(model)),
                      global_batch=ids.shape[0], seq_len=ids.shape[1])
    meshes = PlanMeshes(plan)
    model = parallelize(model, plan, meshes)
    return Trainer(model, plan, meshes, torch.optim.AdamW(model.parameters())), ids, targets


def test_a_training_step_builds_no_device_mesh(monkeypatch):
    """Slicing a DeviceMesh (``world[("dp_replicate", "dp_shard", "tp")]``) builds a new mesh each time. The trainer
    asked for each step's data-parallel rank that way: two new meshes a step, 1.5 ms of a 17-19 ms 2-process DDP
    step of a small transformers Qwen2 under cProfile, where a bare DDP loop of the same model paid nothing."""
    with single_process_group():
        trainer, ids, targets = tiny_trainer("dp_shard=1")
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

    inside, collections = [False], []

    def seen(phase, info):
        if phase == "start":
            collections.append(inside[0])

    with single_process_group():
        trainer, ids, targets = tiny_trainer("mb=2")
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


def test_what_a_worker_held_before_training_is_out_of_the_collector_s_reach_during_the_step_loop():
    """A full collection walks every object a process holds, and a worker that imported torch and transformers holds
    millions: 250-360 ms each, twice in 30 steps of a 2-stage pipeline of a transformers Qwen2 whose steps took
    35-40 ms, and the other rank waited for it inside its own step. The loop freezes what exists when it starts
    (``gc.freeze``) and lets it back afterwards."""
    import gc
    from types import SimpleNamespace

    from nbtrain.run.fit_worker import RunSettings, train_steps

    frozen_in_steps = []

    class CountingTrainer:
        steps_done, schedule_epoch, device = 0, 0, torch.device("cpu")

        def step(self, ids, targets):
            frozen_in_steps.append(gc.get_freeze_count())
            self.steps_done += 1
            return SimpleNamespace(loss=1.0)

    before = gc.get_freeze_count()
    run = RunSettings(steps=3, lr=1e-3, clip_norm=None, loss_fn=None, seed=0, progress=False, precision="fp32",
                      lr_schedule=None, save_dir=None)
    records = train_steps(CountingTrainer(), None, None, lambda step: (None, None), run, rank0=True)
    assert len(records) == 3
    assert min(frozen_in_steps) > before + 1000  # the process's objects, torch's among them
    assert gc.get_freeze_count() == before


def test_gradients_on_meshes_sliced_per_module_are_clipped_as_one_group_a_placement():
    """The executor splits each module on its layer's slice of the mesh, a new ``DeviceMesh`` object each time, and
    clipping takes a norm and a reduction per group of gradients (``nbtrain.gradients``). Grouped by mesh object, a
    transformers Qwen2 under ``tp=2`` had 8 groups (12.8 ms of clipping a step); by mesh value, as DTensor compares
    meshes, 4 (4.0 ms). Gradients on equal meshes with the same placements are one group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from nbtrain.gradients import group_by_kind

    with single_process_group():
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
        one, other = mesh["tp"], mesh["tp"]  # two slices, as two modules get them: equal, not the same object
        assert one is not other and one == other
        columns = [distribute_tensor(torch.ones(4, 4), m, [Shard(0)]) for m in (one, other, one)]
        rows = [distribute_tensor(torch.ones(4, 4), m, [Shard(1)]) for m in (other, one)]
        replicated = distribute_tensor(torch.ones(4), other, [Replicate()])
        groups = group_by_kind([columns[0], rows[0], columns[1], torch.ones(3), replicated, columns[2], rows[1]])
        assert [len(group) for group in groups] == [3, 2, 1, 1]
