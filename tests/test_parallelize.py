"""Every strategy the executor applies trains exactly like one process: same seed and data, same losses.

Tolerance: relative 1e-4 per step over 5 AdamW steps in fp32 (DESIGN.md's "same training semantics").
"""

from __future__ import annotations

import pytest

from tests.distributed_fixtures import (distributed_losses, gpt, hf_gpt2, hf_llama, llama, losses_by_world,
                                       reference_losses)

TWO = ["dp_replicate=2", "dp_shard=2 zero=2", "dp_shard=2", "dp_shard=2 ac", "tp=2", "tp=2 ac",
       "0-1: dp_shard=2 ac; 2-3: dp_shard=2 zero=2", "mb=2 | dp_shard=2", "mb=4 | tp=2",
       "pp=2 mb=1 schedule=gpipe", "pp=2 mb=4 schedule=1f1b", "pp=2 mb=2 stages=1+3 | 0-3: dp_replicate=1 ac",
       "0: dp_shard=2; 1-2: tp=2 ac; 3: dp_replicate=2"]
FOUR = ["dp_shard=2 tp=2", "dp_replicate=2 dp_shard=2", "dp_replicate=2 tp=2 ac", "pp=2 mb=2 | dp_shard=2",
        "pp=2 mb=4 | tp=2 ac", "0: dp_shard=4; 1: dp_shard=2 tp=2 ac; 2: dp_replicate=2 tp=2; 3: dp_shard=4",
        "pp=2 mb=2 | 0: dp_shard=2; 1: tp=2; 2: dp_shard=2 ac; 3: tp=2"]


@pytest.fixture(scope="module", params=[gpt, llama], ids=["gpt", "llama"])
def runs(request):
    build = request.param
    return losses_by_world(build, {2: TWO, 4: FOUR})


@pytest.mark.slow
@pytest.mark.parametrize("world,plan", [(2, p) for p in TWO] + [(4, p) for p in FOUR])
def test_plan_trains_with_the_losses_of_one_process(runs, world, plan):
    reference, got = runs["reference"], runs[world][plan]
    assert got == pytest.approx(reference, rel=1e-4), f"{plan} on {world} processes"
    assert reference[-1] < reference[0]  # it did train


@pytest.mark.slow
def test_micro_batches_and_gradient_clipping_match_one_process_that_clips():
    # a clip norm well under the gradients' norm, so that clipping acts on every step
    reference = reference_losses(gpt, clip_norm=0.05)
    got = distributed_losses(gpt, ["mb=2 | dp_shard=2", "dp_replicate=2", "tp=2"], world=2, clip_norm=0.05)
    for plan, losses in got.items():
        assert losses == pytest.approx(reference, rel=1e-4), plan
    assert reference != pytest.approx(reference_losses(gpt), rel=1e-3)  # clipping changed the training


HF_TWO = ["dp_shard=2", "dp_replicate=2 ac", "tp=2", "mb=2 | tp=2 ac", "0: dp_shard=2; 1-2: tp=2; 3: dp_shard=2 zero=2",
          "pp=2 mb=2 schedule=gpipe", "pp=2 mb=4 schedule=1f1b stages=1+3 | 0-3: dp_replicate=1 ac"]
HF_FOUR = ["dp_shard=2 tp=2", "0: dp_shard=4; 1: dp_shard=2 tp=2 ac; 2: dp_replicate=2 tp=2; 3: dp_shard=4",
           "pp=2 mb=2 | dp_shard=2", "pp=2 mb=2 | 0: dp_shard=2; 1: tp=2; 2: dp_shard=2 ac; 3: tp=2"]


@pytest.fixture(scope="module")
def hf_runs():
    pytest.importorskip("transformers")
    return losses_by_world(hf_llama, {2: HF_TWO, 4: HF_FOUR})


@pytest.mark.slow
@pytest.mark.parametrize("world,plan", [(2, p) for p in HF_TWO] + [(4, p) for p in HF_FOUR])
def test_transformers_llama_trains_with_the_losses_of_one_process(hf_runs, world, plan):
    reference, got = hf_runs["reference"], hf_runs[world][plan]
    assert got == pytest.approx(reference, rel=1e-4), f"{plan} on {world} processes"
    assert reference[-1] < reference[0]


HF_GPT2_TWO = ["dp_replicate=2", "dp_shard=2 ac", "mb=2 | dp_shard=2 zero=2", "0: dp_shard=2; 1-2: dp_replicate=2 ac; 3: dp_shard=2"]


@pytest.fixture(scope="module")
def hf_gpt2_runs():
    pytest.importorskip("transformers")
    return losses_by_world(hf_gpt2, {2: HF_GPT2_TWO})


@pytest.mark.slow
@pytest.mark.parametrize("plan", HF_GPT2_TWO)
def test_transformers_gpt2_trains_with_the_losses_of_one_process(hf_gpt2_runs, plan):
    reference, got = hf_gpt2_runs["reference"], hf_gpt2_runs[2][plan]
    assert got == pytest.approx(reference, rel=1e-4), plan
    assert reference[-1] < reference[0]


def test_a_model_without_a_tensor_parallel_split_refuses_tp_with_the_reason():
    pytest.importorskip("transformers")
    from nbtrain.errors import InvalidPlanError
    from nbtrain.planner.plan import Plan
    from nbtrain.run.parallel.parallelize import check_plan

    model = hf_gpt2(add_cross_attention=True)
    plan = Plan.parse("0: dp_replicate=2; 1-2: tp=2; 3: dp_replicate=2", num_devices=2, num_layers=4)
    with pytest.raises(InvalidPlanError, match="GPT-2 blocks with cross-attention have no tensor-parallel split"):
        check_plan(model, plan)
    check_plan(hf_gpt2(), plan)  # without cross-attention the blocks split (tests/test_gpt2_parallel.py)


@pytest.mark.parametrize("build,devices,plan,message", [
    (llama, 4, "0: dp_replicate=4; 1-2: tp=4; 3: dp_replicate=4",
     "layer 1 (blocks.0) of GPT: tp=4 does not divide the 2 key/value heads (4 query heads share them); use a tp "
     "that divides 2: 1 or 2"),
    (gpt, 3, "0-1: dp_replicate=3; 2: tp=3; 3: dp_replicate=3",
     "layer 2 (blocks.1) of GPT: tp=3 does not divide the 4 attention heads; use a tp that divides 4: 1, 2 or 4"),
    (hf_llama, 4, "0: dp_replicate=4; 1-2: tp=4; 3: dp_replicate=4",
     "layer 1 (model.layers.0) of LlamaForCausalLM: tp=4 does not divide the 2 key/value heads"),
])
def test_a_tp_degree_that_does_not_divide_a_blocks_heads_is_refused_before_launch(build, devices, plan, message):
    if build is hf_llama:
        pytest.importorskip("transformers")
    from nbtrain.errors import InvalidPlanError
    from nbtrain.planner.plan import Plan
    from nbtrain.run.parallel.parallelize import check_plan

    with pytest.raises(InvalidPlanError) as error:
        check_plan(build(), Plan.parse(plan, num_devices=devices, num_layers=4))
    assert str(error.value).startswith(message)


def test_tp_that_divides_the_heads_and_tp_of_the_embedding_and_head_pass_the_check():
    from nbtrain.planner.plan import Plan
    from nbtrain.run.parallel.parallelize import check_plan

    # 4 ways over the vocabulary of the embedding and the head is no head split; 2 divides the 2 key/value heads
    plan = Plan.parse("0: tp=4; 1-2: dp_replicate=2 tp=2; 3: tp=4", num_devices=4, num_layers=4)
    assert check_plan(llama(), plan) is False  # not tied
