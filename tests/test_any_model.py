"""Models nbtrain did not write train under every plan kind exactly as in one process: transformers Mistral, Qwen2,
Qwen3 (a norm on each head), Phi-3 (fused projections), a BERT masked LM (tied decoder, dict batches), a ViT image classifier, a T5
encoder-decoder, and a plain-torch CNN, each built from a default config in tests/any_models.py (no downloads).

What the executor knows of each comes from one description (nbtrain.models.description): the layers the profiler
cuts, the tensor-parallel plan the model's config carries (or the user's), where pipelines may be cut. Where a plan
kind cannot run, the refusal names the model and the reason, and the planner never offers it.
"""

from __future__ import annotations

import pytest
import torch

import nbtrain
import tests.any_models as zoo
from nbtrain.errors import InvalidPlanError
from nbtrain.run.verify import verify

pytestmark = pytest.mark.slow

MIX = "0: tp=2; 1-2: dp_shard=2 ac; 3: tp=2"
"""A per-layer mix: the embedding and head tensor-parallel, the blocks sharded and checkpointed (a relayout each way)."""

BERT_TP = {"bert.encoder.layer.*.attention.self.query": "colwise", "bert.encoder.layer.*.attention.self.key": "colwise",
           "bert.encoder.layer.*.attention.self.value": "colwise",
           "bert.encoder.layer.*.attention.output.dense": "rowwise",
           "bert.encoder.layer.*.intermediate.dense": "colwise", "bert.encoder.layer.*.output.dense": "rowwise"}
"""A user's tensor-parallel plan for BERT, whose config carries none: Megatron's split of its attention and MLP."""

VIT_TP = {"vit.layers.*.attention.q_proj": "colwise", "vit.layers.*.attention.k_proj": "colwise",
          "vit.layers.*.attention.v_proj": "colwise", "vit.layers.*.attention.o_proj": "rowwise",
          "vit.layers.*.mlp.fc1": "colwise", "vit.layers.*.mlp.fc2": "rowwise"}
"""The same split for ViT, whose config carries no plan either."""


def _check(model: str, plan: str, processes: int = 2, timeout: float = 180, **workload):
    report = verify(f"tests.any_models:{model}", plan, processes=processes, steps=5, batch=4, seq=16, timeout=timeout,
                    **workload)
    assert report.ok, str(report)
    assert max(report.loss_differences) <= 1e-4


DECODER_PLANS = ["dp_replicate=2", "dp_shard=2 zero=2", "dp_shard=2 ac", "tp=2", "pp=2 mb=2",
                 "dp_replicate=2 offload=1", MIX]


@pytest.mark.parametrize("plan", DECODER_PLANS)
def test_a_transformers_mistral_trains_like_one_process(plan):
    _check("mistral", plan)


@pytest.mark.parametrize("plan", ["tp=2", "pp=2 mb=2", "dp_shard=2 zero=2 ac", "dp_replicate=2 offload=1", MIX])
def test_a_transformers_phi3_with_fused_qkv_and_gate_up_trains_like_one_process(plan):
    _check("phi3", plan)


@pytest.mark.parametrize("plan", ["dp_replicate=2", "dp_shard=2 zero=2 ac", "tp=2", "pp=2 mb=2",
                                  "dp_replicate=2 offload=1", "0: dp_shard=2; 1-2: dp_replicate=2 ac; 3: dp_shard=2"])
def test_a_transformers_qwen2_trains_like_one_process(plan):
    _check("qwen2", plan)


@pytest.mark.parametrize("plan", ["tp=2", "tp=2 sp", "tp=2 offload=1", MIX])
def test_a_transformers_qwen3_with_a_norm_on_each_heads_queries_and_keys_trains_like_one_process(plan):
    # its own plan runs q_norm and k_norm on each rank's heads ("replicated_with_grad_allreduce"): their gradients,
    # each rank's over its own heads, must be summed, or the ranks' norms part after the first update
    _check("qwen3", plan)


def test_a_transformers_qwen3_sharded_and_tensor_parallel_on_four_processes_trains_like_one_process():
    _check("qwen3", "dp_shard=2 tp=2", processes=4, timeout=240)


@pytest.mark.parametrize("plan", ["dp_replicate=2", "dp_shard=2 zero=2", "dp_shard=2 ac", "tp=2", "pp=2 mb=2",
                                  "dp_shard=2 offload=1", "0: dp_shard=2; 1-2: dp_replicate=2 ac; 3: dp_shard=2"])
def test_a_bert_masked_lm_with_dict_batches_trains_like_one_process(plan):
    _check("bert_mlm", plan, data=zoo.mlm_batches(steps=2), loss_fn=zoo.mlm_loss, tp_plan=BERT_TP)


@pytest.mark.parametrize("plan", ["dp_replicate=2", "dp_shard=2 zero=2", "dp_shard=2 ac", "tp=2", "pp=2 mb=2",
                                  "dp_replicate=2 offload=1", "0: dp_replicate=2; 1-2: dp_shard=2 ac; 3: dp_replicate=2"])
def test_a_vit_image_classifier_trains_like_one_process(plan):
    _check("vit", plan, data=zoo.image_batches(steps=2), loss_fn=zoo.classification_loss, tp_plan=VIT_TP)


@pytest.mark.parametrize("plan", ["dp_replicate=2", "dp_shard=2", "dp_shard=2 zero=2 ac", "pp=2 mb=2",
                                  "0: dp_shard=2 ac; 1-2: dp_replicate=2; 3: dp_shard=2 ac"])
def test_a_t5_encoder_decoder_trains_like_one_process(plan):
    _check("t5", plan, data=zoo.t5_batches(steps=2), loss_fn=zoo.seq2seq_loss)


@pytest.mark.parametrize("plan", ["dp_replicate=2", "dp_shard=2 zero=2", "dp_shard=2 ac", "pp=2 mb=2",
                                  "dp_replicate=2 offload=1", "0: dp_replicate=2; 1-3: dp_shard=2 ac; 4: dp_replicate=2"])
def test_a_plain_torch_cnn_with_a_list_of_residual_blocks_trains_like_one_process(plan):
    _check("cnn", plan, data=zoo.image_batches(steps=2), loss_fn=zoo.classification_loss)


@pytest.mark.parametrize("plan", ["dp_shard=2 ac", "0: dp_replicate=2; 1-3: dp_shard=2; 4: dp_replicate=2 offload=1"])
def test_a_plain_torch_language_model_trains_like_one_process(plan):
    _check("plain_lm", plan)


def test_traced_pipeline_stages_shard_checkpoint_and_sum_a_tied_decoder_across_four_processes():
    # BERT's decoder is tied to the word embeddings, which sit in the other stage: each stage holds a copy, sharded
    # by FSDP2 inside the stage, and the two sum their gradients; a block of each kind: ZeRO-3, ZeRO-3 and checkpointed
    plan = "pp=2 mb=2 | 0: dp_shard=2 zero=2; 1: dp_shard=2 zero=3; 2: dp_shard=2 zero=3 ac; 3: dp_shard=2 zero=2"
    report = verify("tests.any_models:bert_mlm", plan, processes=4, steps=5, batch=4, seq=16, timeout=240,
                    data=zoo.mlm_batches(steps=2), loss_fn=zoo.mlm_loss)
    assert report.ok, str(report)
    assert max(report.loss_differences) <= 1e-4


def test_a_model_without_repeated_blocks_is_one_unit_under_sharding_and_checkpointing():
    for plan in ("dp_shard=2 ac", "dp_replicate=2"):
        _check("one_layer", plan, data=zoo.feature_batches(), loss_fn=zoo.regression_loss)


def test_a_user_tensor_parallel_plan_splits_a_plain_torch_model():
    plan = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}
    _check("plain_lm", "tp=2", tp_plan=plan)


@pytest.mark.parametrize("model, plan, says", [
    ("bert_mlm", "pp=2 tp=2", "layer 0 asks for tp=2 in a pipeline of BertForMaskedLM, whose stages are traced "
                              "graphs"),
    ("gated_lm", "pp=2 mb=2", "GatedLM could not be traced into pipeline stages"),
    ("cnn", "tp=2", "ResidualCNN has no tensor-parallel plan"),
    ("t5", "tp=2", "T5ForConditionalGeneration has no tensor-parallel plan"),
    ("t5", "dp_shard=2 offload=1", "the CPU update offload of an encoder-decoder (T5ForConditionalGeneration) does "
                                   "not yet train like one process"),
])
def test_what_cannot_run_is_refused_naming_the_model_and_the_reason(model, plan, says):
    data = {"vit": zoo.image_batches, "cnn": zoo.image_batches, "t5": zoo.t5_batches, "bert_mlm": zoo.mlm_batches,
            "gated_lm": lambda steps: zoo.lm_batches(steps=steps, vocab=64)}[model](steps=1)
    loss = {"vit": zoo.classification_loss, "cnn": zoo.classification_loss, "t5": zoo.seq2seq_loss,
            "bert_mlm": zoo.mlm_loss}.get(model)
    extra = {"loss_fn": loss} if loss else {}
    if model == "bert_mlm":
        extra["tp_plan"] = BERT_TP
    processes = 4 if "tp=2" in plan and "pp=2" in plan else 2
    with pytest.raises(InvalidPlanError, match=None) as error:  # in the notebook, before any worker starts
        nbtrain.fit(getattr(zoo, model)(), data, plan=plan, steps=1, num_processes=processes, progress=False, **extra)
    assert says in str(error.value)


@pytest.mark.parametrize("model", ["mistral", "qwen2", "phi3", "bert_mlm", "vit", "t5", "cnn", "plain_lm"])
def test_the_planner_never_recommends_what_the_executor_refuses(model):
    from nbtrain.run.fit import plan_for

    inputs = {"bert_mlm": zoo.mlm_inputs, "vit": zoo.image_inputs, "t5": zoo.t5_inputs, "cnn": zoo.image_inputs}
    losses = {"bert_mlm": zoo.mlm_loss, "vit": zoo.classification_loss, "t5": zoo.seq2seq_loss,
              "cnn": zoo.classification_loss}
    built = getattr(zoo, model)()
    profile = nbtrain.profile(built, seq_len=16, inputs=inputs.get(model), loss_fn=losses.get(model))
    for devices in (2, 4, 8):
        cluster = nbtrain.Cluster.from_catalog("H100", num_devices=devices)
        best = nbtrain.plan(profile, cluster, global_batch=8, seq_len=16, top=8)
        for plan in (best, *best.alternatives):
            plan_for(built, plan, devices, global_batch=8, seq_len=16)  # raises InvalidPlanError if refused


def test_the_layers_are_what_runs_before_the_blocks_each_block_and_what_runs_after():
    from nbtrain.models.description import layer_slots, slot_module

    model = zoo.qwen2()
    layers = [[slot_module(parent, attr) for parent, attr in slots] for slots in layer_slots(model)]
    assert layers[0] == [model.model.embed_tokens]
    assert layers[1:3] == [[model.model.layers[0]], [model.model.layers[1]]]
    assert layers[3] == [model.model.norm, model.lm_head]  # the rotary table has no parameters: nothing to shard
    profile = nbtrain.profile(model, seq_len=16)
    assert len(profile.layers) == len(layers)  # the planner's layers are the executor's


def test_gradient_accumulation_trains_like_one_batch_of_all_the_rows():
    batches = zoo.lm_batches(steps=4, batch=4, seq=16)
    joined = [(torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]])) for a, b in zip(batches[::2], batches[1::2])]
    accumulated = nbtrain.fit(zoo.qwen2(), batches, plan="dp_shard=2", steps=2, accumulate=2, num_processes=2,
                              progress=False)
    whole = nbtrain.fit(zoo.qwen2(), joined, plan="dp_shard=2", steps=2, num_processes=2, progress=False)
    assert accumulated.plan.microbatches == 2 and accumulated.plan.global_batch == 8
    assert accumulated.losses == pytest.approx(whole.losses, rel=1e-5)


def test_a_users_optimizer_factory_is_called_on_each_ranks_parameters():
    batches = zoo.lm_batches(steps=2, batch=4, seq=16)
    sgd = nbtrain.fit(zoo.qwen2(), batches, plan="dp_shard=2", steps=2, num_processes=2, progress=False, clip_norm=None,
                      optimizer=lambda groups: torch.optim.SGD(groups, lr=0.5))
    reference = zoo.qwen2()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    losses = []
    for ids, targets in batches:
        loss = nbtrain.profiler.model.lm_loss(reference(ids, use_cache=False), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert sgd.losses == pytest.approx(losses, rel=1e-4)
    with pytest.raises(nbtrain.errors.InvalidArgumentError, match="the offloaded update stays AdamW"):
        nbtrain.fit(zoo.qwen2(), batches, plan="dp_replicate=2 offload=1", steps=1, num_processes=2, progress=False,
                    optimizer=lambda groups: torch.optim.SGD(groups, lr=0.5))


def test_the_magic_launches_a_qwen2_and_gives_its_weights_back(shell):
    result = shell.run_cell("%%autoparallel --gpus 2 --batch 4 --seq 16 -q --launch --processes 2 --steps 2 -o qw\n"
                            "from tests.any_models import qwen2\nqwen = qwen2()\n")
    assert result.success, result.error_in_exec
    trained = shell.user_ns["qw_result"]
    assert len(trained.losses) == 2
    assert all(torch.equal(shell.user_ns["qwen"].state_dict()[k], v) for k, v in trained.state_dict.items())
