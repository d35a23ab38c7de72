"""Decoders whose layers differ train like one process under pipelines, or are refused before launch saying why.

Sliding-window and global attention alternate in Cohere 2, Gemma 3, OLMo 3 and gpt-oss (``config.layer_types``: a
mask per layer type, in OLMo 3 and Gemma 3 a RoPE table per layer type too); Jamba interleaves Mamba and attention
layers of two classes in one list. Each is built from its transformers default config apart from the sizes, with a
window of 16 tokens, and trains on sequences of 40: a window as long as the sequence masks nothing, and a test on
such sequences would prove nothing. A pipeline stage runs its layers by the model's own forward
(nbtrain.models.stages), and before anything trains nbtrain checks, in the notebook, that the stages chained compute
what the forward does (nbtrain.run.parallel.stage_check).
"""

from __future__ import annotations

import pytest
import torch

import nbtrain
import tests.any_models as zoo
from nbtrain.errors import InvalidPlanError
from nbtrain.models.adapters import smallest_window
from nbtrain.models.description import describe
from nbtrain.planner.plan import Plan
from nbtrain.run.parallel.stage_check import check_stages
from nbtrain.run.verify import verify

MODELS = ["cohere2", "olmo3", "gemma3_text", "gpt_oss", "jamba"]


def _check(model: str, plan: str, processes: int = 2):
    report = verify(f"tests.any_models:{model}", plan, processes=processes, steps=3, batch=4, seq=zoo.LONG,
                    timeout=240)
    assert report.ok, str(report)
    assert max(report.loss_differences) <= 1e-4
    assert not report.notes  # the window was exercised


def _layers(model: str) -> int:
    return len(describe(getattr(zoo, model)()).layers)


def test_the_sequences_outgrow_every_sliding_window_of_these_models():
    for name in MODELS[:4]:
        assert smallest_window(getattr(zoo, name)()) == zoo.WINDOW < zoo.LONG, name
    assert smallest_window(zoo.jamba()) is None  # Mamba and global attention: no window to outgrow


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_a_two_stage_pipeline_trains_like_one_process(model):
    _check(model, "pp=2 mb=2")


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_a_two_stage_pipeline_with_a_per_layer_mix_of_checkpointing_trains_like_one_process(model):
    last = _layers(model) - 1
    _check(model, f"pp=2 mb=2 | 0-1: ac; 2: ac=op; 3-{last}:")


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_sharded_data_parallel_trains_like_one_process(model):
    _check(model, "dp_shard=2")


@pytest.mark.slow
def test_jambas_attention_layers_split_by_tensor_parallelism_beside_its_whole_mamba_layers_train_like_one_process():
    # layers: 0 embedding, 1 Mamba, 2 attention (+ experts), 3 Mamba, 4 attention, 5 head
    _check("jamba", "0-1: dp_shard=2; 2: tp=2; 3: dp_shard=2; 4: tp=2; 5: dp_shard=2")


def test_tensor_parallelism_on_jambas_mamba_layers_is_refused_before_launch_naming_the_layer():
    model = zoo.jamba()
    ids = torch.randint(0, zoo.VOCAB, (4, zoo.LONG))
    with pytest.raises(InvalidPlanError, match=r"layer 1 \(model\.layers\.0\) of JambaForCausalLM asks for tp=2, "
                                               r"but JambaConfig\.base_model_tp_plan splits none of its modules "
                                               r"\(JambaMambaDecoderLayer; the plan splits model\.layers\.1\.self_attn"):
        nbtrain.fit(model, [(ids, ids)], plan="tp=2", steps=1, num_processes=2)


def test_a_model_without_a_tensor_parallel_plan_is_told_how_to_write_one_in_its_own_module_names():
    model = zoo.per_layer_input_gpt()
    description = describe(model, {"head.lm_head": "colwise"})  # a plan that splits none of its blocks
    assert "'blocks.*.block.attn.q': 'colwise'" in description.no_tensor_parallel
    assert "'blocks.*.block.attn.o': 'rowwise'" in description.no_tensor_parallel
    assert "blocks.*.fc1" not in description.no_tensor_parallel  # nbtrain's own GPT's names, not this model's


def test_a_stage_that_computes_differently_stops_fit_before_the_first_update_naming_the_layer():
    # a user's GPT whose forward gives each block a scale of its own: a stage calls a block on the hidden state alone
    model = zoo.per_layer_input_gpt()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, zoo.VOCAB, (4, 16))
    with pytest.raises(InvalidPlanError, match=r"nbtrain stopped before training: in pipeline stage 0, layer 2 "
                                               r"\(blocks\.1\) of PerLayerInputGPT does not compute what "
                                               r"PerLayerInputGPT's forward does"):
        nbtrain.fit(model, [(ids, torch.roll(ids, -1, 1))], plan="pp=2 mb=2", steps=2, num_processes=2)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing trained


def test_the_stage_check_passes_each_of_these_models_split_anywhere_and_leaves_it_as_it_was():
    for name in MODELS:
        model = zoo.__dict__[name]()
        model.train()
        d = describe(model)
        ids = torch.randint(0, zoo.VOCAB, (2, zoo.LONG))
        rng = torch.get_rng_state()
        for stages in ((1, len(d.layers) - 1), (len(d.layers) - 1, 1), (2, len(d.layers) - 2)):
            plan = Plan.parse(f"pp=2 mb=2 stages={stages[0]}+{stages[1]}", num_devices=2, num_layers=len(d.layers))
            assert check_stages(model, d, plan, ids) is not None
        assert model.training and all(m.training for m in model.modules())
        assert torch.equal(torch.get_rng_state(), rng)


def test_the_planner_prices_tensor_parallelism_only_on_the_blocks_jambas_plan_splits():
    from nbtrain.planner.cost import UNRUNNABLE, CostModel
    from nbtrain.planner.strategy import Strategy

    profile = nbtrain.profile(zoo.jamba(), batch_size=1, seq_len=zoo.LONG)
    assert profile.arch["tp_unsplit_layers"] == [1, 3]  # the Mamba layers; 2 and 4 are attention
    cluster = nbtrain.Cluster.from_catalog("cpu", num_devices=2)
    model = CostModel(profile, cluster, global_batch=4)
    split = Strategy(tp=2)
    assert model.layer(1, split, 1).memory.total >= UNRUNNABLE  # no budget holds it: the search never takes it
    assert model.layer(2, split, 1).memory.total < 1e9
    hybrid = nbtrain.plan(profile, cluster, global_batch=4, strategy="0-1: dp_shard=2; 2: tp=2; 3: dp_shard=2; "
                                                                       "4: tp=2; 5: dp_shard=2")
    assert hybrid.predicted.step_time_s > 0
    with pytest.raises(InvalidPlanError, match=r"layer 1 \(model\.layers\.0\) of JambaForCausalLM: tp=2, but the "
                                               r"model's tensor-parallel plan splits none of its modules"):
        nbtrain.plan(profile, cluster, global_batch=4, strategy="tp=2")
    megatron = next(b for b in nbtrain.baselines(profile, cluster, global_batch=4) if b.name.startswith("Megatron"))
    assert megatron.plan is None and "splits none of layer 1's modules" in megatron.note
