"""A small, readable decoder-only transformer: GPT-2 and LLaMA shapes from one class.

The model is a plain sequence ``embed → blocks[0..n) → head``, each block taking and returning the residual
stream ``(batch, seq, n_embd)``. That is the cut every parallel axis needs: pipeline stages are contiguous
ranges of it, activation checkpointing wraps a block, tensor parallelism splits the linear layers inside a
block (``attn.q/k/v`` column-wise, ``attn.o`` row-wise, ``mlp.fc1``/``mlp.gate`` column-wise, ``mlp.fc2``
row-wise), and attention reshapes with ``view(B, T, -1, head_dim)`` so a rank holding a slice of the heads
computes just those.

    >>> import torch
    >>> from nbtrain.models import GPT, GPTConfig
    >>> model = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64))
    >>> model(torch.randint(0, 256, (2, 16))).shape
    torch.Size([2, 16, 256])

Packed rows (several documents per row, :mod:`nbtrain.data`) pass ``doc_ids``: attention stays inside each
document and positions restart at each one, so every document gets the logits it has alone:

    >>> from nbtrain.data import pack
    >>> rows = pack([torch.randint(0, 256, (n,)) for n in (9, 4, 3)], bound=16)
    >>> model(rows.ids, doc_ids=rows.doc_ids).shape
    torch.Size([1, 16, 256])
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from nbtrain.data import document_mask, document_positions
from nbtrain.errors import InvalidArgumentError


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a :class:`GPT`. The defaults are GPT-2 small (124M parameters)."""

    vocab_size: int = 50257
    """Number of token ids."""
    block_size: int = 1024
    """Longest sequence the model accepts (the learned position table's length; a cap for RoPE)."""
    n_layer: int = 12
    """Number of transformer blocks."""
    n_head: int = 12
    """Attention heads per block."""
    n_embd: int = 768
    """Width of the residual stream."""
    n_kv_head: int | None = None
    """Key/value heads (grouped-query attention, LLaMA-2 70B); ``None`` means ``n_head``."""
    ffn_hidden: int | None = None
    """Width of the MLP's hidden layer; ``None`` means ``4 * n_embd``."""
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    """GPT-2 uses LayerNorm, LLaMA RMSNorm."""
    mlp: Literal["gelu", "swiglu"] = "gelu"
    """GPT-2: ``fc2(gelu(fc1 x))``; LLaMA: ``fc2(silu(gate x) * fc1 x)``."""
    position: Literal["learned", "rope"] = "learned"
    """GPT-2 adds a learned position table; LLaMA rotates queries and keys (RoPE)."""
    bias: bool = True
    """Whether linear layers and norms carry biases (GPT-2 yes, LLaMA no)."""
    tie_embeddings: bool = True
    """Whether the output head shares the token embedding's weight (GPT-2 yes, LLaMA no)."""
    norm_eps: float = 1e-5
    """Epsilon of the norms."""
    rope_theta: float = 10000.0
    """Base of the RoPE frequencies."""

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if self.n_head % self.kv_heads:
            raise ValueError(f"n_head={self.n_head} must be divisible by n_kv_head={self.kv_heads}")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def hidden(self) -> int:
        return self.ffn_hidden or 4 * self.n_embd


def _norm(config: GPTConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.n_embd, eps=config.norm_eps)
    return nn.LayerNorm(config.n_embd, eps=config.norm_eps, bias=config.bias)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # RoPE in the "rotate half" layout LLaMA's reference code uses (Su et al. 2021, eq. 34).
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    """Causal self-attention with separate q/k/v/o projections (so tensor parallelism can split each).

    With ``doc_ids`` (``[batch, seq]``, :func:`nbtrain.data.document_mask`) a token attends only to earlier tokens
    of its own document, and RoPE rotates by its position within that document."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.q = nn.Linear(config.n_embd, config.n_head * config.head_dim, bias=config.bias)
        self.k = nn.Linear(config.n_embd, config.kv_heads * config.head_dim, bias=config.bias)
        self.v = nn.Linear(config.n_embd, config.kv_heads * config.head_dim, bias=config.bias)
        self.o = nn.Linear(config.n_head * config.head_dim, config.n_embd, bias=config.bias)
        self.o.residual_projection = True  # GPT._init_weights scales it
        self.rope = config.position == "rope"
        if self.rope:
            # Each block keeps its own (tiny) frequency table so that a block runs alone: a pipeline stage or a
            # checkpointed block needs nothing computed elsewhere.
            self.rope_theta = config.rope_theta
            self.register_buffer("inv_freq", self._inv_freq(self.o.weight.device), persistent=False)

    def _inv_freq(self, device: torch.device) -> torch.Tensor:
        return 1.0 / self.rope_theta ** (torch.arange(0, self.head_dim, 2, device=device).float() / self.head_dim)

    def reset_parameters(self) -> None:
        """The RoPE table again, where it is (its projections initialise themselves): a model built on the meta
        device computes it where it is materialised (nbtrain.run.state.materialize)."""
        if self.rope:
            self.inv_freq = self._inv_freq(self.inv_freq.device)

    def forward(self, x: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        # -1, not n_head: under tensor parallelism a rank holds only its slice of the heads.
        q = self.q(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.k(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        if self.rope:
            if doc_ids is None:
                angles = torch.outer(torch.arange(T, device=x.device, dtype=torch.float32), self.inv_freq)
            else:
                # [B, 1, T, head_dim/2], broadcast over heads. RoPE scores depend on i - j only, so under the
                # document mask row positions would be as right in exact arithmetic; positions within the
                # document also round as the document alone does (fp32 angles near 30K are 2e-3 rad apart).
                angles = document_positions(doc_ids).float()[:, None, :, None] * self.inv_freq
            angles = torch.cat((angles, angles), dim=-1)
            cos, sin = angles.cos().to(q.dtype), angles.sin().to(q.dtype)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if k.shape[1] != q.shape[1]:  # grouped-query attention: each kv head serves n_head / n_kv_head queries
            repeat = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        if doc_ids is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            # Each block builds its mask from doc_ids, as it builds its RoPE table: a pipeline stage or a
            # checkpointed block needs nothing computed elsewhere. O(T²) bools per row, small beside attention.
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(doc_ids))
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    """GPT-2's GELU MLP or LLaMA's SwiGLU MLP."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.swiglu = config.mlp == "swiglu"
        self.fc1 = nn.Linear(config.n_embd, config.hidden, bias=config.bias)
        if self.swiglu:
            self.gate = nn.Linear(config.n_embd, config.hidden, bias=config.bias)
        self.fc2 = nn.Linear(config.hidden, config.n_embd, bias=config.bias)
        self.fc2.residual_projection = True  # GPT._init_weights scales it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.fc2(F.silu(self.gate(x)) * self.fc1(x))
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = _norm(config)
        self.attn = Attention(config)
        self.ln_2 = _norm(config)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), doc_ids)
        return x + self.mlp(self.ln_2(x))


class Embedding(nn.Module):
    """Token embedding, plus the learned position table for GPT-2 (indexed by the position within each document
    when ``doc_ids`` is given)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd) if config.position == "learned" else None
        self.block_size = config.block_size

    def forward(self, idx: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        T = idx.shape[1]
        if T > self.block_size:
            raise InvalidArgumentError(f"sequence length {T} exceeds the model's block_size {self.block_size}; "
                                       f"give rows of at most {self.block_size} tokens, or build the model with "
                                       f"block_size ≥ {T}")
        x = self.wte(idx)
        if self.wpe is not None:
            positions = torch.arange(T, device=idx.device) if doc_ids is None else document_positions(doc_ids)
            x = x + self.wpe(positions)
        return x


class Head(nn.Module):
    """Final norm and the projection to vocabulary logits."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_f = _norm(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


class GPT(nn.Module):
    """``embed → blocks → head``; ``forward(idx)`` returns logits ``(batch, seq, vocab)``, and
    ``forward(idx, doc_ids)`` those of packed rows, each document attending only within itself
    (``doc_ids`` as :class:`nbtrain.data.PackedRows` has them: 0, 1, ... per document of a row, -1 on padding)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.embed = Embedding(config)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.head = Head(config)
        if config.tie_embeddings:
            self.head.lm_head.weight = self.embed.wte.weight
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        """GPT-2's initialisation of one module: N(0, 0.02) weights, zero biases, and the residual projections
        scaled by 1/sqrt(2 · n_layer) (GPT-2 paper, section 2.3); a model built on the meta device is initialised
        module by module with it where it is materialised."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            std = 0.02 / math.sqrt(2 * self.config.n_layer) if getattr(module, "residual_projection", False) else 0.02
            nn.init.normal_(module.weight, mean=0.0, std=std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        if doc_ids is not None and doc_ids.shape != idx.shape:
            raise InvalidArgumentError(f"doc_ids has shape {tuple(doc_ids.shape)} but idx {tuple(idx.shape)}; "
                                       "give one document number per token (PackedRows.doc_ids)")
        # Without doc_ids every layer gets its one input, as before: hooks and pipeline stages see the same call.
        extra = () if doc_ids is None else (doc_ids,)
        x = self.embed(idx, *extra)
        for block in self.blocks:
            x = block(x, *extra)
        return self.head(x)

    def num_params(self) -> int:
        """Parameters counted once (a tied head shares the embedding's)."""
        return sum(p.numel() for p in self.parameters())
