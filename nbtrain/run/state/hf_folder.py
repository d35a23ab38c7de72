"""Trained weights written as a Hugging Face folder by every rank at once, which ``from_pretrained`` loads.

    >>> result = nbtrain.fit(model, batches, plan="dp_shard=2", steps=100, num_processes=2, save_pretrained="tuned/")
    >>> tuned = AutoModelForCausalLM.from_pretrained("tuned/")   # config.json and model*.safetensors

Each rank writes the shards it holds (a pipeline stage its layers) with torch's ``HuggingFaceStorageWriter``
through ``torch.distributed.checkpoint``; the coordinator then joins them into whole tensors in the files a
Hugging Face folder has (``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` with
``model.safetensors.index.json`` once the weights pass :data:`SHARD_BYTES`), and writes the model's ``config.json``
(and ``generation_config.json``) when it has one. Each tensor is written once, under the name the notebook's model
has for it first: a tied head under the embedding's name, which is what ``save_pretrained`` leaves and
``from_pretrained`` ties again. Nothing is ever whole in one process's memory but one tensor at a time.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch.distributed as dist
from torch import nn

from nbtrain.errors import InvalidArgumentError
from nbtrain.run.state.training_state import for_dcp, trained_tensors

SHARD_BYTES = 4 * 2**30
"""A file of the folder holds at most this many bytes of tensors (one larger tensor is a file of its own)."""


def file_of_each_tensor(model: nn.Module, shard_bytes: int | None = None) -> dict[str, int]:
    """Which file (1, 2, ...) each tensor the folder holds goes to, by the notebook's model (made before launching,
    the same on every rank): in the model's order, a new file once the next tensor would pass ``shard_bytes``."""
    limit = SHARD_BYTES if shard_bytes is None else shard_bytes
    files, index, size = {}, 1, 0
    for name, t in trained_tensors(model, ("",)).items():
        nbytes = t.numel() * t.element_size()
        if size and size + nbytes > limit:
            index, size = index + 1, 0
        files[name] = index
        size += nbytes
    return files


def check_folder(folder) -> str:
    """``folder`` as an absolute path where a Hugging Face folder may be written (before launching)."""
    path = Path(folder).expanduser().resolve()
    try:
        import safetensors  # noqa: F401  (torch's writer needs it; transformers brings it)
    except ImportError:
        raise InvalidArgumentError("save_pretrained writes safetensors files, which needs the safetensors package: "
                                   "pip install safetensors") from None
    if path.is_file():
        raise InvalidArgumentError(f"save_pretrained={str(folder)!r} is a file; give a folder to write the model into")
    if path.is_dir() and any(path.glob("*.safetensors")):
        raise InvalidArgumentError(f"save_pretrained={str(folder)!r} already holds a model (*.safetensors); give an "
                                   "empty or new folder, or remove those files")
    return str(path)


def save_hf_folder(model: nn.Module, mine: tuple[str, ...], folder: str, files: dict[str, int]) -> None:
    """In every worker (collective): write the tensors this rank holds under ``mine`` into ``folder`` as a Hugging
    Face folder (``files``: :func:`file_of_each_tensor`); rank 0 adds the model's ``config.json`` and
    ``generation_config.json`` when it has them (transformers' configs)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    state = {name: t.detach() for name, t in trained_tensors(model, mine).items()}
    Path(folder).mkdir(parents=True, exist_ok=True)
    writer = HuggingFaceStorageWriter(folder, fqn_to_index_mapping=files, save_distributed=True,
                                      enable_consolidation=True)
    dcp.save(for_dcp(state), storage_writer=writer)
    dist.barrier()  # the consolidated files are whole before the ranks' own parts go
    if dist.get_rank() == 0:
        shutil.rmtree(Path(folder) / "sharded", ignore_errors=True)
        unwrapped = getattr(model, "module", model)  # DDP's
        for config in (getattr(unwrapped, "config", None), getattr(unwrapped, "generation_config", None)):
            if config is not None and callable(getattr(config, "save_pretrained", None)):
                config.save_pretrained(folder)
    dist.barrier()
