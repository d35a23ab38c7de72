"""A profile that counts a few of each kind of identical block (nbtrain/profiler/twins.py, issue 46) is the profile
that counts every block, field by field: on nbtrain's GPT, a transformers Llama (whose first block alone saves the
shared RoPE tables), models whose layers differ (Cohere 2 and Gemma 3: sliding-window and global layers; Jamba:
Mamba and attention layers, every second one a mixture of experts; gpt-oss: both, with experts), a Mixtral, and
models where blocks cannot stand in for each other (another input that needs a gradient; blocks run out of order),
which are counted in full."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import nbtrain
from nbtrain.models import GPT, GPTConfig
from nbtrain.models.adapters import detect_family, set_training
from nbtrain.models.experts import expert_facts
from nbtrain.profiler import model as profiler_model
from nbtrain.profiler.model import lm_loss
from nbtrain.profiler.trace import Step, count
from nbtrain.profiler.twins import block_groups, stand_in_plan
from tests import any_models

transformers = pytest.importorskip("transformers")


def profiles_both_ways(model, monkeypatch, **kwargs):
    """``(profile with stand-ins, profile of every block, whether the asked shape's count used stand-ins)``."""
    used = []
    real_count = profiler_model.count

    def count(step, b, s):
        counts = real_count(step, b, s)
        used.append(counts.stood_in)
        return counts

    with monkeypatch.context() as m:
        m.setattr(profiler_model, "count", count)
        fast = nbtrain.profile(model, **kwargs)
    with monkeypatch.context() as m:
        m.setattr(profiler_model, "stand_in_plan", lambda groups: None)  # every block counted
        full = nbtrain.profile(model, **kwargs)
    return fast, full, used[0]


def fields(profile) -> dict:
    out = dataclasses.asdict(profile)
    out.pop("profile_seconds")
    return out


def counts_both_ways(model, batch: int = 1, seq: int = any_models.LONG):
    """The fake step's counts at one shape, with stand-ins and of every block, as the profiler takes them (its
    profile is these counts at the asked shape and six small ones, and the parameters of the layers where modules
    outside the blocks first ran)."""
    family, moe = detect_family(model), expert_facts(model)
    blocks, vocab = family.blocks(model), family.vocab_size

    def tokens(b, s, device):
        return (torch.randint(0, vocab, (b, s), device=device),), torch.randint(0, vocab, (b, s), device=device)

    step = Step(model, family, blocks, tokens, lm_loss, torch.float32, experts=moe.experts if moe else 0,
                twins=stand_in_plan(block_groups(model, blocks)))
    set_training(model)
    inside = {m for block in blocks for m in block.modules()}
    out = []
    for twins in (step.twins, None):
        counts = count(dataclasses.replace(step, twins=twins), batch, seq)
        outside = {name: counts.module_segment.get(m) for name, m in model.named_modules() if m not in inside}
        out.append((counts.stood_in, counts.values, outside, counts.expected_routing))
    return out


def llama_gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=128, block_size=128, n_layer=5, n_head=4, n_kv_head=2, n_embd=32,
                         norm="rmsnorm", mlp="swiglu", position="rope", bias=False, tie_embeddings=False))


def hf_llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**any_models.SIZES, "num_hidden_layers": 7},
                                                                  num_key_value_heads=2))


def cohere2():  # S S S G S S S: six sliding layers, a global one
    torch.manual_seed(0)
    return transformers.Cohere2ForCausalLM(transformers.Cohere2Config(
        **any_models.DIFFERING, num_hidden_layers=7, sliding_window=any_models.WINDOW, pad_token_id=0,
        bos_token_id=1, eos_token_id=2))


def gemma3():  # five sliding layers, a global one, a sliding one
    torch.manual_seed(0)
    return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        **any_models.DIFFERING, num_hidden_layers=7, head_dim=8, sliding_window=any_models.WINDOW))


def jamba():  # Mamba layers with a dense MLP, and at layer 3 attention with 4 experts
    torch.manual_seed(0)
    return transformers.JambaForCausalLM(transformers.JambaConfig(
        **any_models.DIFFERING, num_hidden_layers=6, num_experts=4, attn_layer_period=6, attn_layer_offset=3,
        expert_layer_period=6, expert_layer_offset=3, mamba_d_state=4))


def gpt_oss():  # sliding and global layers in turn, each a mixture of 4 experts
    torch.manual_seed(0)
    sizes = {k: v for k, v in any_models.DIFFERING.items() if k != "max_position_embeddings"}
    return transformers.GptOssForCausalLM(transformers.GptOssConfig(
        **sizes, num_hidden_layers=10, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=any_models.WINDOW))


def mixtral():
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **{**any_models.SIZES, "num_hidden_layers": 5}, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2))


TWINS = {"nbtrain_gpt": llama_gpt, "transformers_llama": hf_llama, "cohere2": cohere2, "gemma3": gemma3,
         "jamba": jamba, "gpt_oss": gpt_oss, "mixtral": mixtral}


def test_the_profile_of_a_few_twins_is_the_profile_of_every_block_on_nbtrains_gpt(monkeypatch):
    fast, full, stood_in = profiles_both_ways(llama_gpt(), monkeypatch, seq_len=any_models.LONG, dtype="fp32")
    assert stood_in, "the shortcut was not taken: this test would compare the full count with itself"
    assert fields(fast) == fields(full)


@pytest.mark.parametrize("name", TWINS)
def test_counting_a_few_twins_counts_what_counting_every_block_does(name):
    # Jamba's Mamba layers run their reference scan token by token on the CPU: a short sequence (it has no window)
    seq = 8 if name == "jamba" else any_models.LONG
    (stood_in, values, outside, routing), (_, every, every_outside, every_routing) = \
        counts_both_ways(TWINS[name](), seq=seq)
    assert stood_in, "the shortcut was not taken: this test would compare the full count with itself"
    assert values == every
    assert outside == every_outside and routing == every_routing


def test_the_first_block_of_a_transformers_llama_costs_more_and_is_counted_apart():
    """Hugging Face computes the RoPE tables once; the first block saves them for backward, the others share them:
    the stand-ins take the third block's figures, not the first's."""
    (_, values, _, _), (_, every, _, _) = counts_both_ways(hf_llama())
    saved = values["activation_bytes"]
    assert saved[1] > saved[2] == saved[5] == every["activation_bytes"][5]  # segment i + 1 is block i


@pytest.mark.parametrize("name,kinds", [("cohere2", [0, 0, 0, 1, 0, 0, 0]),
                                        ("gemma3", [0, 0, 0, 0, 0, 1, 0]),
                                        ("jamba", [0, 0, 0, 1, 0, 0])])
def test_sliding_and_global_or_mamba_and_attention_layers_are_never_twins(name, kinds):
    model = TWINS[name]()
    assert block_groups(model, list(model.model.layers)) == kinds


class BiasedBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm, self.proj = nn.LayerNorm(width), nn.Linear(width, width)

    def forward(self, x, bias):
        return x + self.proj(self.norm(x) + bias)


class PassedBiasLM(nn.Module):
    """Blocks that each take a bias computed once from a learned table (as T5's blocks take its position bias): its
    gradient adds up across the blocks, which a block standing in for its twin would not send back."""

    def __init__(self, layers: int = 7, width: int = 16, vocab: int = 64):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.bias = nn.Parameter(torch.zeros(width))
        self.blocks = nn.ModuleList(BiasedBlock(width) for _ in range(layers))
        self.head = nn.Linear(width, vocab)

    def forward(self, ids):
        x, bias = self.tokens(ids), self.bias.tanh()
        for block in self.blocks:
            x = block(x, bias)
        return self.head(x)


@pytest.mark.parametrize("make", [PassedBiasLM, lambda: any_models.LastToFirstLM(depth=7)],
                         ids=["another input that needs a gradient", "blocks run last to first"])
def test_blocks_that_cannot_stand_in_for_their_twins_are_all_counted(make):
    torch.manual_seed(0)
    model = make()
    assert stand_in_plan(block_groups(model, list(model.blocks))) is not None  # twins, to the eye
    (stood_in, values, _, _), (_, every, _, _) = counts_both_ways(model, seq=16)
    assert not stood_in
    assert values == every


def lora_llama():
    """peft's LoRA on a transformers Llama as a fine-tuning notebook builds it: the base frozen, adapters on q, v."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(hf_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))


def test_a_lora_models_blocks_are_twins_and_a_few_of_them_count_what_every_block_does(monkeypatch):
    """peft keeps each adapter layer's path (``kwargs["target_name"]``, ``model.layers.3.self_attn.q_proj``): that
    names a block, as ``layer_idx`` does. Its first block differs from the others (after the frozen embedding it
    computes no input gradient), so the probes run two blocks; a 7B LoRA profiled every block took 20-45 s here."""
    pytest.importorskip("peft")
    lora = lora_llama()
    assert set(block_groups(lora, detect_family(lora).blocks(lora))) == {0}
    probed = []
    real_fit_segments = profiler_model._fit_segments

    def fit_segments(step):
        probed.append(len(step.blocks))
        return real_fit_segments(step)

    monkeypatch.setattr(profiler_model, "_fit_segments", fit_segments)
    fast = nbtrain.profile(lora, seq_len=any_models.LONG, dtype="fp32")
    assert probed[-1] == 2, probed  # the shortcut was taken: two blocks stood for seven
    monkeypatch.setattr(profiler_model, "stand_in_plan", lambda groups: None)
    monkeypatch.setattr(profiler_model, "_only_blocks", None)  # every block counted and probed
    full = nbtrain.profile(lora, seq_len=any_models.LONG, dtype="fp32")
    assert probed[-1] == 7
    assert fields(fast) == fields(full)
    trained = [layer.trained_params for layer in fast.layers]
    assert 0 == trained[0] < trained[1] == trained[7] and trained[-1] == 0  # adapters only, in every block
