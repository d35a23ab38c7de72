"""Any workload profiles, not only next-token prediction: a masked LM, an image classifier (a ViT and a plain CNN),
an encoder-decoder, and causal LMs with grouped or fused projections, each fed what it takes (a tensor, a tuple or
a dict of keyword tensors), and each cut into the layers the executor cuts it into.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import nbtrain
from nbtrain.errors import ProfileError
from nbtrain.profiler.model import lm_loss
from nbtrain.profiler.trace import call_model
from tests import any_models

try:  # the executor's layers, wherever they are described now (issue 15 moves them out of run/)
    from nbtrain.models.description import layer_modules
except ImportError:
    try:
        from nbtrain.models.description import layer_slots as layer_modules
    except ImportError:
        from nbtrain.run.parallel.parallelize import layer_modules

# model -> (profiler inputs, loss, global batches); None: the profiler's default token batch and next-token loss
WORKLOADS = {
    "mistral": (None, lm_loss, any_models.lm_batches),
    "phi3": (None, lm_loss, any_models.lm_batches),
    "bert_mlm": (any_models.mlm_inputs, any_models.mlm_loss, any_models.mlm_batches),
    "vit": (any_models.image_inputs, any_models.classification_loss, any_models.image_batches),
    "t5": (any_models.t5_inputs, any_models.seq2seq_loss, any_models.t5_batches),
    "cnn": (any_models.image_inputs, any_models.classification_loss, any_models.image_batches),
}
SEQ = 16


@pytest.fixture(scope="module")
def profiles():
    """One model and its profile per workload, made once for the tests that read them."""
    made = {}

    def get(name):
        if name not in made:
            inputs, loss_fn, _ = WORKLOADS[name]
            model = getattr(any_models, name)()
            made[name] = model, nbtrain.profile(model, seq_len=SEQ, inputs=inputs,
                                                loss_fn=loss_fn if inputs else None)
        return made[name]
    return get


@pytest.mark.parametrize("name", WORKLOADS)
def test_the_profile_has_the_executors_layers(profiles, name):
    model, profile = profiles(name)
    assert len(profile.layers) == len(layer_modules(model))
    assert [layer.kind for layer in profile.layers] == ["embedding", *["block"] * (len(profile.layers) - 2), "head"]


@pytest.mark.parametrize("name", WORKLOADS)
def test_every_parameter_is_in_exactly_one_layer_tied_ones_once(profiles, name):
    model, profile = profiles(name)
    total = sum(p.numel() for p in model.parameters())  # each tied tensor once
    assert sum(layer.params for layer in profile.layers) == total
    assert profile.params == total
    assert not any("did not take part" in note for note in profile.notes)


@pytest.mark.parametrize("name, tied", [("bert_mlm", "cls.predictions.decoder.weight"), ("t5", "lm_head.weight")])
def test_a_tied_head_is_listed_as_tied_not_counted_twice(profiles, name, tied):
    _, profile = profiles(name)
    assert profile.layers[-1].tied == (tied,)


@pytest.mark.parametrize("name", WORKLOADS)
def test_every_block_costs_flops_and_saves_activations(profiles, name):
    _, profile = profiles(name)
    for block in profile.blocks:
        assert block.flops_fwd > 0 and block.flops_bwd > block.flops_fwd and block.activation_bytes > 0


def test_an_image_models_costs_do_not_depend_on_the_length_it_ignores(profiles):
    _, profile = profiles("cnn")
    assert profile.at(2, 8).flops_per_step == profile.at(2, 64).flops_per_step == 2 * profile.flops_per_step


@pytest.mark.parametrize("name", WORKLOADS)
def test_one_real_step_on_its_batches_gives_a_finite_loss_and_every_gradient(name):
    _, loss_fn, batches = WORKLOADS[name]
    model = getattr(any_models, name)().train()
    inputs, targets = batches(steps=1)[0]
    loss = loss_fn(call_model(model, inputs, {}), targets)
    loss.backward()
    assert math.isfinite(loss.item())
    assert [n for n, p in model.named_parameters() if p.grad is None] == []


def test_the_cli_data_attributes_are_lists_of_inputs_and_targets_with_rows_on_dim_0():
    for data in (any_models.MLM_DATA, any_models.IMAGE_DATA, any_models.T5_DATA):
        assert isinstance(data, list) and data
        for inputs, targets in data:
            tensors = list(inputs.values()) if isinstance(inputs, dict) else [inputs]
            assert {t.shape[0] for t in [*tensors, targets]} == {4}


def test_mlm_batches_predict_only_the_masked_positions_and_repeat_with_the_seed():
    (inputs, labels), = any_models.mlm_batches(steps=1, batch=8, seq=64)
    masked = labels != -100
    assert 0.05 < masked.float().mean() < 0.3
    assert torch.all(inputs["input_ids"][masked] == any_models.MASK_ID)
    assert torch.all(inputs["input_ids"][~masked] != any_models.MASK_ID)
    again, = any_models.mlm_batches(steps=1, batch=8, seq=64)
    assert torch.equal(again[1], labels)


class KeywordsOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, *, features, scale):
        return self.proj(features) * scale


def test_a_dict_of_inputs_reaches_the_model_as_keywords():
    def inputs(b, s, device):
        return {"features": torch.randn(b, s, 4, device=device), "scale": torch.ones(b, 1, 1, device=device)}, None

    profile = nbtrain.profile(KeywordsOnly(), batch_size=3, seq_len=5, dtype="fp32", inputs=inputs,
                              loss_fn=lambda out, _: out.sum())
    assert profile.flops_fwd == 2 * 3 * 5 * 4 * 4


def test_a_single_tensor_and_a_list_of_tensors_are_positional():
    seen = []

    class Takes(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def forward(self, x, y=None):
            seen.append(y is None)
            return self.proj(x) if y is None else self.proj(x) + y

    for args in (lambda x: x, lambda x: [x, x]):
        nbtrain.profile(Takes(), batch_size=2, seq_len=3, dtype="fp32",
                        inputs=lambda b, s, device: (args(torch.randn(b, s, 4, device=device)), None),
                        loss_fn=lambda out, _: out.sum())
    assert seen[0] and not seen[-1]


def test_float_inputs_are_made_in_the_profiles_dtype():
    profile = nbtrain.profile(any_models.cnn(), seq_len=SEQ, dtype="bf16", inputs=any_models.image_inputs,
                              loss_fn=any_models.classification_loss)
    assert profile.dtype == "bfloat16" and profile.flops_fwd > 0


def test_a_length_beyond_a_learned_position_table_is_refused_before_tracing():
    with pytest.raises(nbtrain.errors.InvalidArgumentError, match="exceeds the model's context length 64"):
        nbtrain.profile(any_models.bert_mlm(), seq_len=128, inputs=any_models.mlm_inputs, loss_fn=any_models.mlm_loss)


def test_a_model_fed_the_guessed_features_it_does_not_take_is_told_to_pass_inputs():
    says = r"fed it float features \(batch, seq, 16\), as wide as its first nn.Linear; pass inputs=lambda batch"
    with pytest.raises(ProfileError, match=says):
        nbtrain.profile(any_models.cnn(), seq_len=SEQ)


def test_a_model_whose_input_cannot_be_guessed_is_told_to_pass_inputs():
    with pytest.raises(ProfileError, match="cannot tell what Sequential takes as input.*pass inputs=.*a dict"):
        nbtrain.profile(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()), seq_len=SEQ)


def test_inputs_of_another_kind_are_refused_with_what_to_return():
    with pytest.raises(ProfileError, match="returned str arguments"):
        nbtrain.profile(KeywordsOnly(), seq_len=SEQ, inputs=lambda b, s, device: ("features", None),
                        loss_fn=lambda out, _: out.sum())


def test_measuring_feeds_the_real_model_its_keywords_too():
    profile = nbtrain.profile(any_models.bert_mlm(), seq_len=SEQ, dtype="fp32", measure="cpu",
                              inputs=any_models.mlm_inputs, loss_fn=any_models.mlm_loss)
    assert all(layer.time_fwd_s > 0 for layer in profile.layers[1:-1])
