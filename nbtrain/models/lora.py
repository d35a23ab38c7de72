"""What nbtrain knows of peft's LoRA layers: their parts, and how tensor parallelism splits them.

    >>> from peft import LoraConfig, get_peft_model
    >>> from tests.any_models import qwen2
    >>> model = get_peft_model(qwen2(), LoraConfig(r=4, target_modules=["q_proj", "o_proj"]))
    >>> split_lora(model, {"base_model.model.model.layers.0.self_attn.q_proj": "colwise",
    ...                    "base_model.model.model.layers.0.self_attn.o_proj": "rowwise"})
    {'base_model.model.model.layers.0.self_attn.q_proj.base_layer': 'colwise', 'base_model.model.model.layers.0.self_attn.q_proj.lora_B.default': 'colwise', 'base_model.model.model.layers.0.self_attn.o_proj.base_layer': 'rowwise', 'base_model.model.model.layers.0.self_attn.o_proj.lora_A.default': 'rowwise'}

A LoRA layer (Hu et al. 2021) adds ``B(A(x)) · scale`` to its frozen base layer's output, A mapping the input
features to ``r``, B mapping ``r`` to the output features. Under tensor parallelism the base is split as the
model's plan says, and the adapter as Megatron-LM's and NeMo's LoRA is: on a **column-split** base (each rank
computes a part of the output features) A stays whole and B is split by its output features, so each rank adds its
part of ``B(A(x))`` to its part of the output (B's input gradient, partial on each rank, is summed as a colwise
layer's is); on a **row-split** base (each rank holds a part of the input features, the partial outputs summed) A is
split by its input features, its partial outputs summed (``r`` numbers a token), and B stays whole. Nothing else
crosses the ranks, and each rank computes exactly its part of what one process computes.
"""

from __future__ import annotations

from torch import nn

COLUMN_STYLES = ("colwise", "packed_colwise", "colwise_gather_output")
"""Styles that split a layer's output features: B takes the base's style, A stays whole."""
ROW_STYLES = ("rowwise", "rowwise_split_input")
"""Styles that split a layer's input features: A takes the base's style, B stays whole."""


def lora_parts(module: nn.Module) -> tuple[nn.Module, dict[str, nn.Module], dict[str, nn.Module]] | None:
    """``(base_layer, {adapter: A}, {adapter: B})`` of a peft LoRA layer on an ``nn.Linear``; None for any other
    module (LoRA on an embedding holds parameters, not layers, and is not split here)."""
    base, a, b = (getattr(module, name, None) for name in ("base_layer", "lora_A", "lora_B"))
    if not (isinstance(base, nn.Module) and isinstance(a, nn.ModuleDict) and isinstance(b, nn.ModuleDict)):
        return None
    if not all(isinstance(m, nn.Linear) for m in [*a.values(), *b.values()]):
        return None
    return base, dict(a.items()), dict(b.items())


def lora_problem(module: nn.Module, style: str) -> str:
    """Why tensor parallelism cannot split this LoRA layer as ``style`` (empty: it can, or it is no LoRA layer)."""
    if getattr(module, "lora_variant", None):  # DoRA and the other variants compute more than B(A(x))
        return (f"its LoRA variant ({', '.join(type(v).__name__ for v in module.lora_variant.values())}) is not "
                "split by tensor parallelism; use plain LoRA, or tp=1")
    if style not in COLUMN_STYLES + ROW_STYLES:
        return f"a LoRA layer split as {style!r} (nbtrain splits LoRA on colwise and rowwise layers)"
    return ""


def split_lora(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """A tensor-parallel plan (module name → style) with each LoRA layer it names replaced by its parts: the base
    layer takes the style, and B (column split) or A (row split) of each adapter with it (module docstring); a LoRA
    layer nbtrain does not split keeps its entry, which the style check then refuses, saying why."""
    out: dict[str, str] = {}
    for name, style in plan.items():
        module = model.get_submodule(name)
        parts = lora_parts(module)
        if parts is None or lora_problem(module, style):
            out[name] = style
            continue
        out[f"{name}.base_layer"] = style
        split = "lora_B" if style in COLUMN_STYLES else "lora_A"
        for adapter in parts[2 if split == "lora_B" else 1]:
            out[f"{name}.{split}.{adapter}"] = style
    return out


def is_peft(model: nn.Module) -> bool:
    """Whether ``model`` is a peft model (``PeftModel`` and its task classes), by the attributes peft gives them."""
    return isinstance(getattr(model, "peft_config", None), dict) and callable(getattr(type(model), "get_base_model",
                                                                                     None))


def adapter_names(model: nn.Module) -> tuple[str, ...]:
    """The names of a peft model's adapters (``("default",)`` for one made by ``get_peft_model``)."""
    return tuple(getattr(model, "peft_config", None) or ())


def is_adapter_tensor(name: str) -> bool:
    """Whether a tensor of a peft model is a LoRA adapter's (A, B, or an embedding's LoRA)."""
    return any(part in name for part in (".lora_A.", ".lora_B.", ".lora_embedding_A.", ".lora_embedding_B.",
                                         ".lora_magnitude_vector."))


def file_names(name: str, inner_path: str, adapters: tuple[str, ...]) -> list[str]:
    """Names a peft model's tensor ``name`` has in the files people hold, besides its own: in a checkpoint of the base
    model (``model.layers.0.self_attn.q_proj.weight`` for ``base_model.model.model.layers.0.self_attn.q_proj
    .base_layer.weight``) and in peft's adapter folder (``...q_proj.lora_A.weight``: the adapter's name left out).

        >>> file_names("base_model.model.model.layers.0.mlp.up_proj.base_layer.weight", "base_model.model.",
        ...            ("default",))
        ['model.layers.0.mlp.up_proj.weight']
        >>> file_names("base_model.model.model.layers.0.mlp.up_proj.lora_B.default.weight", "base_model.model.",
        ...            ("default",))
        ['base_model.model.model.layers.0.mlp.up_proj.lora_B.weight']
    """
    if is_adapter_tensor(name):
        for adapter in adapters:
            name = name.replace(f".{adapter}.", ".")
        return [name]
    if inner_path and name.startswith(inner_path):
        return [name[len(inner_path):].replace(".base_layer.", ".")]
    return []
