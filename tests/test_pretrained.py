"""Starting from a pretrained checkpoint, each rank reading only what it holds, and ending with a folder
``from_pretrained`` loads.

The checkpoints are written here by transformers' own ``save_pretrained`` (a Llama of its default config apart from
the sizes, its head tied to the embedding as GPT-2's is) and by nbtrain's ``save_dir``. The reference is
transformers' ``from_pretrained`` of the same folder in one process: the first step's loss (before any update) is
the loaded model's loss on the first batch.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

import nbtrain
from nbtrain.errors import InvalidArgumentError
from nbtrain.profiler.model import lm_loss
from nbtrain.run.state.pretrained import Weights
from tests import any_models as zoo
from tests.test_materialize import VOCAB, llama_config, meta_llama

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A folder as save_pretrained writes it, from a tied Llama (the file holds the embedding, not the head)."""
    from transformers import LlamaForCausalLM

    folder = tmp_path_factory.mktemp("pretrained")
    torch.manual_seed(1)
    LlamaForCausalLM(llama_config(tied=True)).save_pretrained(folder)
    return folder


def batches(steps: int = 2):
    return zoo.lm_batches(steps=steps, vocab=VOCAB)


def first_loss(folder, **kwargs) -> float:
    from transformers import AutoModelForCausalLM

    ids, targets = batches()[0]
    with torch.no_grad():
        return float(lm_loss(AutoModelForCausalLM.from_pretrained(folder, **kwargs).train()(ids), targets))


def fit(model, plan: str, processes: int = 2, **kwargs):
    return nbtrain.fit(model, batches(), plan=plan, steps=2, num_processes=processes, progress=False, timeout=240,
                       **kwargs)


@pytest.mark.parametrize("plan", ["dp_shard=2", "tp=2", "pp=2 mb=2"])
def test_a_save_pretrained_folder_loads_into_shards_with_from_pretraineds_first_loss(pretrained, plan):
    result = fit(meta_llama(tied=True), plan, weights=str(pretrained))
    assert result.losses[0] == pytest.approx(first_loss(pretrained), rel=1e-5)


def test_a_bf16_checkpoint_loads_into_an_fp32_model_as_from_pretrained_converts_it(tmp_path):
    from transformers import LlamaForCausalLM

    torch.manual_seed(2)
    LlamaForCausalLM(llama_config()).to(torch.bfloat16).save_pretrained(tmp_path)
    result = fit(meta_llama(), "dp_shard=2", weights=str(tmp_path))
    assert result.losses[0] == pytest.approx(first_loss(tmp_path, dtype=torch.float32), rel=1e-5)


def test_a_base_models_checkpoint_loads_into_the_model_with_a_head_through_its_prefix(tmp_path):
    from transformers import LlamaModel

    torch.manual_seed(3)
    LlamaModel(llama_config(tied=True)).save_pretrained(tmp_path)  # layers.0..., no "model." and no head
    result = fit(meta_llama(tied=True), "dp_shard=2", weights=str(tmp_path))
    assert result.losses[0] == pytest.approx(first_loss(tmp_path), rel=1e-5)


def test_renamed_keys_are_refused_with_what_to_give_and_load_with_a_key_mapping(pretrained, tmp_path, capsys):
    from safetensors.torch import load_file

    renamed = {k.replace("model.", "transformer.", 1): v for k, v in load_file(pretrained / "model.safetensors").items()}
    save_file(renamed, tmp_path / "model.safetensors")
    with pytest.raises(InvalidArgumentError, match="lacks .* key_mapping"):
        fit(meta_llama(tied=True), "dp_shard=2", weights=str(tmp_path))
    assert "Launching" not in capsys.readouterr().out
    result = fit(meta_llama(tied=True), "dp_shard=2",
                 weights=Weights(str(tmp_path), key_mapping={r"^transformer\.": "model."}))
    assert result.losses[0] == pytest.approx(first_loss(pretrained), rel=1e-5)


def test_a_run_saved_with_save_pretrained_loads_with_from_pretrained_and_gives_the_trained_logits(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    torch.manual_seed(4)
    model = LlamaForCausalLM(llama_config(tied=True))  # on the CPU: the trained weights come back to it too
    result = fit(model, "dp_shard=2", save_pretrained=tmp_path / "tuned")
    assert result.save_pretrained == str((tmp_path / "tuned").resolve())
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "tuned")
    ids = batches()[0][0]
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, model(ids).logits, atol=1e-5)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight


def test_a_meta_model_saved_in_shards_of_files_is_not_gathered_and_loads_from_the_folder(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from nbtrain.run.state import hf_folder

    monkeypatch.setattr(hf_folder, "SHARD_BYTES", 20_000)  # this tiny model in several files, with their index
    model = meta_llama()
    result = fit(model, "pp=2 mb=2", save_pretrained=tmp_path)
    assert not result.state_dict and model.lm_head.weight.is_meta  # nothing came back: the folder holds it
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1
    assert (tmp_path / "model.safetensors.index.json").is_file() and (tmp_path / "config.json").is_file()
    assert "written as a Hugging Face folder" in str(result)
    # the same training, gathered: the folder holds its weights
    gathered = meta_llama()
    fit(gathered, "pp=2 mb=2")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    for name, value in gathered.state_dict().items():
        assert torch.allclose(loaded.state_dict()[name], value), name


def test_a_save_dir_checkpoint_is_a_starting_point_too(tmp_path):
    from transformers import LlamaForCausalLM

    from nbtrain.run.state.weights import load_saved

    fit(meta_llama(), "dp_shard=2", save_dir=tmp_path)
    reference = load_saved(LlamaForCausalLM(llama_config()), tmp_path)  # built on the CPU: its RoPE tables too
    ids, targets = batches()[0]
    with torch.no_grad():
        expected = float(lm_loss(reference(ids), targets))
    assert fit(meta_llama(), "tp=2", weights=str(tmp_path)).losses[0] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("make, says", [
    (lambda path: path / "nowhere", "no such folder"),
    (lambda path: path, "holds neither \\*.safetensors files"),
    (lambda path: _other_size(path), "has shape .* but the model's .* is"),
    (lambda path: _integers(path), "is int64, which cannot become the model's float32"),
])
def test_bad_weights_are_one_message_before_anything_is_launched(tmp_path, make, says, capsys):
    with pytest.raises(InvalidArgumentError, match=says):
        fit(meta_llama(), "dp_shard=2", weights=str(make(tmp_path)))
    assert "Launching" not in capsys.readouterr().out


def _other_size(path):
    from transformers import LlamaForCausalLM

    config = llama_config()
    config.intermediate_size = 64
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def _integers(path):
    from transformers import LlamaForCausalLM

    state = LlamaForCausalLM(llama_config()).state_dict()
    save_file({k: (v * 100).long() if "norm" in k else v.contiguous() for k, v in state.items()},
              path / "model.safetensors")
    return path


def test_a_hugging_face_folder_without_the_safetensors_package_says_what_to_install(pretrained, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "safetensors", None)  # as on an install without transformers
    with pytest.raises(InvalidArgumentError, match="needs the safetensors package to read: pip install safetensors"):
        fit(meta_llama(tied=True), "dp_shard=2", weights=str(pretrained))
