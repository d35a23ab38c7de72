"""Turn what a user names as a model into an ``nn.Module``: a preset, ``module:attribute``, or the module itself.

    >>> resolve_model("gpt2")[0]
    'gpt2'
    >>> label, model = resolve_model("torch.nn:Linear")     # a class is a zero-argument callable: fails clearly
"""

from __future__ import annotations

import importlib

from torch import nn

from nbtrain.errors import ModelLoadError, NotAModuleError
from nbtrain.models.presets import PRESETS, build_preset, preset_config


def load_reference(ref: str) -> object:
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise ModelLoadError(f"cannot read {ref!r} as 'package.module:attribute'")
    try:
        obj = importlib.import_module(module_name)
    except Exception as exc:
        raise ModelLoadError(f"cannot import {module_name!r} (from {ref!r}): {type(exc).__name__}: {exc}") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ModelLoadError(f"module {module_name!r} has no attribute {attr!r}") from None
    return obj


def resolve_model(model: object, name: str | None = None) -> tuple[str, nn.Module]:
    """``(label, module)`` for a preset name, a ``module:attr`` reference, a module, or a callable returning one.

    A ``module:attr`` that names a callable is called with no arguments (on the meta device, so a large model
    costs nothing); it must return an ``nn.Module``.
    """
    label = name
    if isinstance(model, str):
        label = label or model
        if ":" not in model:
            return label, build_preset(model)
        model = load_reference(model)
    if not isinstance(model, nn.Module) and callable(model):
        import torch

        label = label or getattr(model, "__qualname__", repr(model))
        try:
            with torch.device("meta"):
                model = model()
        except Exception as exc:
            raise ModelLoadError(f"calling {label} to build the model failed: {type(exc).__name__}: {exc}") from None
    if not isinstance(model, nn.Module):
        raise NotAModuleError(
            f"{label or type(model).__name__} is a {type(model).__name__}, not a torch.nn.Module "
            "(nor a zero-argument callable returning one)"
        )
    return label or type(model).__name__, model


__all__ = ["resolve_model", "PRESETS"]
