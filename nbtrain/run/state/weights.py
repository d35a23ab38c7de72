"""The trained weights out of the workers: gathered whole into the notebook, or saved sharded with DCP.

    >>> state = gather_trained(model, plan, mine)           # in every worker; rank 0 gets the full state dict
    >>> save_trained(model, mine, "ckpt/")                  # in every worker: each rank writes its shards
    >>> load_saved(fresh_model, "ckpt/")                    # later, in one process

Gathering suits models that fit one process's memory; ``torch.distributed.checkpoint`` suits the others: each
rank writes the shards it holds (a pipeline stage only its own layers), and nothing is ever whole in memory until
it is loaded.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from nbtrain.errors import InvalidArgumentError


def trained_prefixes(model: nn.Module, plan, stage: int) -> tuple[str, ...]:
    """Name prefixes of the layers pipeline stage ``stage`` trains (the other stages' layers in a process are
    untouched copies), in the unwrapped model's names."""
    return layer_prefixes(model, *plan.stage_ranges()[stage])


def layer_prefixes(model: nn.Module, start: int = 0, end: int | None = None) -> tuple[str, ...]:
    """Name prefixes of layers ``[start, end)`` (all by default) in the unwrapped model's names."""
    from nbtrain.models.description import layer_slots, slot_module

    names = {id(module): name for name, module in model.named_modules()}
    return tuple(names[id(slot_module(parent, attr))] + "." for slots in layer_slots(model)[start:end]
                 for parent, attr in slots)


def _state(model: nn.Module, full: bool, frozen: bool = True) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=full,
                                                                 ignore_frozen_params=not frozen))
    from nbtrain.run.state.training_state import canonical_name

    return {canonical_name(k, False): v for k, v in state.items()}  # without checkpoint_wrapper's part


def gather_trained(model: nn.Module, plan, mine: tuple[str, ...], buffers: bool = False) -> dict | None:
    """The whole trained state dict on rank 0 (None elsewhere): full tensors on every rank of a stage (with
    ``cpu_offload`` only global rank 0 would get them, and it does not hold the other stages' weights), then each
    stage's first rank sends the weights its stage trained. Another stage's layers, never allocated here (a model
    built on meta), are left out. ``buffers``: the notebook's model is on meta, so it needs the non-persistent
    buffers too (tables a model computes in ``__init__``) and its frozen weights (none changed, but the notebook
    has none), except a peft model's: the notebook gets its adapters back, its base stays where it was read from.
    A notebook model with its weights gets back only what training changes: frozen weights stay as they are there,
    bit for bit, and are never gathered."""
    from nbtrain.models.lora import is_peft

    frozen = buffers and not is_peft(getattr(model, "module", model))
    state = {k: v.detach().cpu() for k, v in _state(model, full=True, frozen=frozen).items() if not v.is_meta}
    if buffers:
        state.update({k: v.detach().cpu() for k, v in _buffers(model).items() if k not in state and not v.is_meta})
    first_of_stage = dist.get_rank() % plan.devices_per_stage == 0
    trained = {k: v for k, v in state.items() if k.startswith(mine)} if first_of_stage else {}
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(trained, parts, dst=0)
    if dist.get_rank() != 0:
        return None
    for part in parts:
        state.update(part)
    return state


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.nn.parallel import DistributedDataParallel

    from nbtrain.run.state.training_state import canonical_name

    ddp = isinstance(model, DistributedDataParallel)
    return {canonical_name(k, ddp): v for k, v in model.named_buffers()}


def load_trained(model: nn.Module, state: dict) -> nn.Module:
    """Put the gathered ``state`` into the notebook's ``model``: copied into its tensors, or, for a model built on
    the meta device, in their place (tied parameters tied again, non-persistent buffers set too)."""
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    lacking = sorted(trainable - set(state))
    if lacking:  # frozen weights need not come back (they did not change); every trained one must
        raise InvalidArgumentError(f"the trained weights came back without {', '.join(lacking[:3])}")
    if not any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        model.load_state_dict(state, strict=False)
        return model
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    keys = set(model.state_dict())
    model.load_state_dict({k: v for k, v in state.items() if k in keys}, assign=True, strict=False)
    for names in aliases.values():  # assign gave each name its own tensor: one parameter again, the first name's
        if not any(n in state for n in names):  # a frozen weight that did not come back (a peft model's base)
            continue
        first = model.get_parameter(next((n for n in names if n in state), names[0]))
        for name in names:
            owner, _, attr = name.rpartition(".")
            model.get_submodule(owner).register_parameter(attr, first)
    for name, value in state.items():
        if name not in keys:
            owner, _, attr = name.rpartition(".")
            module = model.get_submodule(owner)
            if attr in module._buffers:
                module._buffers[attr] = value
    return model


def save_trained(model: nn.Module, mine: tuple[str, ...], folder) -> None:
    """Every rank writes the shards of the weights its stage trained into ``folder`` (DCP's format)."""
    import torch.distributed.checkpoint as dcp

    from nbtrain.run.state.training_state import for_dcp, trained_tensors

    # the model's own names, a tied head once under the embedding's, blocks of a strided shard as DCP needs them
    state = {k: v.detach() for k, v in trained_tensors(model, mine).items()}
    dcp.save(for_dcp(state), checkpoint_id=str(folder))


def load_saved(model: nn.Module, folder) -> nn.Module:
    """Load weights that ``nbtrain.fit(..., save_dir=folder)`` saved into ``model`` (in this process, no group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    if not (Path(folder) / ".metadata").is_file():
        raise InvalidArgumentError(f"{folder} holds no checkpoint (no .metadata): pass the save_dir given to fit")
    saved = set(FileSystemReader(str(folder)).read_metadata().state_dict_metadata)
    state = model.state_dict()
    missing = sorted(set(state) - saved - _tied_aliases(model))
    if missing:
        raise InvalidArgumentError(f"{folder} was saved from another model: it lacks {', '.join(missing[:3])}"
                                   + (f" and {len(missing) - 3} more" if len(missing) > 3 else ""))
    wanted = {k: v for k, v in state.items() if k in saved}
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized, assuming ... a single process": yes
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(wanted, checkpoint_id=str(folder), no_dist=True)
    with torch.no_grad():
        for k, v in wanted.items():
            state[k].copy_(v)
    return model


def _tied_aliases(model: nn.Module) -> set[str]:
    """State-dict names that share their tensor with an earlier name (a tied head): saved once, under the first."""
    seen, aliases = set(), set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            aliases.add(name)
        seen.add(id(tensor))
    return aliases
