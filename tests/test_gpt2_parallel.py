"""Hugging Face GPT-2 (default config apart from the sizes: dropout on, tied embedding and head) under tensor
parallelism (Megatron's split of its Conv1D layers, q|k|v fused in ``c_attn``) and in pipeline stages (the tied
embedding in the first and the last stage, its gradients summed): it trains as one process does.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import nbtrain  # noqa: E402
from nbtrain.run.verify import LOSS_RTOL, WEIGHT_RTOL, verify  # noqa: E402

GPT2 = "tests.verify_models:gpt2"


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["tp=2", "pp=2 mb=2"])
def test_verify_says_same_training_for_default_gpt2_with_the_trained_weights_loaded_back(plan):
    report = verify(GPT2, plan, processes=2, steps=3, batch=4, seq=16, timeout=120)
    assert report.ok, str(report)
    # the weights fit gathered and loaded into the user's model (verify's parallel copy) are the one process's
    assert report.weight_difference <= WEIGHT_RTOL
    assert any("Dropout" in t for t in report.turned_off)  # the default config's dropout was there


def _untrained_gpt2():
    from tests.verify_models import gpt2

    torch.manual_seed(0)
    model = gpt2()
    for module in model.modules():  # dropout off: runs under different plans must draw nothing to compare exactly
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def _batches(steps: int = 3):
    g = torch.Generator().manual_seed(7)
    ids = [torch.randint(0, 128, (4, 16), generator=g) for _ in range(steps)]
    return [(x, torch.roll(x, -1, dims=1)) for x in ids]


def _train(plan: str, steps: int, **kwargs):
    model = _untrained_gpt2()
    result = nbtrain.fit(model, _batches(), plan=plan, steps=steps, num_processes=2, lr=1e-2, progress=False,
                         timeout=120, **kwargs)
    return result, model


@pytest.mark.slow
@pytest.mark.parametrize("saved,resumed", [("tp=2", "dp_replicate=2"), ("dp_replicate=2", "pp=2 mb=2")])
def test_a_gpt2_checkpoint_saved_under_one_plan_resumes_under_another_with_the_uninterrupted_losses(
        tmp_path, saved, resumed):
    reference, reference_model = _train(saved, 3)
    _train(saved, 2, checkpoint_dir=tmp_path, checkpoint_every=1)
    # one name for the tied weight, the embedding's; the fused q|k|v saved whole (its global view)
    from nbtrain.run.state.checkpoint import CheckpointFolder

    shapes = CheckpointFolder(tmp_path).latest().saved_shapes()
    assert "model.transformer.wte.weight" in shapes and "model.lm_head.weight" not in shapes
    assert shapes["model.transformer.h.0.attn.c_attn.weight"] == (32, 96)
    resumed_run, resumed_model = _train(resumed, 3, checkpoint_dir=tmp_path, resume=True)
    assert resumed_run.resumed_at == 2
    assert resumed_run.losses == pytest.approx(reference.losses, rel=LOSS_RTOL)
    # the global gradient norm (clipping at 1.0 acts) counts a weight two stages share once
    assert resumed_run.records[-1].grad_norm == pytest.approx(reference.records[-1].grad_norm, rel=LOSS_RTOL)
    ref = reference_model.state_dict()
    apart = sum(float((v - ref[k]).square().sum()) for k, v in resumed_model.state_dict().items()) ** 0.5
    assert apart <= 1e-3 * sum(float(v.square().sum()) for v in ref.values()) ** 0.5


def _shards_of_a_gpt2_block(model):
    """In each of 2 workers: the block's c_attn after parallelize under tp=2, and what the split block computes."""
    import torch.distributed as dist

    from nbtrain.planner.plan import Plan
    from nbtrain.run.parallel.mesh import PlanMeshes
    from nbtrain.models.description import layer_slots
    from nbtrain.run.parallel.parallelize import parallelize

    torch.manual_seed(1)
    x = torch.randn(2, 5, model.config.n_embd)
    expected = model.transformer.h[0](x)
    plan = Plan.parse("tp=2", num_devices=2, num_layers=len(layer_slots(model)), global_batch=2, seq_len=5)
    parallelize(model, plan, PlanMeshes(plan))
    block = model.transformer.h[0]
    c_attn = block.attn.c_attn
    got = block(x)
    parts = [None, None]
    dist.all_gather_object(parts, {"weight": c_attn.weight.to_local().detach().clone(),
                                   "full": c_attn.weight.full_tensor().detach().clone(),
                                   "split_size": block.attn.split_size,
                                   "block_matches": bool(torch.allclose(got, expected, atol=1e-6))})
    return parts


@pytest.mark.slow
def test_each_rank_holds_its_own_heads_of_q_k_and_v_of_the_fused_projection():
    model = _untrained_gpt2()
    weight = model.transformer.h[0].attn.c_attn.weight.detach().clone()  # (in, q | k | v)
    embd, head_dim = model.config.n_embd, model.config.n_embd // model.config.n_head
    parts = nbtrain.launch(_shards_of_a_gpt2_block, model, num_processes=2)
    q, k, v = weight.split(embd, dim=1)
    heads_per_rank = model.config.n_head // 2
    for rank, part in enumerate(parts):
        mine = slice(rank * heads_per_rank * head_dim, (rank + 1) * heads_per_rank * head_dim)
        assert torch.equal(part["weight"], torch.cat([q[:, mine], k[:, mine], v[:, mine]], dim=1)), rank
        assert torch.equal(part["full"], weight)  # the global view is the user's weight
        assert part["split_size"] == embd // 2
        assert part["block_matches"], f"rank {rank}: the split block computes another output"
