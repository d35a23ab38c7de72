"""A model's layers as pipeline stages run them: each takes one tensor (token ids, or the hidden state) and returns one.

    >>> from nbtrain.models.description import describe
    >>> from tests.any_models import qwen2
    >>> [type(layer).__name__ for layer in stage_layers(describe(qwen2()), 0, 3)]     # a first stage's layers
    ['Embedding', 'RotaryBlock', 'RotaryBlock']

nbtrain's GPT is written so (``stages == "layers"``). A Hugging Face model's forward does more between its blocks
than calling them: GPT-2 sums token and position embeddings, a Llama-like decoder computes the RoPE tables once and
passes them, with a mask, to every block. The adapters here do that work for the layers of one stage, for inputs
without padding or a cache (as the model's forward does when it is given none).
"""

from __future__ import annotations

import torch
from torch import nn

from nbtrain.models.description import ModelDescription, slot_module


def _eager_causal_mask(config, x: torch.Tensor) -> torch.Tensor | None:
    """Eager attention adds its mask (without one it would not be causal); SDPA's ``is_causal`` needs none."""
    if getattr(config, "_attn_implementation", None) != "eager":
        return None
    mask = torch.full((x.shape[1], x.shape[1]), float("-inf"), dtype=x.dtype, device=x.device).triu(1)
    return mask[None, None]


class RotaryBlock(nn.Module):
    """A Hugging Face decoder layer with rotary embeddings (Llama, Mistral, Qwen2, Phi-3) on the hidden state alone:
    it computes the RoPE tables for its layer (the same tables: they depend only on the positions)."""

    def __init__(self, block: nn.Module, rotary: nn.Module):
        super().__init__()
        self.block, self.rotary = block, rotary

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        out = self.block(x, attention_mask=_eager_causal_mask(getattr(self.rotary, "config", None), x),
                         position_embeddings=self.rotary(x, positions), position_ids=positions)
        return out[0] if isinstance(out, tuple) else out


class GPT2Embeddings(nn.Module):
    """A Hugging Face GPT-2's first layer: token and position embeddings, summed, then the embedding dropout."""

    def __init__(self, wte: nn.Module, wpe: nn.Module, drop: nn.Module):
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        return self.drop(self.wte(ids) + self.wpe(positions))


class CausalBlock(nn.Module):
    """A Hugging Face GPT-2 block on the hidden state alone, causal without a padding mask."""

    def __init__(self, block: nn.Module, config):
        super().__init__()
        self.block, self.config = block, config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x, attention_mask=_eager_causal_mask(self.config, x))
        return out[0] if isinstance(out, tuple) else out


def stage_layers(description: ModelDescription, start: int, end: int) -> list[nn.Module]:
    """Layers ``[start, end)`` of the described model (already parallelized) as modules that each take one tensor."""
    model, last = description.model, len(description.layers) - 1
    layers = []
    for i in range(start, end):
        modules = [slot_module(parent, attr) for parent, attr in description.layers[i]]
        if description.stages == "layers":
            layers.append(modules[0])
        elif i == last:
            layers.append(nn.Sequential(*modules))  # final norm, then the LM head
        elif description.stages == "hf-gpt2":
            layers.append(GPT2Embeddings(*modules, model.transformer.drop) if i == 0 else
                          CausalBlock(modules[0], model.config))
        else:  # hf-rotary: the embedding, then the decoder layers
            base = getattr(model, model.base_model_prefix)
            layers.append(modules[0] if i == 0 else RotaryBlock(modules[0], base.rotary_emb))
    return layers
