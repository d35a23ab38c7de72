"""Models built on the meta device: planned in the notebook without memory, materialised in the workers, each rank
allocating only what it holds, and trained as one process trains them from the same seed.

The one-process reference is ``fit`` in one process on the same meta model: it materialises the model the same way
(each module initialised under the seed and its name), so equal losses say that sharding, splitting and cutting the
model into stages changed nothing. What that initialisation gives is checked apart, against what does not depend on
a seed: a model built on the CPU has the same norms and RoPE tables, and its weights the same spread.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nbtrain
from nbtrain.errors import InvalidArgumentError
from nbtrain.models import GPT, GPTConfig
from tests import any_models as zoo

pytestmark = pytest.mark.slow

VOCAB = 128
STEPS = 3


def llama_config(tied: bool = False):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=tied)


def meta_llama(tied: bool = False):
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        return LlamaForCausalLM(llama_config(tied))


def meta_gpt(tied: bool):
    config = GPTConfig(vocab_size=VOCAB, block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden=48,
                       norm="rmsnorm", mlp="swiglu", position="rope", bias=False, tie_embeddings=tied)
    with torch.device("meta"):
        return GPT(config)


def train(model, plan: str, processes: int, **kwargs):
    return nbtrain.fit(model, zoo.lm_batches(steps=STEPS, vocab=VOCAB), plan=plan, steps=STEPS,
                       num_processes=processes, progress=False, timeout=240, **kwargs)


def assert_same_losses(result, reference):
    for got, want in zip(result.losses, reference.losses, strict=True):
        assert abs(got - want) <= 1e-4 * abs(want), (result.losses, reference.losses)


@pytest.fixture(scope="module")
def llama_reference():
    model = meta_llama()
    return train(model, "dp_replicate=1", 1), model


@pytest.mark.parametrize("plan", ["dp_shard=2", "tp=2", "pp=2 mb=2"])
def test_a_transformers_llama_built_on_meta_trains_like_one_process(plan, llama_reference):
    reference, reference_model = llama_reference
    model = meta_llama()
    assert_same_losses(train(model, plan, 2), reference)
    # the notebook's model now holds the trained weights, in host memory, where the meta tensors were
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    for (name, got), want in zip(model.state_dict().items(), reference_model.state_dict().values()):
        assert torch.allclose(got, want, atol=1e-5), name


@pytest.mark.parametrize("plan, tied", [("dp_shard=2", True), ("tp=2", False), ("pp=2 mb=2", False),
                                        ("0: dp_shard=2; 1: tp=2 ac; 2: dp_replicate=2; 3: dp_shard=2", True)])
def test_nbtrains_gpt_built_on_meta_trains_like_one_process(plan, tied):
    model = meta_gpt(tied)
    assert_same_losses(train(model, plan, 2), train(meta_gpt(tied), "dp_replicate=1", 1))
    assert (model.head.lm_head.weight is model.embed.wte.weight) == tied  # one parameter again in the notebook


def test_every_plan_starts_from_the_models_own_initialisation():
    from transformers import LlamaForCausalLM

    # lr=0: the weights that come back are the initial ones
    starts = {}
    for plan, processes in [("dp_replicate=1", 1), ("dp_shard=2", 2), ("tp=2", 2)]:
        model = meta_llama()
        train(model, plan, processes, lr=0.0)
        starts[plan] = model.state_dict() | dict(model.named_buffers())
    one = starts["dp_replicate=1"]
    for plan in ("dp_shard=2", "tp=2"):
        assert all(torch.equal(starts[plan][k], v) for k, v in one.items()), plan
    torch.manual_seed(0)
    on_cpu = LlamaForCausalLM(llama_config())
    expected = dict(on_cpu.named_buffers()) | on_cpu.state_dict()
    for name, value in one.items():
        if "norm" in name or "rotary" in name:  # no randomness in them: exactly a CPU-built model's
            assert torch.equal(value, expected[name]), name
        elif name.endswith("proj.weight") or name.endswith("lm_head.weight"):
            # transformers' _init_weights: N(0, initializer_range = 0.02), as on the CPU
            assert abs(value.std().item() - expected[name].std().item()) < 0.004, name
    projections = [k for k in one if k.endswith("q_proj.weight")]
    assert not torch.equal(one[projections[0]], one[projections[1]]), "each module draws its own values"


class Scaled(nn.Module):
    """A parameter of its own and no reset_parameters: nothing knows how to initialise it."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x) * self.scale


def test_a_meta_model_nothing_initialises_is_refused_before_launching_and_init_fn_fixes_it(capsys):
    with torch.device("meta"):
        model = Scaled()
    batches = zoo.feature_batches(steps=1, width=4)
    with pytest.raises(InvalidArgumentError, match="nothing initialises scale .*init_fn"):
        nbtrain.fit(model, batches, plan="dp_shard=2", steps=1, num_processes=2, loss_fn=zoo.regression_loss)
    assert "Launching" not in capsys.readouterr().out

    def init_fn(module):
        if isinstance(module, Scaled):
            nn.init.ones_(module.scale)
        else:
            module.reset_parameters()

    nbtrain.fit(model, batches, plan="dp_shard=2", steps=1, num_processes=2, loss_fn=zoo.regression_loss,
                init_fn=init_fn, progress=False, timeout=240)
    assert torch.all(model.scale != 0) and not model.proj.weight.is_meta


class Tabled(nn.Module):
    """A table computed in __init__ (a buffer) that no initialisation sets again."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("table", torch.arange(4.0), persistent=False)

    def forward(self, x):
        return self.proj(x) + self.table


def test_a_buffer_nothing_sets_is_named_before_launching():
    with torch.device("meta"):
        model = Tabled()
    with pytest.raises(InvalidArgumentError, match="table .*Tabled.*built on the meta device.*init_fn"):
        nbtrain.fit(model, zoo.feature_batches(steps=1, width=4), plan="dp_shard=2", steps=1, num_processes=2,
                    loss_fn=zoo.regression_loss)


def test_a_model_partly_on_meta_is_refused():
    model = zoo.plain_lm()
    model.head.to_empty(device="meta")
    with pytest.raises(InvalidArgumentError, match="partly on the meta device"):
        nbtrain.fit(model, zoo.lm_batches(steps=1, vocab=64), plan="dp_shard=2", steps=1, num_processes=2)


def test_fit_in_one_process_reads_the_notebooks_model_and_never_copies_it_whole(monkeypatch):
    model = zoo.plain_lm()  # built on the CPU, as a notebook holds it
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def copied(self, memo):
        raise AssertionError("a parameter of the notebook's model was copied whole")

    monkeypatch.setattr(nn.Parameter, "__deepcopy__", copied)
    result = nbtrain.fit(model, zoo.lm_batches(steps=2, vocab=64), plan="dp_replicate=1", steps=2, num_processes=1,
                         progress=False)
    assert len(result.losses) == 2
    assert all(not torch.equal(v, before[k]) for k, v in model.state_dict().items())  # the trained weights, back
    before_step, during = result.rank_memory[0]  # shown in the step table, beside each other
    assert 0 < before_step <= during and "peak memory once the model is in place" in str(result)
