"""Named model shapes of real, published models, built without allocating their weights.

    >>> from nbtrain.models import build_preset
    >>> model = build_preset("llama-70b")          # on the meta device: shapes only, no memory
    >>> round(model.num_params() / 1e9, 2)
    68.98

Shapes come from the models' published configs: GPT-2 (Radford et al. 2019, Table 2, and the released
checkpoints' ``n_embd``/``n_layer``/``n_head``), LLaMA-2 (Touvron et al. 2023, Table 1, and the released
``params.json``: 7B dim 4096 × 32 layers, 13B 5120 × 40, 70B 8192 × 80 with 8 key/value heads; FFN widths
11008 / 13824 / 28672; vocabulary 32000).
"""

from __future__ import annotations

import torch

from nbtrain.errors import UnknownModelError
from nbtrain.models.gpt import GPT, GPTConfig

_GPT2 = dict(vocab_size=50257, block_size=1024)
_LLAMA2 = dict(vocab_size=32000, block_size=4096, norm="rmsnorm", mlp="swiglu", position="rope",
               bias=False, tie_embeddings=False, norm_eps=1e-5)

PRESETS: dict[str, GPTConfig] = {
    "gpt2": GPTConfig(**_GPT2, n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": GPTConfig(**_GPT2, n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": GPTConfig(**_GPT2, n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": GPTConfig(**_GPT2, n_layer=48, n_head=25, n_embd=1600),
    "llama-7b": GPTConfig(**_LLAMA2, n_layer=32, n_head=32, n_embd=4096, ffn_hidden=11008),
    "llama-13b": GPTConfig(**_LLAMA2, n_layer=40, n_head=40, n_embd=5120, ffn_hidden=13824),
    "llama-70b": GPTConfig(**_LLAMA2, n_layer=80, n_head=64, n_kv_head=8, n_embd=8192, ffn_hidden=28672),
    # Small shapes for tutorials, tests and this machine's CPU: same code, trainable in seconds.
    "gpt-tiny": GPTConfig(vocab_size=512, block_size=256, n_layer=4, n_head=4, n_embd=128),
    "llama-tiny": GPTConfig(**{**_LLAMA2, "vocab_size": 512, "block_size": 256}, n_layer=4, n_head=4,
                            n_kv_head=2, n_embd=128, ffn_hidden=344),
}


def preset_config(name: str) -> GPTConfig:
    """The :class:`GPTConfig` of a preset; an unknown name raises :class:`UnknownModelError` listing them."""
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise UnknownModelError(name, known=list(PRESETS)) from None


def build_preset(name: str, device: str | torch.device = "meta") -> GPT:
    """Build a preset. On the default ``meta`` device nothing is allocated, so ``llama-70b`` takes a second."""
    config = preset_config(name)
    with torch.device(device):
        return GPT(config)
