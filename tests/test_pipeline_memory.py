"""A pipeline stage sharded with FSDP2 holds its layers' whole gradients until the end of its backward, and the
planner prices them so (issue 45: "the planner and the executor must agree").

torch's ``PipelineStage`` turns FSDP2's gradient sync off for every micro-batch's backward and reduce-scatters once,
after the last (``perform_reduce_grad``); until then FSDP2 accumulates each parameter's gradient whole, in the reduce
dtype. What the stage holds is read from FSDP2's own tensors at that moment, on 4 gloo processes.

    .venv/bin/pytest tests/test_pipeline_memory.py -q          # ~15 s on 2 cores
"""

from __future__ import annotations

import torch

import nbtrain
from nbtrain.models.gpt import GPT, GPTConfig

WIDE = GPTConfig(vocab_size=256, block_size=16, n_layer=4, n_head=4, n_embd=256, ffn_hidden=1024, bias=False,
                 tie_embeddings=False)
"""Weights dominate: 0.8 M parameters a block, 16 tokens a row."""
PLAN, BATCH = "pp=2 mb=2 | dp_shard=2", 8


def _gradient_bytes_before_the_reduce() -> int:
    """Rank 0's (stage 0's) gradient bytes when its schedule is about to reduce-scatter them: FSDP2's accumulated
    whole gradients, or the unsharded parameters' ``.grad`` where no accumulation buffer was made."""
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.pipelining.stage import _PipelineStageBase

    from nbtrain.models.description import layer_slots
    from nbtrain.planner.plan import Plan
    from nbtrain.run.parallel.mesh import PlanMeshes
    from nbtrain.run.parallel.parallelize import parallelize
    from nbtrain.run.trainer import Trainer

    torch.manual_seed(0)
    model = GPT(WIDE)
    plan = Plan.parse(PLAN, num_devices=4, num_layers=len(layer_slots(model)), global_batch=BATCH,
                      seq_len=WIDE.block_size)
    meshes = PlanMeshes(plan)
    model = parallelize(model, plan, meshes)
    trainer = Trainer(model, plan, meshes, torch.optim.AdamW(model.parameters(), lr=1e-3))
    held: list[int] = []
    reduce = _PipelineStageBase.perform_reduce_grad

    def counted(stage, *args, **kwargs):
        seen = {}
        roots = [m for m in stage.submod.modules() if isinstance(m, FSDPModule)]
        for state in fully_shard.state(roots[0])._state_ctx.all_states:
            for group in state._fsdp_param_groups:
                for fsdp_param in group.fsdp_params:
                    grad = fsdp_param.unsharded_accumulated_grad
                    grad = fsdp_param._unsharded_param.grad if grad is None else grad
                    if grad is not None:
                        seen[grad.untyped_storage().data_ptr()] = grad.untyped_storage().nbytes()
        held.append(sum(seen.values()))
        return reduce(stage, *args, **kwargs)

    _PipelineStageBase.perform_reduce_grad = counted
    try:
        ids = torch.randint(0, WIDE.vocab_size, (BATCH, WIDE.block_size))
        trainer.step(ids, torch.roll(ids, -1, dims=1))
    finally:
        _PipelineStageBase.perform_reduce_grad = reduce
    return held[0]


def test_a_sharded_pipeline_stage_holds_its_whole_gradients_until_its_reduce_and_is_priced_so():
    from nbtrain.planner.cost import CostModel, CostOptions
    from nbtrain.planner.plan import Plan

    measured = nbtrain.launch(_gradient_bytes_before_the_reduce, num_processes=4)
    profile = nbtrain.profile(GPT(WIDE), batch_size=BATCH // 2, seq_len=WIDE.block_size, dtype="fp32")
    model = CostModel(profile, nbtrain.Cluster.from_catalog("A100", num_devices=4), global_batch=BATCH,
                      seq_len=WIDE.block_size, options=CostOptions(headroom=0, reserve_bytes=0))
    plan = Plan.parse(PLAN, num_devices=4, num_layers=len(profile.layers), global_batch=BATCH,
                      seq_len=WIDE.block_size)
    stage = model.estimate(plan).stages[0]
    # stage 0: the embedding and two blocks, every weight's fp32 gradient whole (not half, as sharded)
    whole = 4 * sum(layer.params for layer in profile.layers[stage.start:stage.end])
    assert measured == whole
    assert stage.memory.grads == whole
