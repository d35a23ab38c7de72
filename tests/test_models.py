"""The reference GPT: presets have the published sizes, and the code computes what GPT-2 and LLaMA compute.

Independent references: the parameter counts of the released checkpoints, and Hugging Face ``transformers``'
implementations of GPT-2 and Llama, whose weights are copied into nbtrain's GPT and must give the same logits.
"""

from __future__ import annotations

import pytest
import torch

from nbtrain.errors import UnknownModelError
from nbtrain.models import GPT, GPTConfig, build_preset, preset_config

# Released checkpoints: GPT-2 (OpenAI, as loaded by transformers) and LLaMA-2 (Touvron et al. 2023, Table 1 rounds
# these to 7B/13B/70B; the model cards give 6.74B, 13.0B and 69.0B).
PUBLISHED_PARAMS = {
    "gpt2": 124.4e6, "gpt2-medium": 354.8e6, "gpt2-large": 774.0e6, "gpt2-xl": 1557.6e6,
    "llama-7b": 6.74e9, "llama-13b": 13.0e9, "llama-70b": 68.98e9,
}


@pytest.mark.parametrize("name", PUBLISHED_PARAMS)
def test_preset_parameter_count_matches_the_published_model_within_half_a_percent(name):
    model = build_preset(name)  # meta device: nothing allocated
    assert model.num_params() == pytest.approx(PUBLISHED_PARAMS[name], rel=5e-3)


def test_presets_are_built_on_the_meta_device_by_default():
    model = build_preset("llama-70b")
    assert all(p.is_meta for p in model.parameters())


def test_an_unknown_preset_is_an_error_that_lists_the_known_ones():
    with pytest.raises(UnknownModelError, match="gpt2, gpt2-medium"):
        preset_config("gpt-5")


def test_config_rejects_heads_that_do_not_divide_the_width():
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(n_embd=100, n_head=3)


def test_gpt_is_causal_later_tokens_do_not_change_earlier_logits():
    torch.manual_seed(0)
    model = build_preset("llama-tiny", device="cpu")
    ids = torch.randint(0, 512, (1, 12))
    changed = ids.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 512
    torch.testing.assert_close(model(ids)[:, :8], model(changed)[:, :8])


# -- equivalence with Hugging Face implementations ------------------------------------------------------------

def _copy_llama_weights(hf, ours: GPT) -> None:
    sd = hf.state_dict()
    names = {"embed.wte.weight": "model.embed_tokens.weight", "head.ln_f.weight": "model.norm.weight",
             "head.lm_head.weight": "lm_head.weight"}
    per_block = {"ln_1.weight": "input_layernorm.weight", "ln_2.weight": "post_attention_layernorm.weight",
                 "attn.q.weight": "self_attn.q_proj.weight", "attn.k.weight": "self_attn.k_proj.weight",
                 "attn.v.weight": "self_attn.v_proj.weight", "attn.o.weight": "self_attn.o_proj.weight",
                 "mlp.gate.weight": "mlp.gate_proj.weight", "mlp.fc1.weight": "mlp.up_proj.weight",
                 "mlp.fc2.weight": "mlp.down_proj.weight"}
    for i in range(ours.config.n_layer):
        names.update({f"blocks.{i}.{k}": f"model.layers.{i}.{v}" for k, v in per_block.items()})
    ours.load_state_dict({k: sd[v] for k, v in names.items()}, strict=True)


def _copy_gpt2_weights(hf, ours: GPT) -> None:
    sd = hf.state_dict()
    d = ours.config.n_embd
    new = {"embed.wte.weight": sd["transformer.wte.weight"], "embed.wpe.weight": sd["transformer.wpe.weight"],
           "head.ln_f.weight": sd["transformer.ln_f.weight"], "head.ln_f.bias": sd["transformer.ln_f.bias"],
           "head.lm_head.weight": sd["transformer.wte.weight"]}
    for i in range(ours.config.n_layer):
        h, b = f"transformer.h.{i}.", f"blocks.{i}."
        # HF GPT-2 uses Conv1D (weight stored as in × out) and one fused q|k|v projection.
        qkv_w, qkv_b = sd[h + "attn.c_attn.weight"].t(), sd[h + "attn.c_attn.bias"]
        for j, name in enumerate("qkv"):
            new[b + f"attn.{name}.weight"] = qkv_w[j * d:(j + 1) * d]
            new[b + f"attn.{name}.bias"] = qkv_b[j * d:(j + 1) * d]
        new[b + "attn.o.weight"] = sd[h + "attn.c_proj.weight"].t()
        new[b + "attn.o.bias"] = sd[h + "attn.c_proj.bias"]
        new[b + "mlp.fc1.weight"], new[b + "mlp.fc1.bias"] = sd[h + "mlp.c_fc.weight"].t(), sd[h + "mlp.c_fc.bias"]
        new[b + "mlp.fc2.weight"], new[b + "mlp.fc2.bias"] = sd[h + "mlp.c_proj.weight"].t(), sd[h + "mlp.c_proj.bias"]
        for ln in ("ln_1", "ln_2"):
            new[b + f"{ln}.weight"], new[b + f"{ln}.bias"] = sd[h + f"{ln}.weight"], sd[h + f"{ln}.bias"]
    ours.load_state_dict(new, strict=True)


def test_llama_shaped_gpt_computes_the_same_logits_as_transformers_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   rms_norm_eps=1e-5, tie_word_embeddings=False)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    ours = GPT(GPTConfig(vocab_size=97, block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=64,
                         ffn_hidden=160, norm="rmsnorm", mlp="swiglu", position="rope", bias=False,
                         tie_embeddings=False)).eval()
    assert ours.num_params() == sum(p.numel() for p in hf.parameters())
    _copy_llama_weights(hf, ours)
    ids = torch.randint(0, 97, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids, use_cache=False).logits, rtol=1e-4, atol=1e-5)


def test_gpt2_shaped_gpt_computes_the_same_logits_as_transformers_gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=97, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    ours = GPT(GPTConfig(vocab_size=97, block_size=64, n_layer=2, n_head=4, n_embd=64)).eval()
    assert ours.num_params() == sum(p.numel() for p in hf.parameters())
    _copy_gpt2_weights(hf, ours)
    ids = torch.randint(0, 97, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids, use_cache=False).logits, rtol=1e-4, atol=1e-5)


def test_training_mode_is_set_as_torch_defines_it_without_a_librarys_own_train_on_top():
    """transformers ≥ 5.25 re-kernelizes a from_pretrained model inside its train(), which fails on the meta device
    (where nbtrain's workers first hold a big model) and swaps in Hub kernels; nbtrain sets the flags torch sets."""
    from torch import nn

    from nbtrain.models.adapters import set_training

    class KernelizesOnTrain(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Sequential(nn.Linear(2, 2, device="meta"), nn.Dropout(0.1))

        def train(self, mode: bool = True):
            raise ValueError("Unsupported device type 'meta'")

    model = KernelizesOnTrain()
    for module in model.modules():
        module.training = False  # as from_pretrained hands it over: in eval mode
    assert set_training(model) is model
    assert all(module.training for module in model.modules())
    assert not any(module.training for module in set_training(model, False).modules())
