"""Count a model's identical blocks once: the fake step runs a few of each kind, and the rest take their figures.

A 70B Llama has 80 blocks that compute the same thing on the same shapes; counting all of them on fake tensors is
most of the ~10 s a first ``nbtrain plan llama-70b`` takes on 2 cores. :func:`block_groups` sorts the blocks into
groups of structural twins, conservatively: the same module classes, parameters and buffers (shapes, dtypes,
trained or not), the same plain attributes on every submodule (a sliding window, ``attention_type``, ``is_sliding``:
sliding and global layers differ; a mixture of experts and a dense MLP have other modules), the same entry in every
per-layer list of the model's config (``layer_types``, which Hugging Face forwards index by position), the same
number of hooks; only an attribute that counts the blocks (``layer_idx``: ``i + c`` on every block) is left out.

:func:`stand_in_plan` then counts, of each group, its first three blocks and its last, and lets every other block
*stand in* (:class:`StandIns`): its forward, during the count, only copies its input, and it takes the figures of
its group's third block. The first block of a group may cost more than the others (the first to save a tensor
they share, Hugging Face's RoPE tables or a mask, is the one charged for it), the last hands its output to the head,
and the second and third must agree (the steady state: :class:`TwinsDiffer` otherwise). Blocks keep their places,
so a forward that looks up ``config.layer_types[i]`` by position gets what it gets in the full count.

    >>> model = nbtrain.build_preset("llama-70b")          # on the meta device
    >>> groups = block_groups(model, list(model.blocks))   # one group: its 80 blocks are twins
    >>> plan = stand_in_plan(groups)                         # count blocks 0, 1, 2 and 79; 3..78 take block 2's
    >>> set(groups), sorted(plan.counted), plan.stand_in[40], plan.check
    ({0}, [0, 1, 2, 79], 2, [(1, 2)])

What would make a stand-in count differently from the block it replaces raises :class:`TwinsDiffer` during the
step, and the caller counts every block (:func:`nbtrain.profiler.trace.count`): another tensor that needs a gradient
entering the block (T5's position bias: its gradients add up across blocks), a block run twice, or out of order, or
not at all, an output that is not one tensor shaped like the input, or an input unlike its twin's.
"""

from __future__ import annotations

import enum
import functools
import re
import types
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from nbtrain.profiler.segments import tensors_in

COUNTED_PER_GROUP = 3
"""The first blocks of a group counted in full: the first (charged for what the blocks share), and two more that
must agree (the steady state every other twin takes)."""

_MODULE_INTERNALS = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "training",
                               "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                               "_load_state_dict_post_hooks"})
"""``nn.Module``'s own bookkeeping: parameters, buffers and submodules are compared on their own; the hooks that run
in a forward or backward are compared by number (every ``_..._hooks`` dict not listed here)."""


class TwinsDiffer(Exception):
    """The blocks that were to stand in for their twins would not count as they do: count every block."""


def _plain(value, depth: int = 0):
    """A hashable account of an attribute's value, as far as it can decide what a block computes: scalars, strings,
    dtypes and enums by value, containers of them item by item, tensors by shape and dtype, functions by name; any
    other object by identity (one config shared by every block is one object; a distinct object per block tells the
    blocks apart, which only costs time)."""
    if isinstance(value, (bool, int, float, str, type(None))):
        return type(value).__name__, value
    if isinstance(value, (torch.dtype, torch.device, torch.Size, enum.Enum)):
        return type(value).__name__, repr(value)
    if depth < 4 and isinstance(value, (tuple, list, set, frozenset)):
        items = sorted(map(repr, value)) if isinstance(value, (set, frozenset)) else value
        return type(value).__name__, tuple(_plain(v, depth + 1) for v in items)
    if depth < 4 and isinstance(value, dict):
        return "dict", tuple(sorted((repr(k), _plain(v, depth + 1)) for k, v in value.items()))
    if isinstance(value, torch.Tensor):
        return "tensor", tuple(value.shape), str(value.dtype), value.requires_grad
    if isinstance(value, nn.Module) and depth < 2:  # one not registered as a submodule (transformers' kernel
        tensors = tuple((n, tuple(t.shape), str(t.dtype), t.requires_grad)  # functions, kept in a dict)
                        for n, t in (*value.named_parameters(), *value.named_buffers()))
        return "module", tensors, tuple(sorted(_attributes(value, depth + 1).items()))
    builtin = isinstance(value, types.BuiltinFunctionType) and \
        isinstance(value.__self__, (types.ModuleType, type(None)))
    if isinstance(value, types.FunctionType) or builtin:  # a method bound to an object: by identity, below
        return "function", getattr(value, "__module__", None), value.__qualname__
    if isinstance(value, functools.partial) and depth < 4:  # transformers' activations (gelu, approximate="tanh")
        return "partial", _plain(value.func, depth + 1), _plain(value.args, depth + 1), \
            _plain(value.keywords, depth + 1)
    return "object", id(value)


def _attributes(block: nn.Module, depth: int = 0) -> dict[tuple[str, str], object]:
    """Every attribute of every module of ``block`` that is no parameter, buffer or submodule, by (module, name)."""
    out = {}
    for name, module in block.named_modules():
        out[(name, "__class__")] = ("class", type(module).__module__, type(module).__qualname__)
        for key, value in vars(module).items():
            if key in _MODULE_INTERNALS:
                continue
            if key.startswith("_") and key.endswith("hooks") and isinstance(value, dict):
                out[(name, key)] = ("hooks", len(value))
            else:
                out[(name, key)] = _plain(value, depth)
    return out


def _counts_blocks(values: dict[int, object]) -> bool:
    """Whether an attribute's values on the blocks that have it are their index plus one constant (``layer_idx``)
    on three blocks or more: it names the block and says nothing of what it computes."""
    if len(values) < 3 or not all(v[0] == "int" for v in values.values()):
        return False
    return len({v[1] - i for i, v in values.items()}) == 1


def _own_path_unnamed(value, index: int):
    """``value`` (as :func:`_plain` gives it) with the block's own place in a dotted module path written ``#``:
    peft keeps each adapter layer's full name (``kwargs["target_name"] = "blocks.1.attn.q"``), which names the block
    and says nothing of what it computes, as ``layer_idx`` does."""
    if isinstance(value, tuple):
        if len(value) == 2 and value[0] == "str" and isinstance(value[1], str):
            return "str", re.sub(rf"(?<![0-9])\.{index}(?=\.|$)", ".#", value[1])
        return tuple(_own_path_unnamed(v, index) for v in value)
    return value


def _configs(model: nn.Module, blocks: list[nn.Module]) -> list:
    """The configs the model's modules outside its blocks hold (and the configs they nest), each once."""
    inside = {id(m) for block in blocks for m in block.modules()}
    found: dict[int, object] = {}
    for module in model.modules():
        config = getattr(module, "config", None) if id(module) not in inside else None
        if config is not None and not isinstance(config, (nn.Module, torch.Tensor)) and hasattr(config, "__dict__"):
            found.setdefault(id(config), config)
            for nested in getattr(config, "__dict__", {}).values():
                if type(nested).__name__.endswith("Config") and hasattr(nested, "__dict__"):
                    found.setdefault(id(nested), nested)
    return list(found.values())


def _per_layer_entries(model: nn.Module, blocks: list[nn.Module]) -> list[tuple]:
    """For each block, its entry in every list of the model's configs that has one entry per block and not all alike
    (``layer_types``, ``mlp_only_layers`` as flags, ...): a forward may look them up by the block's position."""
    n = len(blocks)
    lists = []
    for config in _configs(model, blocks):
        for key, value in sorted(getattr(config, "__dict__", {}).items()):
            if isinstance(value, (list, tuple)) and len(value) == n and len({repr(v) for v in value}) > 1:
                lists.append((key, value))
    return [tuple((key, _plain(value[i])) for key, value in lists) for i in range(n)]


def block_groups(model: nn.Module, blocks: list[nn.Module]) -> list[int]:
    """A group id per block: blocks share one when they are structural twins (the module docstring says what is
    compared). A module or parameter that two blocks share makes every block its own group."""
    n = len(blocks)
    owners: dict[int, int] = {}
    for i, block in enumerate(blocks):
        for t in (*block.modules(), *block.parameters(), *block.buffers()):
            if owners.setdefault(id(t), i) != i:  # shared weights: their gradients add up across blocks
                return list(range(n))
    attributes = [{key: _own_path_unnamed(value, i) for key, value in _attributes(block).items()}
                  for i, block in enumerate(blocks)]
    by_name: dict[tuple[str, str], dict[int, object]] = {}
    for i, attrs in enumerate(attributes):
        for key, value in attrs.items():
            by_name.setdefault(key, {})[i] = value
    counting = {key for key, values in by_name.items() if _counts_blocks(values)}
    entries = _per_layer_entries(model, blocks)
    ids: dict[tuple, int] = {}
    groups = []
    for i, block in enumerate(blocks):
        tensors = tuple((name, tuple(t.shape), str(t.dtype), t.requires_grad)
                        for name, t in (*block.named_parameters(), *block.named_buffers()))
        attrs = tuple(sorted((key, "counts blocks" if key in counting else value)
                             for key, value in attributes[i].items()))
        groups.append(ids.setdefault((tensors, attrs, entries[i]), len(ids)))
    return groups


@dataclass
class StandInPlan:
    """Which blocks a count runs and which take a twin's figures (indices into the model's blocks)."""

    stand_in: dict[int, int]
    """A block that only copies its input during the count → the counted twin whose figures it takes."""
    check: list[tuple[int, int]]
    """Pairs of counted twins that must count the same (else :class:`TwinsDiffer`)."""
    counted: set[int] = field(default_factory=set)
    """The blocks counted in full."""


def stand_in_plan(groups: list[int]) -> StandInPlan | None:
    """Count the first :data:`COUNTED_PER_GROUP` blocks of each group and its last; the others take the figures of
    the group's last of the first ones. ``None`` when every block is counted anyway."""
    members: dict[int, list[int]] = {}
    for i, group in enumerate(groups):
        members.setdefault(group, []).append(i)
    stand_in, check = {}, []
    for blocks in members.values():
        if len(blocks) <= COUNTED_PER_GROUP + 1:
            continue
        twin = blocks[COUNTED_PER_GROUP - 1]
        stand_in.update((i, twin) for i in blocks[COUNTED_PER_GROUP:-1])
        check.append((blocks[COUNTED_PER_GROUP - 2], twin))
    if not stand_in:
        return None
    return StandInPlan(stand_in, check, set(range(len(groups))) - set(stand_in))


@dataclass
class _Seen:
    """What a block whose figures others take was given and returned in the counted step."""

    hidden: tuple  # the input hidden state: shape, dtype, requires_grad
    spec: object = None  # the output's structure, and which of its leaves is the hidden state
    leaves: list = field(default_factory=list)
    at: int = 0
    requires_grad: bool = False  # whether its output needs a gradient
    output_saved: bool = False  # whether its output was saved for backward by the time the block returned


def _hidden_of(args, kwargs) -> tuple[torch.Tensor, tuple]:
    """The hidden state a block is given, and what else it is given that needs a gradient (must be nothing: the
    gradients a stand-in does not send back would change how the others add up)."""
    tensors = tensors_in((args, kwargs))
    if not tensors:
        raise TwinsDiffer("a block was given no tensor")
    hidden = tensors[0]
    if any(t.requires_grad for t in tensors[1:]):
        raise TwinsDiffer("a block takes another tensor that needs a gradient")
    return hidden, (tuple(hidden.shape), hidden.dtype, hidden.requires_grad)


class StandIns:
    """During a count, the blocks of ``plan.stand_in`` only copy their input (their twin's output structure around
    it); :meth:`fill` then gives each stand-in's segment its twin's figures. ``saved`` is the count's
    :class:`~nbtrain.profiler.observers.SavedBytes`: a stand-in's output counts as saved when its twin's did."""

    def __init__(self, blocks: list[nn.Module], plan: StandInPlan, saved):
        self.blocks, self.plan, self.saved = blocks, plan, saved
        self.seen: dict[int, _Seen] = {}
        self.calls: dict[int, int] = {}
        self._handles: list = []
        self._forwards: dict[int, object] = {}

    def __enter__(self) -> "StandIns":
        for i in range(len(self.blocks)):
            self._handles.append(self.blocks[i].register_forward_pre_hook(self._called(i), with_kwargs=True))
        for i in set(self.plan.stand_in.values()):
            self._handles.append(self.blocks[i].register_forward_pre_hook(self._twin_enters(i), with_kwargs=True))
            self._handles.append(self.blocks[i].register_forward_hook(self._twin_returns(i), with_kwargs=True))
        for i in self.plan.stand_in:
            block = self.blocks[i]
            if "forward" in vars(block):
                self._forwards[i] = vars(block)["forward"]
            block.forward = self._stand_in(i)
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for i in self.plan.stand_in:
            del self.blocks[i].forward
            if i in self._forwards:
                self.blocks[i].forward = self._forwards[i]

    def _called(self, i: int):
        def hook(module, args, kwargs):
            self.calls[i] = self.calls.get(i, 0) + 1
            if self.calls[i] > 1:
                raise TwinsDiffer(f"block {i} ran twice")
        return hook

    def _twin_enters(self, i: int):
        def hook(module, args, kwargs):
            hidden, shape = _hidden_of(args, kwargs)
            self.seen[i] = _Seen(shape)
            self._entering = hidden
        return hook

    def _twin_returns(self, i: int):
        def hook(module, args, kwargs, output):
            leaves, spec = tree_flatten(output)
            at = [k for k, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
            if len(at) != 1:
                raise TwinsDiffer(f"block {i} returns {len(at)} tensors")
            out, seen = leaves[at[0]], self.seen[i]
            same_storage = out.untyped_storage()._cdata == self._entering.untyped_storage()._cdata
            if (tuple(out.shape), out.dtype) != seen.hidden[:2] or same_storage:
                raise TwinsDiffer(f"block {i} returns other than a new tensor shaped like its input")
            seen.spec, seen.leaves, seen.at = spec, leaves, at[0]
            seen.requires_grad = out.requires_grad
            seen.output_saved = self.saved.holds(out)
        return hook

    def _stand_in(self, i: int):
        twin = self.plan.stand_in[i]

        def forward(*args, **kwargs):
            seen = self.seen.get(twin)
            if seen is None or seen.spec is None:
                raise TwinsDiffer(f"block {i} ran before its twin, block {twin}")
            hidden, shape = _hidden_of(args, kwargs)
            if shape != seen.hidden:
                raise TwinsDiffer(f"block {i} is given {shape}, its twin block {twin} {seen.hidden}")
            out = hidden.clone()  # a new tensor, as the block's output is, on the gradient's path
            if out.requires_grad != seen.requires_grad:
                raise TwinsDiffer(f"block {i}'s output would need a gradient where its twin's does not")
            if seen.output_saved:
                self.saved.mark(out)
            return tree_unflatten([out if k == seen.at else leaf for k, leaf in enumerate(seen.leaves)], seen.spec)
        return forward

    def fill(self, values: dict[str, dict[int, int]]) -> None:
        """Check that every block ran once and the steady-state twins agree, then give each stand-in's segment
        (block ``i`` is segment ``i + 1``) its twin's figures."""
        missing = [i for i in range(len(self.blocks)) if self.calls.get(i) != 1]
        if missing:
            raise TwinsDiffer(f"blocks {missing[:5]} did not run once")
        for a, b in self.plan.check:
            differ = [q for q, per in values.items() if per[a + 1] != per[b + 1]]
            if differ:
                raise TwinsDiffer(f"blocks {a} and {b} count differently ({', '.join(differ[:3])})")
        for i, twin in self.plan.stand_in.items():
            for per in values.values():
                per[i + 1] = per[twin + 1]
