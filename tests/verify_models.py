"""Models for tests/test_verify.py, named on the command line as ``tests.verify_models:NAME``.

Hugging Face GPT-2 and Llama from their default configs apart from the sizes (GPT-2's default dropout 0.1 on the
embeddings, the residuals and the attention weights is on), a module-level instance, a builder whose module draws
random numbers when it is imported, and models that draw random numbers in training outside dropout.
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 128
_NOISE_AT_IMPORT = torch.rand(3)  # this module draws random numbers when it is imported


def gpt2():
    """``GPT2LMHeadModel`` of the default ``GPT2Config`` at tiny sizes: dropout 0.1 in 7 places (2 blocks)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4))


def llama():
    """``LlamaForCausalLM`` of the default ``LlamaConfig`` at tiny sizes (its default attention_dropout is 0)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))


def llama_attention_dropout():
    """A tiny Llama with ``attention_dropout=0.1``: a probability the attention reads from its own attribute
    (``self.attention_dropout``) at forward time, not from an ``nn.Dropout``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                        attention_dropout=0.1))


def llama_built_after_import_noise():
    """A builder (of a model without dropout) in a module that drew random numbers at import
    (``_NOISE_AT_IMPORT``, and ``gpt2_instance``'s initial weights)."""
    return llama()


with torch.random.fork_rng(devices=[]):
    torch.manual_seed(0)
    gpt2_instance = gpt2()
"""A module-level instance: ``verify tests.verify_models:gpt2_instance`` must train copies, never this object."""


class NoisySiLU(nn.Module):
    """SiLU plus Gaussian noise in training (``torch.randn_like``): a random op that is not dropout, so no setting
    can make one process and several draw the same numbers."""

    def forward(self, x):
        y = nn.functional.silu(x)
        return y + 0.1 * torch.randn_like(y) if self.training else y


def noisy_llama():
    """The tiny default Llama with a noisy activation in its first block's MLP."""
    model = llama()
    model.model.layers[0].mlp.act_fn = NoisySiLU()
    return model


class ConfigDropoutLM(nn.Module):
    """A tiny language model whose forward reads its dropout probability from its config, as Falcon and GPT-Neo's
    attention do (``self.config.attention_dropout``): no ``nn.Dropout`` and no probability of its own."""

    def __init__(self, vocab: int = VOCAB, dim: int = 16):
        super().__init__()
        from types import SimpleNamespace

        self.config = SimpleNamespace(hidden_dropout=0.1, hidden_size=dim)
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        h = nn.functional.dropout(self.embed(ids), p=self.config.hidden_dropout, training=self.training)
        return self.head(h)
