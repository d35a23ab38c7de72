"""A GPT built the way karpathy/nanoGPT's ``model.py`` builds it (written here, not copied): a ``ModuleDict`` named
``transformer`` holding the token and position embeddings, dropout, a ``ModuleList`` of blocks and the last norm;
an ``lm_head`` whose weight the token embedding takes (``transformer.wte.weight = lm_head.weight``); and the loss
computed inside ``forward(idx, targets)``, which returns ``(logits, loss)`` (the loss None without targets). Dropout
is on, as nanoGPT's default config has it (0.0 in its config; 0.1 here so that a test sees it).

    >>> model = nano_gpt()
    >>> logits, loss = model(idx, targets)          # dict batches: {"idx": x, "targets": y}
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, CONTEXT, WIDTH, HEADS, DEPTH, DROPOUT = 96, 32, 32, 4, 2, 0.1


class SelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(WIDTH, 3 * WIDTH)  # q, k and v in one projection
        self.c_proj = nn.Linear(WIDTH, WIDTH)
        self.attn_dropout, self.resid_dropout = nn.Dropout(DROPOUT), nn.Dropout(DROPOUT)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(WIDTH, dim=2)
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(c // HEADS)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        weights = self.attn_dropout(scores.masked_fill(~causal, float("-inf")).softmax(dim=-1))
        y = (weights @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)
        self.dropout = nn.Dropout(DROPOUT)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(WIDTH), SelfAttention(), nn.LayerNorm(WIDTH), MLP()

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(VOCAB, WIDTH), wpe=nn.Embedding(CONTEXT, WIDTH), drop=nn.Dropout(DROPOUT),
            h=nn.ModuleList(Block() for _ in range(DEPTH)), ln_f=nn.LayerNorm(WIDTH)))
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # the tie, as nanoGPT makes it

    def forward(self, idx, targets=None):
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(positions))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None  # generation: the last position only
        logits = self.lm_head(x)
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


def nano_gpt() -> NanoGPT:
    torch.manual_seed(0)
    return NanoGPT()


def dict_batches(steps: int = 2, batch: int = 4, seq: int = 16) -> list:
    """Batches as a nanoGPT user holds them for nbtrain: the model's keywords, targets inside (no separate ones)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        window = torch.randint(0, VOCAB, (batch, seq + 1), generator=g)
        x, y = window[:, :-1].contiguous(), window[:, 1:].contiguous()  # stacked rows, as get_batch makes them
        out.append(({"idx": x, "targets": y}, y))
    return out


def second_output(output, targets):
    """The loss a user writes for it: the model's own, its output's second element."""
    return output[1]


class TiedLM(nn.Module):
    """Plain torch, a head tied to the token embedding by assignment (``head.weight = tokens.weight``), the loss
    outside: the logits of every position."""

    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.tokens.weight

    def forward(self, ids):
        x = self.tokens(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def tied_lm() -> TiedLM:
    torch.manual_seed(0)
    return TiedLM()
