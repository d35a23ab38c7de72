"""A LoRA run's result as its users keep it: peft's adapter folder, or the adapters merged into the base model.

    >>> result = nbtrain.fit(lora_model, batches, plan="dp_shard=2", steps=100, num_processes=2,
    ...                      save_pretrained="adapters/", save_merged="merged/")
    >>> PeftModel.from_pretrained(base, "adapters/")          # adapter_config.json, adapter_model.safetensors
    >>> AutoModelForCausalLM.from_pretrained("merged/")       # the base with B·A·scale added to each weight

The adapters are small (a few MB for a 7B model at r=16), so they come back from the workers into the notebook's
peft model (its frozen base is neither gathered nor changed: :func:`~nbtrain.run.state.weights.gather_trained`),
and peft writes the folder itself (``save_pretrained``): what ``PeftModel.from_pretrained`` reads is what peft
wrote. Merging needs the base weights, so it runs where they are, in the notebook, on a copy (the notebook's model
keeps its adapters); a base on the meta device (read by the workers from ``weights=``) cannot be merged there:
``save_merged`` is then refused before anything is launched.
"""

from __future__ import annotations

import copy
from pathlib import Path

from torch import nn

from nbtrain.errors import InvalidArgumentError
from nbtrain.models.lora import is_peft
from nbtrain.run.state.materialize import has_meta


def check_adapter_folder(model: nn.Module, folder, merged: bool = False) -> str:
    """``folder`` as an absolute path where the adapter folder (or, ``merged``, the merged model) may be written;
    refused before launching when it already holds one, or when the model cannot be merged."""
    what = "save_merged" if merged else "save_pretrained"
    if merged and not is_peft(model):
        raise InvalidArgumentError(f"save_merged merges a peft model's adapters into its base, and "
                                   f"{type(model).__name__} is no peft model; use save_pretrained= to write it")
    if merged and has_meta(model):
        raise InvalidArgumentError("save_merged merges the adapters into the base weights in the notebook, where this "
                                   "model's base is on the meta device (the workers read it from weights=); write the "
                                   "adapters (save_pretrained=) and merge where the base is loaded: "
                                   "PeftModel.from_pretrained(base, folder).merge_and_unload()")
    path = Path(folder).expanduser().resolve()
    if path.is_file():
        raise InvalidArgumentError(f"{what}={str(folder)!r} is a file; give a folder to write into")
    held = [p.name for pattern in ("adapter_model.*", "*.safetensors") for p in path.glob(pattern)] if path.is_dir() \
        else []
    if held:
        raise InvalidArgumentError(f"{what}={str(folder)!r} already holds {held[0]}; give an empty or new folder, or "
                                   "remove it")
    return str(path)


def write_adapters(model: nn.Module, folder: str) -> None:
    """peft's adapter folder of the notebook's peft ``model`` (its adapters trained, loaded back)."""
    model.save_pretrained(folder)


def write_merged(model: nn.Module, folder: str) -> None:
    """The base model with the adapters merged into its weights (``merge_and_unload`` on a copy), as a Hugging Face
    folder ``from_pretrained`` loads."""
    merged = copy.deepcopy(model).merge_and_unload()
    merged.save_pretrained(folder)
