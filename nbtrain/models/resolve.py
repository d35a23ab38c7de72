"""Turn what a user names as a model into an ``nn.Module``: a preset, ``module:attribute``, or the module itself.

A ``module:attribute`` is imported with the current folder importable (first on ``sys.path``, as ``python -m``
makes it), so ``nbtrain profile mods:tiny`` finds ``./mods.py``.

    >>> resolve_model("gpt2")[0]
    'gpt2'
    >>> resolve_model("torch.nn:Linear")     # a class is called with no arguments, which Linear cannot take
    Traceback (most recent call last):
    ...
    nbtrain.errors.ModelLoadError: calling torch.nn:Linear to build the model failed: TypeError: Linear.__init__() missing 2 ...
"""

from __future__ import annotations

import importlib
import os
import sys

from torch import nn

from nbtrain.errors import ModelLoadError, NotAModuleError
from nbtrain.models.presets import PRESETS, build_preset, preset_config


def load_reference(ref: str) -> object:
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise ModelLoadError(f"cannot read {ref!r} as 'package.module:attribute'")
    here = current_folder_importable()
    try:
        obj = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        top = module_name.split(".")[0]
        if exc.name != top:  # the module was found; something it imports (or a submodule) was not
            raise ModelLoadError(f"cannot import {module_name!r} (from {ref!r}): ModuleNotFoundError: {exc}") from None
        folder = f"the current folder ({os.path.join(here, '')})" if here else "the current folder (it was removed)"
        raise ModelLoadError(f"cannot import {module_name!r} (from {ref!r}): there is no module {top!r} in {folder} "
                             f"or anywhere else on Python's path (sys.path); run from the folder that holds {top}.py "
                             f"(or the package {top}/), set PYTHONPATH to that folder, or install the package "
                             "(pip install -e .)") from None
    except Exception as exc:
        raise ModelLoadError(f"cannot import {module_name!r} (from {ref!r}): {type(exc).__name__}: {exc}") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ModelLoadError(f"module {module_name!r} has no attribute {attr!r}") from None
    return obj


def current_folder_importable() -> str | None:
    """Put the current folder first on ``sys.path`` unless it is there already, as ``python -m`` does (the
    ``nbtrain`` console script starts with its own ``bin`` folder there instead), so that ``mods:tiny`` finds
    ``./mods.py``. Returns the folder (None when it no longer exists)."""
    try:
        here = os.getcwd()
    except FileNotFoundError:
        return None
    if not any(os.path.abspath(entry or os.curdir) == here for entry in sys.path if isinstance(entry, str)):
        sys.path.insert(0, here)
    return here


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
