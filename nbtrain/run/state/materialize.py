"""A model's tensors allocated where a rank holds them, and given their values there, after the plan is applied.

    >>> with torch.device("meta"):                  # in the notebook: no memory for the weights
    ...     model = LlamaForCausalLM(config)
    >>> result = nbtrain.fit(model, batches, plan="dp_shard=2", steps=10, num_processes=2)   # each rank: its shards

Every worker trains a *meta twin* of the model it was given (:func:`meta_twin`: the same modules, every parameter and
buffer on the meta device, ties kept), so applying the plan allocates nothing; :func:`materialize` then allocates
what this rank runs on its device (``to_empty``: FSDP2 and DTensor allocate only the local shard) and fills it, one
module at a time, from one of two places:

- the model the notebook holds (:class:`FromModel`): each rank copies its slice of each tensor, so a worker never
  makes a second whole copy of the model (a forked worker only reads the pages it shares with the notebook);
- the model's own initialisation (:class:`Initialize`), for a model built on the meta device: for each module that
  holds tensors, full-size tensors are made in host memory, the module's initialisation runs on them under a seed of
  its own (``seed`` and the module's name: the same values whatever the plan, the rank or the order, so a plan
  trains like one process from the same seed), and the rank keeps its slice. The initialisation is the user's
  ``init_fn(module)`` if given, else the module's ``reset_parameters()`` followed by the model's
  ``_init_weights(module)`` (transformers' models, nbtrain's GPT), whichever exist. A buffer no initialisation sets
  (a table computed in ``__init__`` of a module without one) is refused with its name, as a parameter is.

At most one module's full tensors are in host memory at a time (the largest is usually the embedding).
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from nbtrain.errors import InvalidArgumentError
from nbtrain.run.state.training_state import canonical_name, local_indices


def has_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the meta device (built under ``torch.device("meta")``)."""
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def meta_twin(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are on the meta device (nothing allocated; tied parameters
    stay one parameter; every other attribute copied as ``copy.deepcopy`` copies it)."""
    memo: dict = {}
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in memo:
            meta = torch.empty_like(t, device="meta")
            memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def hold_frozen_in(model: nn.Module, dtype: torch.dtype) -> list[str]:
    """Make the frozen floating-point parameters of ``model`` (a meta twin, before it is parallelized and filled)
    ``dtype``: a frozen weight needs no fp32 master copy (nothing updates it), so under bf16 compute it is held in
    bf16, as torchtune runs LoRA, half the bytes of its fp32 copy; its values are cast as they are filled. Returns
    their names."""
    changed = []
    for name, p in model.named_parameters():
        if not p.requires_grad and p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
            changed.append(name)
    return changed


@dataclass(frozen=True)
class FromModel:
    """Values from the tensors of ``model`` (the notebook's), read by each tensor's canonical name."""

    model: nn.Module

    def tensors(self) -> dict[str, torch.Tensor]:
        named = [*self.model.named_parameters(remove_duplicate=False), *self.model.named_buffers(remove_duplicate=False)]
        return {canonical_name(name, False): t for name, t in named}


@dataclass(frozen=True)
class Initialize:
    """Values from the model's own initialisation, each module under ``seed`` and its name (module docstring)."""

    seed: int = 0
    init_fn: Callable[[nn.Module], None] | None = None


def module_seed(seed: int, name: str) -> int:
    """The seed a module is initialised under: the same for a name and a seed in every process and plan."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def initializer(model: nn.Module, init_fn: Callable | None = None) -> Callable[[nn.Module], None]:
    """What initialises one module of ``model`` (module docstring); a peft LoRA adapter as peft's default
    (``init_lora_weights=True``) does: A as ``nn.Linear`` resets itself (Kaiming-uniform), B zeros, so that a new
    LoRA starts as its base."""
    if init_fn is not None:
        return init_fn
    own = getattr(model, "_init_weights", None)
    a_side, b_side = lora_sides(model)

    def init(module: nn.Module) -> None:
        if id(module) in b_side:
            nn.init.zeros_(module.weight)
            return
        if callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()
        if callable(own) and id(module) not in a_side:
            own(module)

    return init


def lora_sides(model: nn.Module) -> tuple[set[int], set[int]]:
    """The ids of a peft model's LoRA A and B layers (none for another model)."""
    from nbtrain.models.lora import lora_parts

    a_side, b_side = set(), set()
    for module in model.modules():
        parts = lora_parts(module)
        if parts is not None:
            a_side |= {id(m) for m in parts[1].values()}
            b_side |= {id(m) for m in parts[2].values()}
    return a_side, b_side


def lora_init_problem(model: nn.Module) -> str:
    """Why a peft model built on meta cannot be initialised where it is materialised: an adapter whose
    ``init_lora_weights`` is not peft's default (empty: it can)."""
    for name, config in (getattr(model, "peft_config", None) or {}).items():
        how = getattr(config, "init_lora_weights", True)
        if how is not True:
            return (f"adapter {name!r} is initialised as init_lora_weights={how!r}, which nbtrain does not redo on "
                    "the meta device (it does peft's default: A Kaiming-uniform, B zero); build the LoRA model on the "
                    "CPU, or with peft's default init")
    return ""


def uninitializable(model: nn.Module, init_fn: Callable | None = None) -> list[str]:
    """Parameters of ``model`` that nothing would initialise (no ``init_fn``, no
    ``reset_parameters``, no ``_init_weights`` on the model): a meta model is refused with these before launching."""
    if init_fn is not None or callable(getattr(model, "_init_weights", None)):
        return []
    return [f"{name}.{attr}" if name else attr for name, m in model.named_modules()
            if not callable(getattr(m, "reset_parameters", None)) for attr, _ in m.named_parameters(recurse=False)]


def check_materializable(model: nn.Module, init_fn: Callable | None, traced: bool = False) -> None:
    """Refuse, before launching, a model on the meta device that the workers could not materialise: one only partly
    there, one with parameters nothing initialises, or one whose pipeline stages are traced."""
    tensors = [*model.parameters(), *model.buffers()]
    on_meta = [t.is_meta for t in tensors]
    if not any(on_meta):
        if init_fn is not None:
            raise InvalidArgumentError("init_fn initialises a model built on the meta device; this one's tensors are "
                                       "allocated already (drop init_fn, or build the model under "
                                       "torch.device('meta'))")
        return
    if not all(on_meta):
        raise InvalidArgumentError(f"{type(model).__name__} is partly on the meta device ({sum(on_meta)} of "
                                   f"{len(on_meta)} tensors): build it all under torch.device('meta'), or all on "
                                   "the CPU")
    if init_fn is not None and not callable(init_fn):
        raise InvalidArgumentError(f"init_fn must be a function of one module, got {type(init_fn).__name__}")
    if init_fn is None and lora_init_problem(model):
        raise InvalidArgumentError(f"{type(model).__name__} was built on the meta device, and its "
                                   f"{lora_init_problem(model)}")
    missing = uninitializable(model, init_fn)
    if missing:
        raise InvalidArgumentError(
            f"{type(model).__name__} was built on the meta device, but nothing initialises {', '.join(missing[:3])}"
            f"{' and more' if len(missing) > 3 else ''} (no reset_parameters, no _init_weights on the model); give "
            "init_fn=lambda module: ..., or build the model on the CPU")
    init = initializer(model, init_fn)
    for name, module in model.named_modules():  # a table computed in __init__ that no initialisation sets again
        if any(b is not None and b.dtype.is_floating_point for b in module._buffers.values()):
            _initial_values(module, name, init, 0)  # raises, naming it (buffers are small; this runs on the CPU)
    if traced:
        raise InvalidArgumentError(f"{type(model).__name__} was built on the meta device and its pipeline stages are "
                                   "traced graphs, which need its weights; build it on the CPU for pp > 1, or plan "
                                   "with pp=1")


@dataclass
class _Group:
    """One tensor of the model under all its names (a tied parameter has several), canonical, in module order."""

    names: list[str]
    buffer: bool


def _groups(model: nn.Module) -> dict[int, _Group]:
    groups: dict[int, _Group] = {}
    for buffer, named in ((False, model.named_parameters(remove_duplicate=False)),
                          (True, model.named_buffers(remove_duplicate=False))):
        for name, t in named:
            groups.setdefault(id(t), _Group([], buffer)).names.append(canonical_name(name, False))
    return groups


def modules_by_name(model: nn.Module) -> dict[str, nn.Module]:
    """Canonical name → module (a wrapper's inner module under the wrapped name)."""
    # ("blocks.0._checkpoint_wrapped_module" + ".") → "blocks.0.": the inner module comes after its wrapper, and wins
    return {canonical_name(name + ".", False)[:-1] if name else name: m for name, m in model.named_modules()}


def _slot(modules: dict[str, nn.Module], name: str) -> tuple[nn.Module, str]:
    owner, _, attr = name.rpartition(".")
    return modules[owner], attr


def _get(module: nn.Module, attr: str) -> torch.Tensor:
    return module._parameters[attr] if attr in module._parameters else module._buffers[attr]


def materialize(model: nn.Module, roots: list[nn.Module], device: torch.device, values: FromModel | Initialize) -> None:
    """Allocate on ``device`` every meta tensor of ``roots`` (modules of ``model``: all of it, or a pipeline stage's
    layers), and fill it from ``values``; the rest of ``model`` stays on meta. Ties are kept (a tied parameter of a
    stage under another stage's name too). Raises :class:`InvalidArgumentError` for a tensor nothing gives a value."""
    under = {id(m) for root in roots for m in root.modules()}
    modules = modules_by_name(model)
    wanted = []
    for group in _groups(model).values():
        held = [n for n in group.names if id(_slot(modules, n)[0]) in under]
        if held and _get(*_slot(modules, held[0])).is_meta:
            wanted.append(group)
    with torch.no_grad():
        for root in roots:
            root.to_empty(device=device)  # FSDP2 and DTensor allocate each rank's local shard only
        for group in wanted:  # to_empty made new Parameters where it could not swap data in: one again under all names
            real = next(t for t in (_get(*_slot(modules, n)) for n in group.names) if not t.is_meta)
            for name in group.names:
                module, attr = _slot(modules, name)
                if _get(module, attr) is not real:
                    (module._buffers if group.buffer else module._parameters)[attr] = real
        if isinstance(values, FromModel):
            source = values.tensors()
            for group in wanted:
                name = next((n for n in group.names if n in source), None)
                if name is None:
                    raise InvalidArgumentError(f"the model has no tensor {group.names[0]} to start from")
                _fill(_get(*_slot(modules, group.names[0])), source[name])
            return
        init = initializer(model, values.init_fn)
        by_owner: dict[str, list[_Group]] = {}
        for group in wanted:  # a tensor is initialised by the first module holding it (the embedding, when tied)
            by_owner.setdefault(group.names[0].rpartition(".")[0], []).append(group)
        for owner, groups in by_owner.items():
            full = _initial_values(modules[owner], owner, init, values.seed)
            for group in groups:
                attr = group.names[0].rpartition(".")[2]
                _fill(_get(*_slot(modules, group.names[0])), full[attr])


def _initial_values(module: nn.Module, name: str, init: Callable, seed: int) -> dict[str, torch.Tensor]:
    """``module``'s tensors, full size in host memory, as its initialisation sets them under its own seed (the
    module's real tensors, sharded or meta, are put back after)."""
    params, buffers = dict(module._parameters), dict(module._buffers)
    full: dict[str, torch.Tensor] = {}
    try:
        for attr, p in params.items():
            if p is not None:
                module._parameters[attr] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="cpu"),
                                                        requires_grad=p.requires_grad)
        for attr, b in buffers.items():
            if b is not None:  # NaN: what no initialisation wrote shows
                module._buffers[attr] = torch.full(b.shape, float("nan"), dtype=b.dtype, device="cpu") \
                    if b.dtype.is_floating_point else torch.zeros(b.shape, dtype=b.dtype, device="cpu")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(module_seed(seed, name))
            init(module)
        full = {attr: t.detach() for attr, t in [*module._parameters.items(), *module._buffers.items()]
                if t is not None}
    finally:
        module._parameters.update(params)
        module._buffers.update(buffers)
    unset = [attr for attr, t in full.items() if t.dtype.is_floating_point and bool(torch.isnan(t).any())]
    if unset:
        where = f"{name}.{unset[0]}" if name else unset[0]
        raise InvalidArgumentError(
            f"{where} ({type(module).__name__}) was built on the meta device and its initialisation does not set it "
            "(a table computed in __init__); build the model on the CPU, or give init_fn=... that sets it")
    return full


def _fill(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy into ``target`` (a plain tensor, or a DTensor's local shard) its part of the full tensor ``full``."""
    if isinstance(target, DTensor):
        piece = full
        for dim, index in enumerate(local_indices(target)):
            piece = piece.index_select(dim, index.to(piece.device))
        target.to_local().copy_(piece)
    else:
        target.copy_(full)
