"""Models nbtrain did not write train under data parallel, FSDP2, checkpointing, offload and per-layer mixes exactly
as in one process: the executor derives their layers from the list of repeated blocks, as the profiler does.

Tensor and pipeline parallelism of such models are issue 15's next parts; until then the planner does not offer them
and the executor refuses them by name.
"""

from __future__ import annotations

import pytest
import torch

import nbtrain
from nbtrain.run.verify import verify

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("plan", ["dp_replicate=2", "dp_shard=2", "dp_shard=2 zero=2 ac", "dp_replicate=2 offload=1",
                                  "0: dp_shard=2; 1-2: dp_replicate=2 ac; 3: dp_shard=2"])
def test_a_transformers_qwen2_trains_like_one_process(plan):
    report = verify("tests.any_models:qwen2", plan, processes=2, steps=3, batch=4, seq=16, timeout=180)
    assert report.ok, str(report)


@pytest.mark.parametrize("plan", ["dp_shard=2 ac", "0: dp_replicate=2; 1-3: dp_shard=2; 4: dp_replicate=2 offload=1"])
def test_a_plain_torch_model_with_a_list_of_blocks_trains_like_one_process(plan):
    report = verify("tests.any_models:plain_lm", plan, processes=2, steps=3, batch=4, seq=16, timeout=180)
    assert report.ok, str(report)


def test_the_layers_are_what_runs_before_the_blocks_each_block_and_what_runs_after():
    from nbtrain.models.description import layer_slots, slot_module
    from tests.any_models import qwen2

    model = qwen2()
    layers = [[slot_module(parent, attr) for parent, attr in slots] for slots in layer_slots(model)]
    assert layers[0] == [model.model.embed_tokens]
    assert layers[1:3] == [[model.model.layers[0]], [model.model.layers[1]]]
    assert layers[3] == [model.model.norm, model.lm_head]  # the rotary table has no parameters: nothing to shard
    profile = nbtrain.profile(model, seq_len=16)
    assert len(profile.layers) == len(layers)  # the planner's layers are the executor's


def test_the_planner_offers_such_a_model_only_what_the_executor_runs():
    from nbtrain.planner.search import executor_problem
    from tests.any_models import qwen2

    profile = nbtrain.profile(qwen2(), seq_len=16)
    best = nbtrain.plan(profile, nbtrain.Cluster.from_catalog("H100", num_devices=8), global_batch=8, seq_len=16)
    for plan in (best, *best.alternatives):
        assert plan.pp == 1 and all(s.tp == 1 for s in plan.layers) and not executor_problem(profile, plan)


def test_tensor_and_pipeline_parallel_plans_of_such_a_model_are_refused_by_name(capsys):
    from nbtrain.cli import main

    for plan, says in [("tp=2", "no tensor-parallel split of Qwen2ForCausalLM's layers"),
                       ("pp=2 mb=2", "pipeline stages of Qwen2ForCausalLM are not supported yet")]:
        assert main(["verify", "tests.any_models:qwen2", "--strategy", plan, "--processes", "2"]) == 2
        assert says in capsys.readouterr().err


def test_the_magic_launches_a_qwen2_and_gives_its_weights_back(shell):
    result = shell.run_cell("%%autoparallel --gpus 2 --batch 4 --seq 16 -q --launch --processes 2 --steps 2 -o qw\n"
                            "from tests.any_models import qwen2\nqwen = qwen2()\n")
    assert result.success, result.error_in_exec
    trained = shell.user_ns["qw_result"]
    assert len(trained.losses) == 2
    assert all(torch.equal(shell.user_ns["qwen"].state_dict()[k], v) for k, v in trained.state_dict.items())
