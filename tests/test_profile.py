"""The profiler: its FLOPs and activation bytes agree with independent references, at any batch and length.

References:
* FLOPs: the per-token training formula of Chowdhery et al. 2022 (PaLM, appendix B), ``6N + 12·L·H·Q·T``,
  where N counts the weights that take part in matrix multiplies. The attention kernel a CPU (or GPU) run uses
  is flash attention, whose backward recomputes the ``Q·Kᵀ`` scores (Dao et al. 2022, Algorithm 4): one more
  ``2·T·H·Q`` per token and layer, so the reference is ``6N + 14·L·H·Q·T``.
* Activation bytes: a real CPU forward, whose autograd graph is walked node by node for the tensors it saved
  (a different mechanism from the profiler's fake tensors and saved-tensor hooks).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nbtrain
from nbtrain.errors import InvalidArgumentError, ProfileError
from nbtrain.models import GPT, GPTConfig
from nbtrain.profiler.model import lm_loss
from nbtrain.profiler.result import ModelProfile


def matmul_weights(model: nn.Module) -> int:
    """N of the PaLM formula: weights of every Linear, the output head included (counted once if tied)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def palm_flops_per_step(model, n_layer, n_head, head_dim, batch, seq) -> int:
    per_token = 6 * matmul_weights(model) + 14 * n_layer * n_head * head_dim * seq
    return per_token * batch * seq


SMALL = GPTConfig(vocab_size=300, block_size=128, n_layer=3, n_head=4, n_embd=64)


@pytest.mark.parametrize("batch,seq", [(1, 16), (3, 40), (2, 128)])
def test_gpt_flops_per_step_equal_the_palm_formula_with_flash_recompute(batch, seq):
    model = GPT(SMALL)
    prof = nbtrain.profile(model, batch_size=batch, seq_len=seq, dtype="fp32")
    expected = palm_flops_per_step(model, SMALL.n_layer, SMALL.n_head, SMALL.head_dim, batch, seq)
    assert prof.flops_per_step == expected


def test_llama_preset_flops_equal_the_palm_formula_at_4096_tokens():
    model = nbtrain.build_preset("llama-7b")
    prof = nbtrain.profile(model, batch_size=1, seq_len=4096)
    c = model.config
    assert prof.flops_per_step == palm_flops_per_step(model, c.n_layer, c.n_head, c.head_dim, 1, 4096)


def test_transformers_llama_flops_equal_the_palm_formula():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=172, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(cfg)
    prof = nbtrain.profile(model, batch_size=2, seq_len=48, dtype="fp32")
    assert prof.family == "hf-llama" and len(prof.blocks) == 3
    assert prof.flops_per_step == palm_flops_per_step(model, 3, 4, 16, 2, 48)


# -- activation bytes against a real CPU forward ---------------------------------------------------------------

def saved_bytes_in_graph(output: torch.Tensor, exclude: list[torch.Tensor], stop_at=None) -> int:
    """Bytes of the distinct storages that the autograd graph behind ``output`` holds for backward."""
    excluded = {t.untyped_storage().data_ptr() for t in exclude}
    storages: dict[int, int] = {}
    seen, stack = set(), [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen or node is stop_at:
            continue
        seen.add(node)
        for attr in dir(node):
            if not attr.startswith("_saved_"):
                continue
            value = getattr(node, attr)
            for t in value if isinstance(value, (tuple, list)) else [value]:
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in excluded:
                    storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        stack.extend(next_node for next_node, _ in node.next_functions)
    return sum(storages.values())


def _real_step_saved_bytes(model, ids, targets) -> int:
    loss = lm_loss(model(ids), targets)
    return saved_bytes_in_graph(loss, exclude=list(model.parameters()))


@pytest.mark.parametrize("config", [
    SMALL,
    GPTConfig(vocab_size=300, block_size=128, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, ffn_hidden=96,
              norm="rmsnorm", mlp="swiglu", position="rope", bias=False, tie_embeddings=False),
], ids=["gpt2-style", "llama-style"])
def test_total_activation_bytes_equal_what_a_real_cpu_step_saves(config):
    torch.manual_seed(0)
    model = GPT(config)
    ids, targets = torch.randint(0, 300, (2, 96)), torch.randint(0, 300, (2, 96))
    prof = nbtrain.profile(model, batch_size=2, seq_len=96, dtype="fp32")
    assert prof.activation_bytes == _real_step_saved_bytes(model, ids, targets)


def test_one_block_saves_what_the_real_block_saves_including_its_input():
    torch.manual_seed(0)
    model = GPT(SMALL)
    x = torch.randn(3, 50, SMALL.n_embd, requires_grad=True)
    real = saved_bytes_in_graph(model.blocks[0](x), exclude=list(model.parameters()))
    prof = nbtrain.profile(model, batch_size=3, seq_len=50, dtype="fp32")
    assert prof.layers[1].activation_bytes == real


def test_transformers_llama_activation_bytes_equal_a_real_cpu_step():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(cfg).train()
    ids, targets = torch.randint(0, 128, (2, 40)), torch.randint(0, 128, (2, 40))
    prof = nbtrain.profile(model, batch_size=2, seq_len=40, dtype="fp32")
    loss = lm_loss(model(ids, use_cache=False), targets)
    assert prof.activation_bytes == saved_bytes_in_graph(loss, exclude=list(model.parameters()))


def test_bf16_profile_saves_half_the_bytes_of_fp32_in_the_blocks():
    fp32 = nbtrain.profile("gpt-tiny", batch_size=2, seq_len=64, dtype="fp32")
    bf16 = nbtrain.profile("gpt-tiny", batch_size=2, seq_len=64, dtype="bf16")
    # every tensor a block saves is an activation of the compute dtype, except attention's fp32 logsumexp
    ratio = bf16.layers[1].activation_bytes / fp32.layers[1].activation_bytes
    assert 0.5 <= ratio < 0.52


# -- layers, parameters, scaling -------------------------------------------------------------------------------

def test_layers_are_embeddings_then_each_block_then_the_head():
    prof = nbtrain.profile("gpt2", batch_size=1, seq_len=64)
    assert [layer.name for layer in prof.layers] == ["embed", *[f"blocks.{i}" for i in range(12)], "head"]
    assert prof.layers[0].flops_fwd == 0  # an embedding lookup does no multiply-adds


def test_layer_parameters_add_up_to_the_model_and_a_tied_head_is_counted_once():
    prof = nbtrain.profile("gpt2", batch_size=1, seq_len=64)
    assert sum(layer.params for layer in prof.layers) == prof.params == 124_439_808
    assert prof.layers[-1].tied == ("head.lm_head.weight",)


def test_the_hidden_state_between_blocks_is_batch_times_length_times_width_times_dtype_bytes():
    prof = nbtrain.profile("llama-7b", batch_size=2, seq_len=512, dtype="bf16")
    assert prof.layers[1].output_bytes == 2 * 512 * 4096 * 2


@pytest.mark.parametrize("model", ["gpt-tiny", "llama-tiny"])
def test_a_profile_moved_to_another_shape_equals_a_fresh_profile_there(model):
    moved = nbtrain.profile(model, batch_size=2, seq_len=64).at(batch_size=5, seq_len=200)
    fresh = nbtrain.profile(model, batch_size=5, seq_len=200)
    assert moved.layers == fresh.layers
    assert not moved.notes


def test_profile_round_trips_through_json():
    prof = nbtrain.profile("llama-tiny", batch_size=2, seq_len=32)
    again = ModelProfile.from_dict(__import__("json").loads(prof.to_json()))
    assert again == prof
    assert again.at(4, 100).flops_per_step == prof.at(4, 100).flops_per_step


def test_a_model_without_repeated_blocks_is_one_layer_with_a_note():
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    prof = nbtrain.profile(model, batch_size=2, seq_len=8, dtype="fp32")
    assert [layer.kind for layer in prof.layers] == ["model"]
    assert prof.layers[0].params == 16 * 32 + 32 + 32 * 4 + 4
    assert any("one layer" in note for note in prof.notes)


def test_a_custom_model_with_a_list_of_identical_blocks_is_cut_at_the_blocks():
    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(8, 32)
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(4))
            self.out = nn.Linear(32, 2)

        def forward(self, x):
            x = self.inp(x)
            for layer in self.layers:
                x = layer(x)
            return self.out(x)

    prof = nbtrain.profile(Stack(), batch_size=2, seq_len=5, dtype="fp32")
    assert [layer.name for layer in prof.layers] == ["embed", "layers.0", "layers.1", "layers.2", "layers.3", "head"]
    assert prof.layers[0].params == 8 * 32 + 32 and prof.layers[-1].params == 32 * 2 + 2
    assert prof.layers[1].flops_fwd == 2 * 2 * 5 * 32 * 32


def test_measuring_times_every_layer_on_the_cpu():
    prof = nbtrain.profile("gpt-tiny", batch_size=2, seq_len=32, dtype="fp32", measure="cpu")
    assert prof.measured_on == "cpu"
    assert all(layer.time_fwd_s > 0 and layer.time_bwd_s > 0 for layer in prof.blocks)
    assert "fwd (cpu)" in str(prof)


def test_the_layers_are_timed_with_the_tensor_count_the_cpu_trainer_pays_every_step(monkeypatch):
    """Off a GPU the trainer counts the tensors each step saves for backward (:mod:`nbtrain.tensor_memory`: a hook
    on every saved tensor, ~10 µs each), and every step pays it; the layers are timed with the count on, so that
    what is priced is what runs. A count made 2 ms slower a tensor shows in the measured forward in full."""
    import time

    from nbtrain.tensor_memory import SavedActivations

    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        model(torch.randn(2, 8, 16))  # what one forward of the model saves, counted by autograd's own hook
    count = SavedActivations._pack

    def slow_count(self, t):
        time.sleep(0.002)
        return count(self, t)

    monkeypatch.setattr(SavedActivations, "_pack", slow_count)
    prof = nbtrain.profile(model, batch_size=2, seq_len=8, dtype="fp32", measure="cpu")
    assert len(saved) >= 3
    assert sum(layer.time_fwd_s for layer in prof.layers) >= 0.002 * len(saved)


def test_a_measured_layer_keeps_the_part_of_its_time_that_rows_do_not_scale(monkeypatch):
    """The layers are timed at the profile's rows and again at one row; the line through the two gives the part of
    each time that every call pays whatever its rows, kept within both times (a busy moment can time one row slower
    than eight)."""
    from nbtrain.profiler import trace

    prof = nbtrain.profile("gpt-tiny", batch_size=8, seq_len=32, dtype="fp32", measure="cpu")
    assert all(0 <= layer.time_fwd_fixed_s <= layer.time_fwd_s and 0 <= layer.time_bwd_fixed_s <= layer.time_bwd_s
               for layer in prof.layers)

    timed = {8: {"time_fwd_s": {0: 0.010, 1: 0.004}, "time_bwd_s": {0: 0.020, 1: 0.004}},  # seconds at 8 rows
             1: {"time_fwd_s": {0: 0.003, 1: 0.005}, "time_bwd_s": {0: 0.005, 1: 0.0001}}}  # and at one
    monkeypatch.setattr(trace, "time_step", lambda step, b, s, device: {k: dict(v) for k, v in timed[b].items()})
    split = trace.time_with_fixed_part(None, 8, 32, "cpu")
    assert split["time_fwd_fixed_s"][0] == pytest.approx((8 * 0.003 - 0.010) / 7)  # 2 ms, and 1 ms a row
    assert split["time_bwd_fixed_s"][0] == pytest.approx((8 * 0.005 - 0.020) / 7)
    assert split["time_fwd_fixed_s"][1] == pytest.approx(0.004)  # one row timed slower than eight: all of it
    assert split["time_bwd_fixed_s"][1] == 0.0  # eight rows 40x one: nothing fixed


def test_profiling_leaves_the_model_as_it_was():
    model = nbtrain.build_preset("gpt-tiny", device="cpu").eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    nbtrain.profile(model, batch_size=2, seq_len=16, measure="cpu")
    assert not model.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


# -- display ---------------------------------------------------------------------------------------------------

def test_table_folds_identical_blocks_and_shows_totals_and_adam_memory():
    text = str(nbtrain.profile("llama-70b", batch_size=1, seq_len=128))
    assert "blocks.0-79" in text and "×80" in text and "total" in text
    assert "plain Adam training on one device" in text and "GiB" in text
    html = nbtrain.profile("gpt-tiny", batch_size=1, seq_len=16)._repr_html_()
    assert '<table class="nbtrain-table">' in html and "blocks.0-3" in html


def test_adam_memory_is_sixteen_bytes_per_parameter_plus_activations():
    prof = nbtrain.profile("gpt-tiny", batch_size=1, seq_len=16, dtype="bf16")
    memory = prof.adam_training_bytes()
    assert memory["params"] + memory["grads"] + memory["optimizer"] == 16 * prof.params
    assert memory["activations"] == prof.activation_bytes


# -- bad input -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,match", [
    ({"batch_size": 0}, "batch size must be a positive integer"),
    ({"seq_len": -1}, "sequence length must be a positive integer"),
    ({"seq_len": 4096}, "exceeds the model's context length 256"),
    ({"dtype": "int7"}, "unknown dtype"),
])
def test_bad_arguments_are_clear_errors(kwargs, match):
    with pytest.raises(InvalidArgumentError, match=match):
        nbtrain.profile("gpt-tiny", **kwargs)


def test_a_model_whose_forward_fails_on_the_default_inputs_says_how_to_give_inputs():
    class NeedsTwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)

        def forward(self, ids, mask):
            return self.emb(ids) * mask

    with pytest.raises(ProfileError, match="pass inputs="):
        nbtrain.profile(NeedsTwoInputs(), batch_size=1, seq_len=4)


def test_custom_inputs_and_loss_are_used():
    model = nn.Sequential(nn.Linear(6, 6))
    prof = nbtrain.profile(model, batch_size=3, seq_len=4, dtype="fp32",
                           inputs=lambda b, s, device: ((torch.randn(b, s, 6, device=device),), None),
                           loss_fn=lambda out, _: out.sum())
    assert prof.flops_fwd == 2 * 3 * 4 * 6 * 6
