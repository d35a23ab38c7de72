"""What a plan's tensors take in one process, measured the way the cost model predicts it.

    >>> model, x = torch.nn.Linear(256, 256), torch.randn(64, 256)
    >>> optimizer = torch.optim.AdamW(model.parameters())
    >>> saved = SavedActivations(exclude=model.parameters())
    >>> with saved.hooks():
    ...     torch.relu(model(x)).sum().backward()
    >>> optimizer.step()
    >>> state_bytes(model, optimizer) + saved.peak        # weights, gradients, two moments; x and relu's output
    1183744

On a GPU the caching allocator counts every byte (``torch.cuda.max_memory_allocated``); on the CPU nothing does,
and the process's resident size is mostly torch itself (~300 MiB before a model has a byte). So nbtrain counts the
tensors: the storages of this rank's parameters, gradients and optimizer state (local shards of DTensors), and the
peak of what autograd saves for backward — each saved storage counted once, from when it is saved until autograd
lets go of it (a weak reference tells). Parameters saved for backward are not counted twice. Buffers a wrapper
keeps for itself (DDP's gradient buckets, FSDP2's gathered copies once freed) are not seen, so the count is a
floor of what the allocator would say.
"""

from __future__ import annotations

import weakref
from contextlib import nullcontext

import torch


def _storage(t: torch.Tensor) -> tuple[int, int] | None:
    """(data pointer, bytes) of a tensor's storage, or None for one without memory of its own (meta, fake)."""
    local = getattr(t, "_local_tensor", t)  # a DTensor's shard on this rank
    try:
        storage = local.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError, AttributeError):
        return None


def state_bytes(model: torch.nn.Module, optimizer=None) -> int:
    """Bytes of this rank's parameters, their gradients and the optimizer's state tensors, each storage once."""
    seen: dict[int, int] = {}

    def add(t) -> None:
        if isinstance(t, torch.Tensor):
            found = _storage(t)
            if found and found[0]:
                seen[found[0]] = found[1]

    for p in model.parameters():
        add(p)
        add(p.grad)
    for state in getattr(optimizer, "state", {}).values() if optimizer is not None else ():
        for value in state.values() if isinstance(state, dict) else ():
            if isinstance(value, torch.Tensor) and value.numel() > 1:  # not the step counters
                add(value)
    return sum(seen.values())


def count_where_needed(device: torch.device, exclude=()) -> "SavedActivations | None":
    """A count of the tensors saved for backward where nothing else counts them (the CPU), or None on a GPU, whose
    caching allocator's peak counts them (``torch.cuda.max_memory_allocated``): the trainer's, the hot-switching
    loop's and the profile's timed steps', so that all three pay the count's hooks where, and only where, a step
    does. Entered with :func:`counting`."""
    return None if device.type == "cuda" else SavedActivations(exclude=exclude)


def counting(saved: "SavedActivations | None"):
    """``saved``'s hooks, or nothing where there is no count (:func:`count_where_needed` on a GPU)."""
    return saved.hooks() if saved is not None else nullcontext()


class SavedActivations:
    """Live and peak bytes of the tensors autograd saves for backward while :meth:`hooks` is entered."""

    def __init__(self, exclude=()):
        self.live = 0
        self.peak = 0
        self._counts: dict[int, list[int]] = {}  # data pointer → [bytes, saved references alive]
        self._exclude = {found[0] for t in exclude if (found := _storage(t))}
        self._refs: dict[int, weakref.ref] = {}  # the saved tensors' weak references, alive until their tensor goes

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        found = _storage(t)
        if not found or not found[0] or found[0] in self._exclude:
            return t
        pointer, nbytes = found
        entry = self._counts.get(pointer)
        if entry is None:
            self._counts[pointer] = [nbytes, 1]
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        else:
            entry[1] += 1
        # autograd keeps a new tensor on the same storage, not ``t`` itself: a tensor its own op saves (an
        # activation's output), packed as itself, holds its grad_fn and is held by it, a cycle through autograd that
        # Python's collector cannot see, so a graph dropped without a backward (a pipeline stage's shape inference)
        # was never freed. The storage is counted until both are gone: autograd's copy and the caller's tensor
        packed = t.detach()
        holders = [2]
        refs = self._refs

        def one_gone(ref) -> None:
            del refs[id(ref)]
            holders[0] -= 1
            if holders[0] == 0:
                self._release(pointer)

        # weak references with a callback, kept alive here, not weakref.finalize: a finalizer costs ~5 µs to make,
        # and a small model's step saves ~85 tensors (1.0-1.3 ms of a 11 ms 2-process step went to this hook)
        for tensor in (packed, t):  # keyed by the reference's id: two references to live tensors compare by ==
            ref = weakref.ref(tensor, one_gone)
            refs[id(ref)] = ref
        return packed

    def _release(self, pointer: int) -> None:
        entry = self._counts.get(pointer)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self._counts[pointer]
