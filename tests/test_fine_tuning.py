"""Fine-tuning as people do it trains like one process: peft's LoRA on transformers' default configs, and layers
frozen by hand, under every plan kind, their frozen weights coming back bit for bit.

A LoRA layer's base is split by the model's tensor-parallel plan and its adapters as Megatron-LM and NeMo split them
(nbtrain.models.lora: B with a column-split base, A with a row-split one); its pipeline stages run the Hugging Face
model inside peft's wrapper by its own forward. ``verify`` trains a copy in one process and one under the plan from the
same weights and batches, and fails if a frozen parameter changed by any bit (torch's ``SequenceParallel`` made frozen
norms trainable until nbtrain kept them frozen: nbtrain.models.tensor_parallel.split_module).
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


# -- adapters out, and in ---------------------------------------------------------------------------------------------

def _batches(steps: int = 3):
    import torch

    g = torch.Generator().manual_seed(0)
    return [(ids, torch.roll(ids, -1, 1)) for ids in (torch.randint(0, zoo.VOCAB, (4, 16), generator=g)
                                                       for _ in range(steps))]


def test_a_lora_run_writes_peft_adapter_folder_and_the_merged_model_and_leaves_the_base_as_it_was(tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    import nbtrain

    model = zoo.lora_qwen2()
    base = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}
    nbtrain.fit(model, _batches(), plan="dp_shard=2", steps=3, num_processes=2, progress=False, lr=1e-2,
                save_pretrained=tmp_path / "adapters", save_merged=tmp_path / "merged")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (tmp_path / "adapters").iterdir()}
    assert all(torch.equal(model.state_dict()[k], v) for k, v in base.items())  # the frozen base: bit for bit
    ids = _batches(1)[0][0]
    with torch.no_grad():
        trained = model(ids).logits
        loaded = PeftModel.from_pretrained(zoo.qwen2(), tmp_path / "adapters")(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")(ids).logits
        untrained = zoo.qwen2()(ids).logits
    assert (trained - untrained).abs().max() > 1e-3  # the adapters learned something
    assert torch.equal(loaded, trained)
    assert torch.allclose(merged, trained, atol=1e-5)


def test_a_new_lora_on_a_base_folder_then_on_its_adapter_folder_starts_where_the_files_say(tmp_path):
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model

    import nbtrain
    from nbtrain.profiler.model import lm_loss

    pretrained = zoo.qwen2()
    pretrained.save_pretrained(tmp_path / "base")

    def on_meta():
        with torch.device("meta"):
            base = type(pretrained)(pretrained.config)
        return get_peft_model(base, LoraConfig(task_type="CAUSAL_LM"))

    batches = _batches()
    first = nbtrain.fit(on_meta(), batches, plan="dp_shard=2", steps=3, num_processes=2, progress=False, lr=1e-2,
                        weights=tmp_path / "base", save_pretrained=tmp_path / "adapters")
    # a new LoRA starts as its base (B = 0): the first loss is the pretrained model's own
    assert first.losses[0] == pytest.approx(lm_loss(pretrained(batches[0][0]), batches[0][1]).item(), rel=1e-5)
    again = nbtrain.fit(on_meta(), batches[:1], plan="tp=2", steps=1, num_processes=2, progress=False,
                        weights=[tmp_path / "base", tmp_path / "adapters"])
    loaded = PeftModel.from_pretrained(zoo.qwen2(), tmp_path / "adapters")
    assert again.losses[0] == pytest.approx(lm_loss(loaded(batches[0][0]), batches[0][1]).item(), rel=1e-5)


def test_merging_into_a_base_on_the_meta_device_is_refused_before_launch():
    import torch
    from peft import LoraConfig, get_peft_model

    import nbtrain
    from nbtrain.errors import InvalidArgumentError

    with torch.device("meta"):
        model = get_peft_model(type(zoo.qwen2())(zoo.qwen2().config), LoraConfig(task_type="CAUSAL_LM"))
    with pytest.raises(InvalidArgumentError, match="save_merged merges the adapters into the base weights in the "
                                                   "notebook, where this model's base is on the meta device"):
        nbtrain.fit(model, _batches(1), plan="dp_shard=2", steps=1, num_processes=2, save_merged="merged/")


def test_under_bf16_frozen_weights_are_held_in_bf16_without_an_fp32_copy():
    # torchtune runs LoRA so: nothing updates a frozen weight, so it needs no fp32 master; held in bf16 it takes 2
    # bytes, not 4, and autocast makes no bf16 copy of it for the matmuls either
    import nbtrain

    frozen = sum(p.numel() for p in zoo.lora_llama().parameters() if not p.requires_grad)
    runs = {precision: nbtrain.fit(zoo.lora_llama(), _batches(), plan="dp_replicate=2", steps=3, num_processes=2,
                                   progress=False, precision=precision) for precision in ("fp32", "bf16")}
    fp32, bf16 = (runs[p].records[-1].tensor_bytes for p in ("fp32", "bf16"))
    assert bf16 <= fp32 - 2 * frozen, (fp32, bf16, frozen)
    assert runs["bf16"].losses == pytest.approx(runs["fp32"].losses, rel=1e-2)  # bf16's tolerance
