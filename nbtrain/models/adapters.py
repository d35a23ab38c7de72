"""What nbtrain needs to know about a model family: where its repeated blocks are, and what feeds it.

nbtrain's own :class:`~nbtrain.models.GPT`, Hugging Face ``transformers`` GPT-2 and Llama models are known by
name; any other model is searched for its longest list of identical blocks. ``transformers`` is never
imported here: a Hugging Face model is recognised by its ``config.model_type``, so nbtrain works without it.

    >>> from nbtrain.models import build_preset
    >>> family = detect_family(build_preset("gpt2"))
    >>> family.name, family.blocks_path, family.vocab_size, family.max_seq_len
    ('nbtrain-gpt', 'blocks', 50257, 1024)
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Callable, ContextManager

from torch import nn


@dataclass(frozen=True)
class ModelFamily:
    """How to cut and feed one kind of model."""

    name: str
    """``nbtrain-gpt``, ``hf-<model_type>`` for a Hugging Face model (``hf-gpt2``, ``hf-llama``, ...), or
    ``generic``."""
    blocks_path: str | None
    """Dotted path of the repeated blocks (a ``ModuleList``/``Sequential``); ``None`` when there are none."""
    vocab_size: int | None = None
    """Token ids the model takes; ``None`` for models that do not take tokens."""
    max_seq_len: int | None = None
    """Longest sequence the model accepts, when it has a limit."""
    n_embd: int | None = None
    """Width of the hidden state passed between blocks."""
    n_head: int | None = None
    """Attention heads per block (tensor parallelism splits them)."""
    n_kv_head: int | None = None
    """Key/value heads per block (grouped-query attention)."""
    forward_kwargs: dict = field(default_factory=dict)
    """Keyword arguments every training forward passes (``use_cache=False`` for Hugging Face models)."""
    note: str = ""
    """Anything the user should know about how the model was read."""
    fake_tracing: Callable[[], ContextManager] = nullcontext
    """Context to enter while the profiler traces the model on fake tensors (see :func:`_hf_unpacked_batches`)."""
    splits_tied: bool = False
    """Whether the executor splits a tied embedding and head: vocabulary-parallel under tensor parallelism (one
    DTensor for both), and across pipeline stages (a copy in the first and the last, their gradients summed), as
    tests/test_gpt2_parallel.py checks. Otherwise the tie stays whole, in one stage."""

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        return list(model.get_submodule(self.blocks_path)) if self.blocks_path else []


@contextmanager
def _hf_unpacked_batches():
    """Make Hugging Face models take their eager mask path on fake tensors.

    HF looks at the position ids to detect several sequences packed in one row; on fake tensors it cannot read
    them, assumes packing, and builds a ``(batch, 1, seq, seq)`` mask (and expands grouped k/v heads) that a
    real step with positions ``0..seq-1`` never builds. The profiler's batches are unpacked, so answer as a real
    step would: no packed sequences.
    """
    try:
        from torch._subclasses.fake_tensor import FakeTensor
        from transformers import masking_utils
    except ImportError:
        yield
        return
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:  # another transformers version: nothing to correct
        yield
        return

    def unpacked(position_ids, *args, **kwargs):
        return None if isinstance(position_ids, FakeTensor) else original(position_ids, *args, **kwargs)

    masking_utils.find_packed_sequence_indices = unpacked
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


def _hf_family(model: nn.Module) -> ModelFamily | None:
    """A Hugging Face model, read from its config (``hf-<model_type>``); its blocks are found as for any model."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if not isinstance(model_type, str) or not hasattr(config, "to_dict"):
        return None
    known = {"gpt2": ("transformer.h", "h"), "llama": ("model.layers", "layers")}
    block_classes = tuple(getattr(model, "_no_split_modules", None) or ())
    path = next((p for p in known.get(model_type, ()) if has_submodule(model, p)), None) or \
        _repeated_blocks(model, block_classes)

    def first(*names):
        return next((getattr(config, n) for n in names if isinstance(getattr(config, n, None), int)), None)

    heads = first("num_attention_heads", "n_head", "num_heads")
    text = getattr(config, "vocab_size", None) is not None
    return ModelFamily(f"hf-{model_type}", path, first("vocab_size") if _first(model, nn.Embedding) else None,
                       first("n_positions", "max_position_embeddings") if text else None,
                       first("hidden_size", "n_embd", "d_model"), heads, first("num_key_value_heads") or heads,
                       forward_kwargs={"use_cache": False} if hasattr(config, "use_cache") else {},
                       note="" if path else "no list of repeated blocks found: profiled as one layer",
                       fake_tracing=_hf_unpacked_batches, splits_tied=model_type == "gpt2")


def has_submodule(model: nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
        return True
    except AttributeError:
        return False


def _repeated_blocks(model: nn.Module, block_classes: tuple[str, ...] = ()) -> str | None:
    """Path of the container of blocks (at least two) holding the most parameters: blocks of one class, or of the
    classes ``block_classes`` names (a Hugging Face model's ``_no_split_modules``: Jamba's Mamba and attention
    layers, in one list). A model with no such list may still hold one list of blocks of several classes that holds
    most of its parameters (a hybrid of state-space and attention blocks written by hand): that one, then."""
    best, best_params, mixed, mixed_params = None, -1, None, -1
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < 2:
            continue
        kinds = {type(child) for child in module}
        params = sum(p.numel() for p in module.parameters())
        if (len(kinds) == 1 or block_classes and all(k.__name__ in block_classes for k in kinds)) and \
                params > best_params:
            best, best_params = name, params
        elif len(kinds) > 1 and params > mixed_params and all(any(True for _ in c.parameters()) for c in module):
            mixed, mixed_params = name, params
    if best is None and mixed is not None and 2 * mixed_params > sum(p.numel() for p in model.parameters()):
        return mixed
    return best


def hf_inner(model: nn.Module) -> tuple[nn.Module, str]:
    """The Hugging Face model inside a wrapper, and its name with a dot (peft's ``PeftModel`` holds it at
    ``base_model.model.``); ``(model, "")`` for a model that wraps none. Plans and forwards are the inner model's.

        >>> from peft import LoraConfig, get_peft_model
        >>> from tests.any_models import qwen2
        >>> inner, path = hf_inner(get_peft_model(qwen2(), LoraConfig(r=4, target_modules=["q_proj"])))
        >>> type(inner).__name__, path
        ('Qwen2ForCausalLM', 'base_model.model.')
    """
    unwrap = getattr(type(model), "get_base_model", None)  # peft's PeftModel (read on the class: it forwards the rest)
    inner = model.get_base_model() if callable(unwrap) else model
    if inner is model:
        return model, ""
    name = next((n for n, m in model.named_modules() if m is inner), None)
    return (inner, f"{name}.") if name else (model, "")


def _first(model: nn.Module, kind: type) -> nn.Module | None:
    return next((m for m in model.modules() if isinstance(m, kind)), None)


def detect_family(model: nn.Module) -> ModelFamily:
    """Recognise ``model``: nbtrain's GPT, a Hugging Face model (by its config), or a generic model."""
    from nbtrain.models.gpt import GPT

    if isinstance(model, GPT):
        c = model.config
        return ModelFamily("nbtrain-gpt", "blocks", c.vocab_size, c.block_size, c.n_embd, c.n_head, c.kv_heads)
    family = _hf_family(model)
    if family is not None:
        return family
    path = _repeated_blocks(model)
    embedding = _first(model, nn.Embedding)
    vocab = embedding.num_embeddings if embedding is not None else None
    note = "" if path else "no list of repeated blocks found: profiled as one layer"
    return ModelFamily("generic", path, vocab_size=vocab, note=note)


def set_training(model: nn.Module, mode: bool = True) -> nn.Module:
    """``model.train(mode)`` as torch defines it, every module's ``training`` flag, without a library's own
    ``train()`` on top: transformers ≥ 5.25 re-kernelizes a ``from_pretrained`` model there, swapping in Hugging Face
    Hub kernels for the device it finds, which fails on a model still on the meta device, downloads on a GPU, and
    changes the code a plan must run exactly as one process does.

        >>> from nbtrain.models import build_preset
        >>> set_training(build_preset("gpt-tiny")).training
        True
    """
    for module in model.modules():
        module.training = mode
    return model


def smallest_window(model: nn.Module) -> int | None:
    """The narrowest attention window among a model's layers (tokens a query sees back), None when every layer
    attends to the whole sequence: Hugging Face's ``config.sliding_window`` where a layer type uses it (Cohere 2,
    Gemma 3, OLMo 3, gpt-oss: ``sliding_attention`` in ``layer_types``), or every layer (Mistral: no
    ``layer_types``, ``use_sliding_window`` not off). A test whose sequences fit inside the window never exercises it.

        >>> from tests.any_models import mistral, qwen2
        >>> smallest_window(mistral()), smallest_window(qwen2())
        (4096, None)
    """
    config = getattr(model, "config", None)
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return None
    types = getattr(config, "layer_types", None)
    if types is not None:
        return window if "sliding_attention" in types else None
    return None if getattr(config, "use_sliding_window", None) is False else window
