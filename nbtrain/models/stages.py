"""A model's layers as pipeline stages run them: each stage takes one tensor (token ids, or the hidden state) and
returns one (the hidden state, or the logits).

    >>> from nbtrain.models.description import describe
    >>> from tests.any_models import qwen2
    >>> [type(layer).__name__ for layer in stage_layers(describe(qwen2()), 0, 3)]     # a first stage: one module
    ['DecoderStage']

nbtrain's GPT is written so (``stages == "layers"``): each layer takes the hidden state alone. A Hugging Face
decoder's forward does more between its blocks than calling them, and what it does differs from family to family
and from layer to layer: the RoPE tables (one per layer type in OLMo 3 and Gemma 3), a causal mask per layer type
(sliding-window and global attention alternate in Cohere 2, Gemma 3, OLMo 3 and gpt-oss), a recurrent mask for
Mamba layers (Jamba), a scale on the logits (Cohere), a soft cap (Gemma). No adapter written beside the model can
know all of it, so a decoder's stage (:class:`DecoderStage`) runs **the model's own forward** over its layers: the
blocks of other stages are stood in for for the length of the call (those before hand on the stage's input, the
first one after stops the forward and hands its input back), so every block of the stage gets exactly the
arguments the model's forward gives it. GPT-2's forward adds position embeddings to whatever it is given (its
first layer's ``wpe`` lives in the first stage only), so its blocks keep small adapters of their own.
"""

from __future__ import annotations

import torch
from torch import nn

from nbtrain.models.adapters import hf_inner
from nbtrain.models.description import ModelDescription, slot_module


def _eager_causal_mask(config, x: torch.Tensor) -> torch.Tensor | None:
    """Eager attention adds its mask (without one it would not be causal); SDPA's ``is_causal`` needs none."""
    if getattr(config, "_attn_implementation", None) != "eager":
        return None
    mask = torch.full((x.shape[1], x.shape[1]), float("-inf"), dtype=x.dtype, device=x.device).triu(1)
    return mask[None, None]


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


class _Done(Exception):
    """Raised inside the model's forward once the stage's last block has run; carries what it handed on."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__()
        self.hidden = hidden


class _StandIn(nn.Module):
    """A block of another stage for the length of one forward: the model may read its attributes (Gemma 3 reads a
    layer's ``attention_type``), which come from the block it stands in for."""

    def __init__(self, block: nn.Module, hidden: torch.Tensor | None = None):
        super().__init__()
        self.__dict__["_block"], self.__dict__["_hidden"] = block, hidden

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_block"], name)


class _Before(_StandIn):
    """A block of an earlier stage: it hands on the stage's input (the hidden state the earlier stage sent)."""

    def forward(self, *args, **kwargs):
        return self._hidden


class _Enter(_StandIn):
    """The stage's first block: it runs on the stage's input, whatever the forward made of ``inputs_embeds`` before
    the first block (a scale, position embeddings: the first stage's work, done there)."""

    def forward(self, hidden_states=None, *args, **kwargs):
        return self._block(self._hidden, *args, **kwargs)


class _After(_StandIn):
    """The first block of a later stage: the forward stops here and the stage hands on what this block was given
    (a stage holding only the embedding)."""

    def forward(self, hidden_states=None, *args, **kwargs):
        raise _Done(hidden_states)


def _stop_after(module: nn.Module, args, output):
    raise _Done(output[0] if isinstance(output, tuple) else output)


def first_tensor_of(output) -> torch.Tensor:
    """The logits of a model's output: ``.logits`` of a ``ModelOutput``, else the first tensor of a tuple."""
    logits = getattr(output, "logits", None)
    if logits is not None:
        return logits
    return output[0] if isinstance(output, (tuple, list)) else output


def run_layers(model: nn.Module, blocks_path: str, start: int, end: int, x: torch.Tensor,
               forward_kwargs: dict | None = None) -> torch.Tensor:
    """Layers ``[start, end)`` of ``model`` (layer 0 the embedding, 1..n its blocks, n + 1 what follows them) on
    ``x`` (token ids when ``start`` is 0, else the hidden state layer ``start`` receives), by the model's own forward:
    returns the hidden state the next layer receives, or the model's logits when the stage ends with the model."""
    blocks = model.get_submodule(blocks_path)
    names = list(blocks._modules)
    n = len(names)
    saved = dict(blocks._modules)
    hook = None
    try:
        for k, name in enumerate(names):  # block k is layer k + 1
            if k + 1 < start:
                blocks._modules[name] = _Before(saved[name], x)
            elif k + 1 == start:
                blocks._modules[name] = _Enter(saved[name], x)
            elif k + 1 >= end and end == 1:  # the stage is the embedding alone
                blocks._modules[name] = _After(saved[name])
                break
        if 1 < end <= n + 1:  # the stage ends with block end - 2: stop the forward after it
            hook = blocks._modules[names[end - 2]].register_forward_hook(_stop_after)
        inputs = {"input_ids": x} if start == 0 else {"inputs_embeds": x}
        try:
            output = model(**inputs, **(forward_kwargs or {}))
        except _Done as done:
            return done.hidden
        return first_tensor_of(output)
    finally:
        if hook is not None:
            hook.remove()
        blocks._modules.clear()
        blocks._modules.update(saved)


def buffer_modules(description: ModelDescription) -> list[nn.Module]:
    """Modules of the model outside every layer that hold buffers and no parameters (RoPE tables): each stage's
    forward computes with them, so every stage holds them (placed and filled on its device)."""
    inside = {id(m) for slots in description.layers for parent, attr in slots
              for m in slot_module(parent, attr).modules()}
    return [m for m in description.model.modules() if id(m) not in inside
            and any(True for _ in m.buffers(recurse=False)) and not any(True for _ in m.parameters())]


class DecoderStage(nn.Module):
    """Layers ``[start, end)`` of a Hugging Face decoder as one module, run by the model's own forward
    (:func:`run_layers`). It holds the stage's layers (their parameters are the stage's) and the buffers every
    stage computes with; the model itself is not a submodule (the other stages' layers are not this stage's)."""

    def __init__(self, description: ModelDescription, start: int, end: int):
        super().__init__()
        self.layers = nn.ModuleList(slot_module(parent, attr) for i in range(start, end)
                                    for parent, attr in description.layers[i])
        self.buffers_of_model = nn.ModuleList(buffer_modules(description))
        model, path = hf_inner(description.model)  # a wrapper (peft's) runs the model inside it
        self.__dict__["model"] = model
        self.blocks_path, self.start, self.end = description.family.blocks_path[len(path):], start, end
        self.forward_kwargs = dict(description.family.forward_kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run_layers(self.model, self.blocks_path, self.start, self.end, x, self.forward_kwargs)


def stage_layers(description: ModelDescription, start: int, end: int) -> list[nn.Module]:
    """Layers ``[start, end)`` of the described model (already parallelized) as modules that each take one tensor:
    one per layer (nbtrain's GPT, GPT-2), or one for the stage (a decoder run by its own forward)."""
    if description.stages == "hf-decoder":
        return [DecoderStage(description, start, end)]
    model, last = description.model, len(description.layers) - 1
    layers = []
    for i in range(start, end):
        modules = [slot_module(parent, attr) for parent, attr in description.layers[i]]
        if description.stages == "layers":
            layers.append(modules[0])
        elif i == last:
            layers.append(nn.Sequential(*modules))  # final norm, then the LM head
        else:  # hf-gpt2
            layers.append(GPT2Embeddings(*modules, model.transformer.drop) if i == 0 else
                          CausalBlock(modules[0], model.config))
    return layers
