"""The AdamW state of each piece of a parameter (:class:`Piece`) and of each layer, its update on the CPU
(speculative when clipping), the global gradient norm, and checkpoints.

A checkpoint of :class:`~nbtrain.run.offload.optimizer.OffloadedAdamW` holds whole tensors per parameter, whatever the split.
Its layout is ``torch.optim.AdamW``'s (``state[i]`` with ``step``, ``exp_avg``, ``exp_avg_sq``; ``param_groups``
with ``params`` as indices) plus ``master``, the fp32 weights, so a state saved under one offload split loads under
another, and a plain AdamW state dict over the same parameters loads too. Under FSDP2 (DTensor parameters) each
rank's state dict holds its own shards, shaped like its local tensors.
"""

from __future__ import annotations

from time import perf_counter

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw

from nbtrain.errors import InvalidArgumentError
from nbtrain.run.parallel.mesh import local_shard


class Piece:
    """One cut of a parameter with its AdamW state. ``tensor`` is what AdamW updates: on the CPU the fp32 master;
    on the device the parameter itself or a view of it, or an fp32 master when the parameter is in lower precision.
    Of a DTensor parameter (FSDP2), all of this is of the local shard."""

    def __init__(self, cut, index: int):
        p, shard = cut.param, local_shard(cut.param)
        self.param, self.index, self.start, self.stop, self.on_cpu, self.whole = \
            p, index, cut.start, cut.stop, cut.on_cpu, cut.whole
        if not self.whole and not shard.is_contiguous():
            raise InvalidArgumentError(f"a parameter of shape {tuple(shard.shape)} to be cut between the CPU and the "
                                       "device is not contiguous; make it contiguous or offload whole layers")
        source = self.view(shard.detach())
        # host_grad: the pinned buffer a device's gradient is copied into; grad: what the CPU update reads
        self.host_grad = self.grad = None
        self.separate = self.on_cpu or p.dtype != torch.float32
        if self.on_cpu:
            # pinned when the parameter is on a GPU: the copies back to it are then asynchronous
            self.tensor = torch.empty(source.shape, dtype=torch.float32, device="cpu",
                                      pin_memory=source.is_cuda)
            self.tensor.copy_(source)
        elif p.dtype == torch.float32:
            self.tensor = source  # updated in place
        else:
            self.tensor = source.float()
        self.exp_avg = torch.zeros_like(self.tensor, memory_format=torch.contiguous_format)
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        self.step = torch.zeros((), dtype=torch.float32, device=self.tensor.device)
        self.norm = self.norm_host = self.saved = None

    def view(self, t: torch.Tensor) -> torch.Tensor:
        """This piece of ``t``, a tensor shaped like the parameter (its gradient, its data; a DTensor's local shard)."""
        t = local_shard(t)
        return t if self.whole else t.reshape(-1)[self.start:self.stop]

    def state(self) -> list[torch.Tensor]:
        return [self.tensor, self.exp_avg, self.exp_avg_sq, self.step]

    def copy_back(self) -> None:
        if self.separate:  # else AdamW updated the parameter in place
            self.view(self.param.detach()).copy_(self.tensor, non_blocking=True)


class Layer:
    """A layer's pieces, and what the current step knows of it."""

    def __init__(self, index: int, pieces: list[Piece]):
        self.index = index
        self.cpu = [pc for pc in pieces if pc.on_cpu]
        self.device = [pc for pc in pieces if not pc.on_cpu]
        self.cpu_params = {pc.index for pc in self.cpu}
        self.reset()

    def reset(self) -> None:
        self.arrived: set[int] = set()  # parameters whose offloaded gradient is on the host
        self.futures, self.status, self.event, self.log, self.group = [], None, None, None, None
        self.forward_start = self.first = self.ready = None  # when its forward began, its first and last gradient


class StepLog:
    """One step's trace events (seconds from ``t0``, its start) and the clipping speculation's running sum."""

    def __init__(self):
        self.t0, self.events, self.spec_sq = perf_counter(), [], 0.0
        self.device_logged = False  # the device's events are in (land_at="step" adds them before landing)

    def add(self, row: str, label: str, start: float) -> None:
        """An event from ``start`` (a ``perf_counter()``) to now."""
        self.events.append((row, label, start - self.t0, perf_counter() - self.t0))

    def trace(self) -> list[tuple[str, str, float, float]]:
        return sorted(self.events, key=lambda e: e[2])


def device_events(layers: list[Layer], t0: float) -> list[tuple[str, str, float, float]]:
    """Trace events of each layer's forward (from its forward pre-hook to the next layer's, the last one to its
    first gradient: so it holds the loss too) and backward (from the previous layer's last gradient, or its own
    first, to its last)."""
    events, previous = [], None
    started = [layer for layer in layers if layer.forward_start is not None]
    for layer, after in zip(started, started[1:] + [None]):
        end = after.forward_start if after is not None else layer.first
        if end is not None:
            events.append(("device", f"forward {layer.index}", layer.forward_start - t0, end - t0))
    for layer in reversed(layers):
        if layer.ready is not None:
            start = layer.first if previous is None else previous
            events.append(("device", f"backward {layer.index}", start - t0, layer.ready - t0))
            previous = layer.ready
    return events


def adamw_step(pieces: list[Piece], grads: list[torch.Tensor], group: dict) -> None:
    """``torch.optim.AdamW(fused=True).step()``'s update of ``pieces`` with ``grads`` under ``group``'s settings."""
    beta1, beta2 = group["betas"]
    adamw([pc.tensor for pc in pieces], grads, [pc.exp_avg for pc in pieces], [pc.exp_avg_sq for pc in pieces], [],
          [pc.step for pc in pieces], fused=True, amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
          weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)


def cpu_update(layer: Layer, kind: str, scale: torch.Tensor | None, clip_norm: float | None) -> None:
    """A layer's CPU update, on the worker. ``kind``: ``"final"`` (the gradients are final), ``"speculative"``
    (save, then update, unless the step is already known to clip), ``"resolve"`` (after a speculative update: undo
    and redo it with ``scale``, or run it if it was not)."""
    start = perf_counter()
    if layer.event is not None:
        layer.event.synchronize()
    pieces = [pc for pc in layer.cpu if pc.index in layer.arrived]
    label = "update"
    if kind == "speculative":
        layer.log.spec_sq += sum(float(pc.norm_host) ** 2 for pc in pieces)
        if layer.log.spec_sq > clip_norm ** 2:
            layer.status = "deferred"
            return
        for pc in pieces:
            pc.saved = pc.saved or [torch.empty_like(t) for t in pc.state()]
        torch._foreach_copy_([t for pc in pieces for t in pc.saved], [t for pc in pieces for t in pc.state()])
    elif kind == "resolve" and layer.status == "updated":
        if scale is None:
            return
        torch._foreach_copy_([t for pc in pieces for t in pc.state()], [t for pc in pieces for t in pc.saved])
        label = "redo"
    grads = [g if g.dtype == torch.float32 else g.float() for g in (pc.grad for pc in pieces)]
    if scale is not None and grads:  # in fp32 (an fp32 gradient in place)
        torch._foreach_mul_(grads, scale)
    adamw_step(pieces, grads, layer.group)
    for pc in pieces:
        # Host memory: write the weights now. Backward is done with them (their gradients are final, and a
        # weight's last use in backward is what completes its gradient), so this overlaps backward too.
        if not pc.param.is_cuda:
            pc.copy_back()
    layer.status = "redone" if label == "redo" else "updated"
    layer.log.add("cpu", f"{label} {layer.index}", start)


def settle_gradients(params) -> None:
    """Give each DTensor parameter's gradient the parameter's placements. They may differ: a row-wise split embedding
    (``Shard(0)``) gets its gradient whole (``Replicate()``), and a weight that sees split activations may get it
    as per-rank partial sums; DTensor's own ops redistribute on use, but the offload works on local pieces, which
    must be this rank's part of the parameter (a slice for a replicated gradient; an all-reduce for partial sums,
    in the same hook order on every rank)."""
    for param in params:
        grad = param.grad
        if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(param.placements):
            param.grad = grad.redistribute(param.device_mesh, param.placements)


def shard_groups(param: torch.Tensor) -> tuple:
    """The process groups over which a parameter is sharded (its DTensor mesh dimensions not replicated: ``Shard``,
    and FSDP2's ``_StridedShard`` over TP's, which torch does not count as ``is_shard()``): a sum of squares of its
    local shards over them is the sum over the whole parameter."""
    if not isinstance(param, DTensor):
        return ()
    return tuple(param.device_mesh.get_group(d) for d, placement in enumerate(param.placements)
                 if not placement.is_replicate())


def global_norm(norms: list[list[torch.Tensor]], groups: list[tuple], devices: list[torch.device]) -> torch.Tensor:
    """The norm of every gradient, as ``clip_grad_norm_`` computes it over the whole model, from each parameter's
    local piece norms: their squares summed per set of process groups that shard the parameter (``groups``, from
    :func:`shard_groups`), each sum all-reduced over those groups, on every rank in the same order (one per kind
    of parameter, the parameters being the same everywhere)."""
    sums: dict[tuple, torch.Tensor] = {}
    for piece_norms, key, device in zip(norms, groups, devices):
        square = torch.stack(piece_norms).float().square().sum() if piece_norms else torch.zeros((), device=device)
        sums[key] = sums.get(key, 0) + square.to(device)
    total = torch.zeros((), device="cpu")  # the norm is read on the host
    for key, square in sums.items():
        for group in key:  # a sum over each sharding dimension in turn is the sum over all of them
            dist.all_reduce(square, group=group)
        total = total + square.cpu()
    return total.sqrt()


HYPER = ("lr", "betas", "eps", "weight_decay", "initial_lr")


def _whole(pieces, name: str, param: torch.Tensor) -> torch.Tensor:
    """One parameter's state tensor ``name``, its pieces joined, shaped like the parameter (its local shard), on
    the CPU."""
    flat = [getattr(pc, name).detach().reshape(-1).to("cpu", torch.float32) for pc in pieces]
    if not flat:
        return torch.zeros(local_shard(param).shape, device="cpu")
    return torch.cat(flat).view(local_shard(param).shape).clone()


def save_state(opt) -> dict:
    if any(f for layer in opt._layers for f in layer.futures):
        raise InvalidArgumentError("state_dict() during a step: call it between step() and the next backward")
    state = {}
    for i, (p, pieces) in enumerate(zip(opt._params, opt._pieces_of)):
        state[i] = {"step": pieces[0].step.detach().to("cpu").clone() if pieces else torch.zeros((), device="cpu"),
                    "exp_avg": _whole(pieces, "exp_avg", p), "exp_avg_sq": _whole(pieces, "exp_avg_sq", p),
                    "master": _whole(pieces, "tensor", p)}
    groups, start = [], 0
    for g in opt.param_groups:
        groups.append({k: v for k, v in g.items() if k != "params"} | {"params": list(range(start, start +
                                                                                          len(g["params"])))})
        start += len(g["params"])
    return {"state": state, "param_groups": groups}


@torch.no_grad()
def load_state(opt, state_dict: dict) -> None:
    groups = state_dict["param_groups"]
    saved = [i for g in groups for i in g["params"]]
    if len(saved) != len(opt._params):
        raise InvalidArgumentError(f"the state dict holds {len(saved)} parameters, this optimizer {len(opt._params)}")
    for i, p, pieces in zip(saved, opt._params, opt._pieces_of):
        p = local_shard(p)  # of a DTensor (FSDP2), a state dict holds this rank's shards
        entry = state_dict["state"].get(i, {})
        for name in ("exp_avg", "exp_avg_sq", "master"):
            if name in entry and tuple(entry[name].shape) != tuple(p.shape):
                raise InvalidArgumentError(f"parameter {i}: {name} of shape {tuple(entry[name].shape)} in the state "
                                           f"dict, {tuple(p.shape)} here")
        master = entry.get("master", p.detach()).reshape(-1)
        zeros = torch.zeros(p.numel(), device="cpu")
        for pc in pieces:
            pc.step.copy_(entry.get("step", torch.zeros((), device="cpu")))
            pc.exp_avg.copy_(pc.view(entry.get("exp_avg", zeros).reshape(p.shape)))
            pc.exp_avg_sq.copy_(pc.view(entry.get("exp_avg_sq", zeros).reshape(p.shape)))
            pc.tensor.copy_(pc.view(master.view(p.shape)))
            pc.copy_back()
    if len(groups) == len(opt.param_groups):  # one group per layer: take its hyper-parameters
        for mine, theirs in zip(opt.param_groups, groups):
            mine.update({k: theirs[k] for k in HYPER if k in theirs})
    else:  # e.g. a plain AdamW's single group
        for mine in opt.param_groups:
            mine.update({k: groups[0][k] for k in HYPER if k in groups[0]})
