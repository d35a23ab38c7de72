"""Pretrained weights straight into each rank's shards: a Hugging Face folder, or an nbtrain / DCP checkpoint.

    >>> with torch.device("meta"):
    ...     model = LlamaForCausalLM(LlamaConfig.from_pretrained("llama-1b/"))
    >>> result = nbtrain.fit(model, batches, plan="dp_shard=2", weights="llama-1b/", steps=100, num_processes=2)

A Hugging Face folder is what ``save_pretrained`` writes: ``*.safetensors`` files, one or sharded with an index.
torch's own ``HuggingFaceStorageReader`` reads it through ``torch.distributed.checkpoint``: each rank asks for the
tensors it holds, as the plan laid them out (a DTensor's local shard, a pipeline stage's layers only), and reads
only those bytes (``safe_open(...).get_slice``). A folder with a ``.metadata`` file is a DCP checkpoint:
``fit(save_dir=...)``'s, or a ``checkpoint_dir`` step (``step-NNNNNNNN``; given the ``checkpoint_dir``, its newest
complete one), read with DCP's ``FileSystemReader`` the same way.

Before any worker starts, :func:`resolve_weights` reads only the files' headers and matches them to the model, as
``from_pretrained`` does: a tied parameter is read once, under the name the file has (``save_pretrained`` writes the
embedding and leaves the tied head out); file names are mapped to the model's by ``key_mapping`` (regular expression →
replacement, ``from_pretrained``'s argument of that name; by default the model's ``_checkpoint_conversion_mapping``),
and a checkpoint of the base model (``model.layers.0...`` against ``layers.0...``) is matched through the model's
``base_model_prefix``; a tensor of another floating dtype is converted as it is read. A folder that is missing or
holds neither format, a tensor the model has and the files lack, another shape, or a dtype that cannot become the
model's (integers into floats) is one :class:`~nbtrain.errors.InvalidArgumentError` naming it.

Only read checkpoints you trust in the DCP format: its ``.metadata`` is a pickle (torch's format, read with
``pickle.load``), and unpickling runs whatever code the file's author put in it. A Hugging Face folder is not: its
safetensors files hold tensors and a JSON header. A DCP checkpoint in a folder this user does not own (someone
else's, a download unpacked by another account) warns once per folder before it is read.
"""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from nbtrain.errors import InvalidArgumentError
from nbtrain.run.state.materialize import modules_by_name
from nbtrain.run.state.training_state import canonical_name, for_dcp, trained_tensors


@dataclass(frozen=True)
class Weights:
    """Where a run's starting weights are: ``Weights("llama-1b/")``, or with names mapped as ``from_pretrained``'s
    ``key_mapping`` maps them, ``Weights("ckpt/", key_mapping={r"^transformer\\.": "model."})``."""

    path: str
    key_mapping: dict[str, str] | None = None
    """Regular expression on a file's tensor name → its replacement, giving the model's name."""
    kind: str = ""
    """``"safetensors"`` (a Hugging Face folder) or ``"dcp"``: set by :func:`resolve_weights`."""
    keys: dict[str, str] = field(default_factory=dict)
    """The model's tensor name → the file's, for every tensor read (set by :func:`resolve_weights`)."""
    saved_names: tuple[str, ...] = ()
    """The first names the files hold, for messages."""
    more: tuple["Weights", ...] = ()
    """Further folders read after this one (an adapter folder after its base model's), each for its own tensors."""


def _reader(kind: str, path: str):
    from torch.distributed.checkpoint import FileSystemReader, HuggingFaceStorageReader

    return HuggingFaceStorageReader(path) if kind == "safetensors" else FileSystemReader(path)


def _folder(path: Path) -> tuple[str, Path]:
    """The kind of checkpoint in ``path`` and the folder to read (a checkpoint_dir's newest complete step)."""
    if not path.exists():
        raise InvalidArgumentError(f"weights={str(path)!r}: no such folder; give the folder save_pretrained (or "
                                   "fit's save_dir / checkpoint_dir) wrote")
    if path.is_file():
        raise InvalidArgumentError(f"weights={str(path)!r} is a file; give the folder that holds it (all of a "
                                   "sharded checkpoint's files are read from there)")
    if (path / ".metadata").is_file():
        return "dcp", path
    steps = sorted(p for p in path.glob("step-*") if re.fullmatch(r"step-\d{8}", p.name) and (p / ".metadata").is_file())
    if steps:
        return "dcp", steps[-1]
    if any(path.glob("*.safetensors")):
        return "safetensors", path
    raise InvalidArgumentError(f"weights={str(path)!r} holds neither *.safetensors files (a Hugging Face folder, as "
                               "save_pretrained writes) nor a DCP checkpoint (.metadata, as fit's save_dir writes)")


_WARNED: set[str] = set()  # the DCP folders of other owners already warned about, in this process


def _warn_if_not_ours(path: str, folder: Path) -> None:
    """Warn, once per folder, before a DCP checkpoint that another user owns is read: reading it unpickles its
    ``.metadata``, which runs the code its author put there (module docstring)."""
    if not hasattr(os, "geteuid") or str(folder) in _WARNED:  # Windows: no owner ids to compare
        return
    metadata = folder / ".metadata"
    uid = next((st.st_uid for st in (folder.stat(), metadata.stat()) if st.st_uid != os.geteuid()), None)
    if uid is None:
        return
    _WARNED.add(str(folder))
    try:
        import pwd

        owner = f"user {pwd.getpwuid(uid).pw_name!r}"
    except (ImportError, KeyError):
        owner = f"uid {uid}"
    warnings.warn(f"weights={path!r} is a DCP checkpoint owned by {owner}, not you: reading it unpickles its "
                  ".metadata (torch's format), which runs any code its author put there; load only a "
                  "checkpoint you trust, or ask for the weights as a Hugging Face folder (safetensors files hold "
                  "tensors only)", UserWarning, stacklevel=3)


def _model_tensors(model: nn.Module) -> dict[str, list[str]]:
    """The model's parameters and persistent buffers: the first name of each → all its names (tied: several)."""
    names: dict[int, list[str]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        names.setdefault(id(t), []).append(canonical_name(name, False))
    return {group[0]: group for group in names.values()}


def _mapped(key: str, mapping: dict[str, str]) -> str:
    for pattern, replacement in mapping.items():
        key = re.sub(pattern, replacement, key)
    return key


def resolve_weights(weights, model: nn.Module) -> Weights:
    """``weights`` (a path or :class:`Weights`, or several: a base model's folder, then an adapter folder) checked
    against ``model`` from the files' headers alone, with the name of every tensor to read; raises
    :class:`InvalidArgumentError` with what is wrong (module docstring). Of several folders, a tensor is read from
    the last that holds it. A peft model's tensors are also found under the names a base model's checkpoint and peft's
    adapter folder give them, and its adapters, where no folder holds them, start from their own values (a new
    LoRA on a pretrained base)."""
    if isinstance(weights, (list, tuple)) and not isinstance(weights, Weights):
        if not weights:
            raise InvalidArgumentError("weights=[] names no folder; give one, or a base folder then an adapter folder")
        parts = [_resolve(w, model) for w in weights]
        covered = {name for part in parts for name in part.keys}
        _refuse_missing(model, parts[-1].path if len(parts) == 1 else ", ".join(p.path for p in parts), covered,
                        parts[-1].saved_names)
        for i, part in enumerate(parts):  # the last folder holding a tensor is the one it is read from
            later = {name for other in parts[i + 1:] for name in other.keys}
            parts[i] = replace(part, keys={k: v for k, v in part.keys.items() if k not in later})
        return replace(parts[0], more=tuple(parts[1:]))
    part = _resolve(weights, model)
    _refuse_missing(model, part.path, set(part.keys), part.saved_names)
    return part


def _resolve(weights, model: nn.Module) -> Weights:
    """One folder's tensors matched to ``model``'s (those it lacks are left for :func:`_refuse_missing`)."""
    from nbtrain.models.adapters import hf_inner
    from nbtrain.models.lora import adapter_names, file_names

    weights = weights if isinstance(weights, Weights) else Weights(str(weights))
    kind, folder = _folder(Path(weights.path).expanduser())
    if kind == "dcp":
        _warn_if_not_ours(weights.path, folder)
    if kind == "safetensors":
        try:
            import safetensors  # noqa: F401  (torch's reader needs it; transformers brings it)
        except ImportError:
            raise InvalidArgumentError(f"weights={weights.path!r} is a Hugging Face folder, which needs the "
                                       "safetensors package to read: pip install safetensors") from None
    try:
        saved = _reader(kind, str(folder)).read_metadata().state_dict_metadata
    except Exception as error:  # a damaged header, an unreadable file: say which folder, and what the reader said
        raise InvalidArgumentError(f"weights={weights.path!r}: cannot read it ({type(error).__name__}: "
                                   f"{str(error).splitlines()[0] if str(error) else ''})") from None
    if kind == "dcp" and any(k.startswith("optim.") for k in saved):  # a checkpoint_dir step: model.<name>
        saved = {k[len("model."):]: v for k, v in saved.items() if k.startswith("model.")}
        prefix = "model."
    else:
        prefix = ""
    inner, path = hf_inner(model)  # a peft model: the Hugging Face model's own names, and its mapping
    mapping = weights.key_mapping if weights.key_mapping is not None else \
        dict(getattr(inner, "_checkpoint_conversion_mapping", None) or {})
    by_model_name = {_mapped(k, mapping): k for k in saved}
    base = getattr(inner, "base_model_prefix", "") or ""
    adapters = adapter_names(model)
    keys = {}
    for first, names in _model_tensors(model).items():
        names = names + [n for name in names for n in file_names(name, path, adapters)] if adapters else names
        key = next((by_model_name[n] for n in names if n in by_model_name), None)
        if key is None and base:  # a base model's checkpoint into a model with a head (or the other way round)
            key = next((by_model_name[c] for n in names for c in (n.removeprefix(base + "."), f"{base}.{n}")
                        if c != n and c in by_model_name), None)
        if key is None:
            continue
        _check_tensor(model, first, saved[key], key, weights.path)
        keys[first] = prefix + key
    return replace(weights, kind=kind, path=str(folder), keys=keys, saved_names=tuple(sorted(saved)[:3]))


def _refuse_missing(model: nn.Module, where: str, covered: set[str], example: tuple[str, ...]) -> None:
    """Raise naming the model's tensors no folder holds (a peft model's adapters may start from their own values)."""
    from nbtrain.models.lora import adapter_names, is_adapter_tensor

    peft = bool(adapter_names(model))
    missing = [name for name in _model_tensors(model) if name not in covered
               and not (peft and is_adapter_tensor(name))]
    if missing:
        raise InvalidArgumentError(
            f"weights={where!r} lacks {len(missing)} of {type(model).__name__}'s tensors: "
            f"{', '.join(missing[:3])}{' …' if len(missing) > 3 else ''} (its names: "
            f"{', '.join(example)} …); a checkpoint of another model, or of other names: give "
            "key_mapping={file pattern: model name}, as from_pretrained takes it")


def _check_tensor(model: nn.Module, name: str, saved, key: str, path: str) -> None:
    tensor = _get(model, name)
    shape, dtype = tuple(saved.size), saved.properties.dtype
    if shape != tuple(tensor.shape):
        raise InvalidArgumentError(f"weights={path!r}: {key} has shape {shape}, but the model's {name} is "
                                   f"{tuple(tensor.shape)}; a checkpoint of another size of this model?")
    if dtype is not None and dtype.is_floating_point != tensor.dtype.is_floating_point:
        raise InvalidArgumentError(f"weights={path!r}: {key} is {str(dtype).removeprefix('torch.')}, which cannot "
                                   f"become the model's {str(tensor.dtype).removeprefix('torch.')} {name}")


def _get(model: nn.Module, name: str) -> torch.Tensor:
    owner, _, attr = name.rpartition(".")
    module = modules_by_name(model)[owner]
    return module._parameters[attr] if attr in module._parameters else module._buffers[attr]


def load_weights(model: nn.Module, weights: Weights, mine: tuple[str, ...]) -> None:
    """In every worker (collective): read into this rank's tensors under the ``mine`` prefixes (its pipeline stage's
    layers) their values from ``weights`` (resolved), each rank only the part it holds. Without a process group,
    the whole of them into one process: ``load_weights(model, resolve_weights("pre/", model), ("",))``."""
    import torch.distributed.checkpoint as dcp

    tensors = trained_tensors(model, mine)
    for part in (weights, *weights.more):
        state = {part.keys[name]: t for name, t in tensors.items() if name in part.keys}
        if not state:  # this stage holds none of that folder's tensors
            continue
        with torch.no_grad(), warnings.catch_warnings():
            # without a process group (nbtrain verify's one process) DCP reads everything here, which is the intent
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(for_dcp({k: t.detach() for k, t in state.items()}), storage_reader=_reader(part.kind, part.path))
