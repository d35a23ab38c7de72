"""One device per rank, and everything a worker computes on placed through it.

    >>> device = rank_device()                       # in a worker: cuda:LOCAL_RANK under NCCL, the CPU under gloo
    >>> model = parallelize(model, plan, meshes)     # FSDP2 and DTensor put their shards there; place_module the rest
    >>> off_device(model, device)                    # every parameter and buffer (its local shard) is there
    []
    >>> ids, targets = to_device((ids, targets), device)   # from host memory: pinned, then copied without blocking
    >>> reset_peak_memory(device)                    # each step; peak_memory(device) then reads the allocator's peak

A worker takes its device once, from this module, and passes it on: the mesh's device type, DDP's ``device_ids``, the
pipeline stage's buffers, the trainer's batches and loss accumulators, the offload's copy stream and the switches'
buffers all come from :func:`rank_device`. Nothing else in ``nbtrain/run/`` asks ``torch.cuda.is_available()``
to decide where a tensor goes, so the same code runs on the CPU under gloo as it does on a GPU under NCCL.

What the plan shards is placed by torch itself: ``fully_shard`` moves each layer's parameters to its mesh's device
before cutting them, and ``parallelize_module`` distributes each split weight onto the mesh's device; whatever
neither wraps (a replicated layer of a per-layer mix, a norm inside a tensor-parallel block, buffers such as RoPE
tables) is moved by :func:`place_module` after the plan is applied, one tensor at a time, so a GPU never holds the
whole model of a plan that shards it. Parameters keep their identity (``param.data`` is replaced, as
``nn.Module.to`` does), so tied weights stay tied and the wrappers' references hold.

``NBTRAIN_STRICT_DEVICE=1`` checks this on a machine without a GPU: in every worker a tensor that the executor's
code (``nbtrain/run/``, gradient clipping) makes without naming its device is put on ``meta`` (:func:`strict_placement`), where it has no values, so the
step that uses it fails at once, or shows on the wrong device, instead of computing on the CPU by accident as it
would on a GPU machine (tests/test_placement.py runs every plan kind so).
"""

from __future__ import annotations

import os
import resource
import sys
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map


def _uses_nccl() -> bool:
    """Whether this process's group communicates with NCCL (a group not yet made will: the launch picks NCCL
    whenever CUDA is there)."""
    if not dist.is_available() or not dist.is_initialized():
        return True
    return "nccl" in str(dist.get_backend())


def rank_device() -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` (made the current CUDA device) when CUDA is there and the group is
    NCCL's, else the CPU. ``torch.device("cuda", 1)`` on the second GPU of a node; ``torch.device("cpu")`` here."""
    if torch.cuda.is_available() and _uses_nccl():
        index = int(os.environ.get("LOCAL_RANK", torch.cuda.current_device()))
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


# torch's factories that take a device and default to torch's default device (a ``*_like`` takes its input's)
_FACTORIES = ("empty", "zeros", "ones", "full", "arange", "tensor", "as_tensor", "scalar_tensor", "rand", "randn",
              "randint", "randperm", "linspace", "eye")


# the code that runs a step: what it makes, it makes on the rank's device or names the host (the data layer makes
# batches in host memory by design; the trainer moves each micro-batch)
_EXECUTOR = ("nbtrain.run.", "nbtrain.gradients")


class _NbtrainTensorsOnMeta(TorchFunctionMode):
    """Factory calls made without a device by the executor's code go to ``meta``; torch's, the model's, the data
    layer's and the user's are left as they are (torch computes metadata on the default device, which is right)."""

    factories = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.factories is None:
            type(self).factories = {getattr(torch, name) for name in _FACTORIES}
        if func in self.factories and kwargs.get("device") is None:
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith(_EXECUTOR):
                kwargs = {**kwargs, "device": "meta"}
        return func(*args, **kwargs)


def strict_placement():
    """The context a worker runs in: under ``NBTRAIN_STRICT_DEVICE=1`` a tensor nbtrain makes without naming its
    device is on ``meta`` (module docstring), otherwise nothing changes."""
    return _NbtrainTensorsOnMeta() if os.environ.get("NBTRAIN_STRICT_DEVICE") == "1" else nullcontext()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def place_module(module: nn.Module, device: torch.device, *, skip: set = frozenset()) -> nn.Module:
    """Move every parameter and buffer of ``module`` that is not yet on ``device`` there, in place; DTensors (FSDP2's
    and tensor parallelism's, already on their mesh's device) and the parameters in ``skip`` are left alone.
    Returns ``module``."""
    skipped = {id(p) for p in skip}
    with torch.no_grad():
        for sub in module.modules():
            for name, param in sub._parameters.items():
                if param is None or isinstance(param, DTensor) or id(param) in skipped or param.device == device:
                    continue
                param.data = param.data.to(device)  # the same Parameter: ties and wrappers keep it
                if param.grad is not None:
                    param.grad = param.grad.to(device)
            for name, buffer in sub._buffers.items():
                if buffer is not None and not isinstance(buffer, DTensor) and buffer.device != device:
                    sub._buffers[name] = buffer.to(device)
    return module


def off_device(module: nn.Module, device: torch.device, *, skip: set = frozenset()) -> list[str]:
    """Names of ``module``'s parameters and buffers (their local shards) that are not on ``device``: what a worker
    would compute on in the wrong place. Empty once :func:`place_module` has run."""
    skipped = {id(p) for p in skip}
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    return [name for name, t in named if id(t) not in skipped and _local(t).device != device]


def to_device(tree, device: torch.device):
    """Every tensor of ``tree`` (a tensor, tuple, list or dict of them) on ``device``; anything else as it is. From
    host memory to a GPU the tensor is pinned first and copied without blocking the host (the copy is ordered
    before the kernels that read it on the current stream)."""
    def move(t):
        if not isinstance(t, torch.Tensor) or t.device == device:
            return t
        if device.type == "cuda" and t.device.type == "cpu":
            return t.pin_memory().to(device, non_blocking=True)
        return t.to(device)

    return tree_map(move, tree)


def to_host(tree):
    """Every tensor of ``tree`` detached and in host memory (for logging, or the notebook)."""
    return tree_map(lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t, tree)


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a GPU runs kernels after the host queues them: a time read before
    this is the queueing's, not the work's); nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak of the allocator's memory on a GPU (per step); nothing on the CPU, which has no allocator
    to ask (:mod:`nbtrain.tensor_memory` counts the tensors there)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device | None = None) -> int:
    """Peak allocated memory on ``device`` since :func:`reset_peak_memory` (CUDA), or this process's peak resident
    memory on the CPU."""
    device = rank_device() if device is None else device
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
