"""Models nbtrain did not write, built from configs (no downloads), for tests/test_any_model.py and `nbtrain verify`."""

from __future__ import annotations

import torch
from torch import nn


def qwen2():
    """A transformers Qwen2 of its default config apart from the sizes (grouped-query attention, untied head)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


class ResidualMLP(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class PlainLM(nn.Module):
    """Plain torch, no transformers: token embedding, a list of residual MLP blocks, a head."""

    def __init__(self, vocab: int = 64, width: int = 32, depth: int = 3):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(ResidualMLP(width) for _ in range(depth))
        self.head = nn.Linear(width, vocab)

    def forward(self, ids):
        x = self.tokens(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def plain_lm():
    torch.manual_seed(0)
    return PlainLM()
