"""Fine-tuning as people do it trains like one process: peft's LoRA on transformers' default configs, and layers
frozen by hand, under every plan kind, their frozen weights coming back bit for bit.

A LoRA layer's base is split by the model's tensor-parallel plan and its adapters as Megatron-LM and NeMo split them
(nbtrain.models.lora: B with a column-split base, A with a row-split one); its pipeline stages run the Hugging Face
model inside peft's wrapper by its own forward. ``verify`` trains a copy in one process and one under the plan from the
same weights and batches, and fails if a frozen parameter changed by any bit (torch's ``SequenceParallel`` made frozen
norms trainable until nbtrain kept them frozen: nbtrain.run.parallel.parallelize.split_module).
"""

from __future__ import annotations

import pytest

from nbtrain.models.description import describe
from nbtrain.run.verify import verify
import tests.any_models as zoo

pytestmark = pytest.mark.slow

MIX = "0: tp=2; 1-2: dp_shard=2 ac; 3: tp=2"
"""A per-layer mix: the embedding and head tensor-parallel, the blocks sharded and checkpointed."""


def _check(model: str, plan: str, processes: int = 2):
    report = verify(f"tests.any_models:{model}", plan, processes=processes, steps=3, batch=4, seq=16, timeout=240)
    assert report.ok, str(report)
    assert report.frozen > 0 and not report.frozen_moved
    assert max(report.loss_differences) <= 1e-4


@pytest.mark.parametrize("plan", ["dp_replicate=2", "dp_shard=2", "tp=2", "tp=2 sp", "pp=2 mb=2", MIX,
                                  "dp_replicate=2 offload=1", "dp_shard=2 zero=2 offload=1"])
def test_lora_on_every_linear_layer_of_a_transformers_llama_trains_like_one_process(plan):
    _check("lora_llama", plan)


@pytest.mark.parametrize("plan", ["dp_shard=2 ac", "tp=2", "pp=2 mb=2"])
def test_lora_with_peft_defaults_on_a_transformers_qwen2_trains_like_one_process(plan):
    _check("lora_qwen2", plan)


@pytest.mark.parametrize("plan", ["dp_replicate=2", "dp_shard=2 zero=2", "tp=2 sp", "pp=2 mb=2",
                                  "dp_shard=2 offload=1"])
def test_a_qwen2_with_its_embedding_and_first_block_frozen_by_hand_trains_like_one_process(plan):
    _check("frozen_qwen2", plan)


def test_lora_in_a_pipeline_with_tensor_parallel_stages_on_four_processes_trains_like_one_process():
    _check("lora_llama", "pp=2 mb=2 | tp=2", processes=4)


def test_a_lora_models_tensor_parallel_plan_is_its_base_models_with_the_adapters_split_beside_it():
    d = describe(zoo.lora_llama())
    block = dict(d.tensor_parallel[1])
    prefix = "base_model.model.model.layers.0"
    assert block[f"{prefix}.self_attn.q_proj.base_layer"] == "colwise"
    assert block[f"{prefix}.self_attn.q_proj.lora_B.default"] == "colwise"  # B by its output features
    assert f"{prefix}.self_attn.q_proj.lora_A.default" not in block  # A whole
    assert block[f"{prefix}.self_attn.o_proj.lora_A.default"] == "rowwise"  # A by its input features
    assert f"{prefix}.self_attn.o_proj.lora_B.default" not in block  # B whole
    assert d.stages == "hf-decoder" and not d.no_tensor_parallel
