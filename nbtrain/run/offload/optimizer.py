"""AdamW whose update runs partly on the CPU: overlapped with backward (CoTrain) or after it (ZeRO-Offload).

    >>> opt = OffloadedAdamW.from_model(model, offload=plan, lr=3e-4, clip_norm=1.0)  # or offload=1.0, [0, 1, 1, 1]
    >>> for ids, targets in batches:
    ...     lm_loss(model(ids), targets).backward()   # each layer's CPU update starts once its gradients are in
    ...     opt.step()                                # the device's share; the CPU's lands as forward reaches it
    ...     opt.zero_grad()
    >>> timeline_plot(opt.last_trace)                 # device row: backward of each layer; cpu row: the updates
    >>> opt.close()                                   # stops its CPU worker thread (fit does this after the run)

The design (what lives where, the two schedules, landing before the next forward, threads, exact clipping,
the learning rate) is the package's: :mod:`nbtrain.run.offload`.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from time import perf_counter

import torch
import torch.distributed as dist
from torch import nn

from nbtrain.errors import InvalidArgumentError
from nbtrain.run.parallel.mesh import local_shard
from nbtrain.run.offload.ddp import attach_ddp
from nbtrain.run.offload.landing import SECOND_BACKWARD, Landing
from nbtrain.run.offload.split import cut_layer
from nbtrain.run.offload.state import (Layer, Piece, StepLog, adamw_step, cpu_update, device_events, global_norm,
                                       load_state, save_state, settle_gradients, shard_groups)

SCHEDULES = ("overlap", "after_backward")


class OffloadedAdamW(Landing, torch.optim.Optimizer):
    """AdamW with ``offload[i]`` of layer i's update on the CPU (module docstring: schedules, clipping, threads).

    ``layers``: each layer's parameters, layers in forward order (a parameter listed twice, tied, belongs to its
    first layer). ``offload``: one fraction for every layer, or one per layer (a plan's ``Strategy.offload``).
    ``land_before``: each layer's modules, whose forward waits for the layer's CPU update (None: ``step()`` waits).
    ``threads``: the worker's intra-op threads. Micro-batches: all but a step's last under :meth:`no_sync`.
    ``grad_dtype``: the dtype offloaded gradients cross to the CPU in (``torch.bfloat16`` when computing in bf16:
    half the bytes; the update and its master stay fp32), None: the gradient's own.
    """

    def __init__(self, layers, offload=1.0, *, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, clip_norm: float | None = None, schedule: str = "overlap",
                 threads: int = 1, land_before: list[list[nn.Module]] | None = None,
                 grad_dtype: torch.dtype | None = None):
        layers = [list(params) for params in layers]
        fractions = [float(offload)] * len(layers) if isinstance(offload, (int, float)) else list(offload)
        if schedule not in SCHEDULES:
            raise InvalidArgumentError(f"schedule must be one of {', '.join(SCHEDULES)}; got {schedule!r}")
        if len(fractions) != len(layers):
            raise InvalidArgumentError(f"{len(fractions)} offload fractions for {len(layers)} layers")
        if any(not 0.0 <= f <= 1.0 for f in fractions):
            raise InvalidArgumentError(f"offload fractions are between 0 and 1; got {fractions}")
        if clip_norm is not None and not clip_norm > 0:
            raise InvalidArgumentError(f"clip_norm must be positive or None; got {clip_norm}")
        seen, groups = set(), []
        for params, f in zip(layers, fractions):
            mine = [p for p in params if p.requires_grad and id(p) not in seen]
            seen.update(id(p) for p in mine)
            groups.append({"params": mine, "offload": f})
        if not seen:
            raise InvalidArgumentError("no parameter to optimize (none requires grad)")
        super().__init__(groups, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.clip_norm, self.schedule, self.threads, self.grad_dtype = clip_norm, schedule, threads, grad_dtype
        self._params = [p for g in self.param_groups for p in g["params"]]
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self._layer_of, self._layers, self._pieces_of = [], [], [[] for _ in self._params]
        for li, g in enumerate(self.param_groups):
            pieces = [Piece(cut, self._index[id(cut.param)]) for cut in cut_layer(g["params"], g["offload"])]
            for pc in pieces:
                self._pieces_of[pc.index].append(pc)
            self._layer_of += [li] * len(g["params"])
            self._layers.append(Layer(li, pieces))
        self._norm_groups = [shard_groups(p) for p in self._params]
        on_gpu = next((local_shard(p).device for p in self._params if local_shard(p).is_cuda), None)
        self._copy_stream = torch.cuda.Stream(on_gpu) if on_gpu is not None else None
        """The stream a GPU's gradients leave on for the host, beside backward's kernels (CoTrain's transfer
        overlapped with compute); None when the parameters are in host memory."""
        self._cpu_pieces_of = {i: [pc for pc in pcs if pc.on_cpu] for i, pcs in enumerate(self._pieces_of)
                               if any(pc.on_cpu for pc in pcs)}
        self._lock, self._executor, self._closed, self._sync, self._ddp = threading.Lock(), None, False, True, False
        self._handles = [p.register_post_accumulate_grad_hook(lambda p, i=i: self._param_hook(i, p))
                         for i, p in enumerate(self._params)]
        self._log, self._landing, self._pending = StepLog(), None, []
        if land_before is not None:  # each layer's modules: its CPU update lands when the next forward reaches it
            if len(land_before) != len(layers):
                raise InvalidArgumentError(f"land_before has {len(land_before)} entries for {len(layers)} layers")
            self._handles += [module.register_forward_pre_hook(lambda *_, layer=layer: self._pre_forward(layer),
                                                               prepend=True)  # before FSDP2 gathers the weights
                              for layer, modules in zip(self._layers, land_before) for module in modules]
        self.land_at = "step" if land_before is None else "forward"
        self.last_trace: list[tuple[str, str, float, float]] = []
        """The last landed step's ``(row, label, start_s, end_s)`` events, seconds from its start (``zero_grad()`` or
        the end of the previous ``step()``): ``timeline_plot(opt.last_trace)``."""
        self.last_grad_norm: float | None = None
        """The last step's total gradient norm (before clipping), when clipping is on."""
        self.last_overlapped, self._queued = 0, []
        """How many layers' CPU updates the last step queued during backward (the rest waited for ``step()``)."""
        self.clipped_steps = self.rollbacks = 0
        self._pipeline_group, self._counted_elsewhere, self._at_step = None, set(), set()

    def join_pipeline(self, group, *, counted_elsewhere=(), at_step=()) -> None:
        """This optimizer updates one pipeline stage: the clipping norm sums its squares over ``group`` (the
        stages), leaving out ``counted_elsewhere`` (a tied embedding's copy another stage counts); the gradients of
        ``at_step`` (that copy and its twin, summed between the stages after backward) are handed over in
        ``step()``, not as backward produces them."""
        self._pipeline_group = group
        self._counted_elsewhere = {self._index[id(p)] for p in counted_elsewhere if id(p) in self._index}
        self._at_step = {self._index[id(p)] for p in at_step if id(p) in self._index}

    @classmethod
    def from_model(cls, model: nn.Module, offload=1.0, *, land_at: str = "forward", layers: tuple[int, int] | None = None,
                   **kwargs) -> OffloadedAdamW:
        """For an nbtrain GPT or a Hugging Face GPT-2 / Llama, bare, under FSDP2, or wrapped in
        DistributedDataParallel (then its all-reduce hands over the gradients:
        :func:`~nbtrain.run.offload.ddp.attach_ddp`). ``offload`` may be a ``Plan``: its layers' ``offload``
        fractions. ``land_at="forward"``: each layer's CPU update may run on into the next forward, which waits for
        it at that layer (and ``model.state_dict()`` waits for all); ``"step"``: ``step()`` waits for every update.
        ``layers=(start, end)``: only those layers (a pipeline stage's), ``offload`` still one entry per layer."""
        from torch.nn.parallel import DistributedDataParallel

        from nbtrain.models.description import layer_slots, slot_module

        inner = model.module if isinstance(model, DistributedDataParallel) else model
        if hasattr(offload, "layers"):
            offload = [s.offload for s in offload.layers]
        if land_at not in ("forward", "step"):
            raise InvalidArgumentError(f"land_at must be 'forward' or 'step'; got {land_at!r}")
        modules = [[slot_module(parent, attr) for parent, attr in slots] for slots in layer_slots(inner)]
        start, end = layers if layers is not None else (0, len(modules))
        if not isinstance(offload, (int, float)):
            offload = list(offload)[start:end]
        modules = modules[start:end]
        params = [[p for module in layer for p in module.parameters()] for layer in modules]
        opt = cls(params, offload, land_before=modules if land_at == "forward" else None, **kwargs)
        opt._handles.append(inner.register_forward_pre_hook(opt._refuse_forward_before_step, prepend=True))
        if land_at == "forward":  # a checkpoint taken between steps holds the new weights
            opt._handles.append(inner.register_state_dict_pre_hook(lambda *_: opt.synchronize()))
        if isinstance(model, DistributedDataParallel):
            attach_ddp(opt, model)
        return opt

    @property
    def cpu_fractions(self) -> list[float]:
        """Per layer, the fraction of its parameters updated on the CPU (``offload`` rounded to whole elements)."""
        return [sum(pc.tensor.numel() for pc in layer.cpu) / max(1, sum(p.numel() for p in g["params"]))
                for layer, g in zip(self._layers, self.param_groups)]

    def __repr__(self) -> str:
        total = sum(p.numel() for p in self._params)
        cpu = sum(pc.tensor.numel() for layer in self._layers for pc in layer.cpu)
        clip = f", clip_norm={self.clip_norm}" if self.clip_norm else ""
        return (f"OffloadedAdamW({self.schedule}, {len(self._layers)} layers, {cpu:,} of {total:,} parameters "
                f"updated on the CPU ({cpu / total:.0%}){clip})")

    # -- gradients arriving during backward -----------------------------------------------------------------------

    def _param_hook(self, index: int, param: torch.Tensor) -> None:
        if not self._sync or index in self._at_step:
            return
        now, layer = perf_counter(), self._layers[self._layer_of[index]]
        settle_gradients([param])
        with self._lock:  # the times say when backward produced the gradient, with or without DDP
            layer.first = now if layer.first is None else layer.first
            layer.ready = now
        if not self._ddp and index in self._cpu_pieces_of:
            self._grad_arrived(index, param.grad)

    def _grad_arrived(self, index: int, grad: torch.Tensor, submit: bool = True) -> None:
        """``grad`` is the parameter's final gradient of this step (averaged over data-parallel ranks): copy it to
        the host; once all of the layer's offloaded gradients are in, queue its update (``"overlap"``)."""
        layer = self._layers[self._layer_of[index]]
        if layer in self._pending:  # no forward reached it (hooks on other modules)
            self._land(layer)
        if grad.is_cuda:  # the copies start once backward's kernels so far (which made this gradient) are done
            self._copy_stream.wait_stream(torch.cuda.current_stream(grad.device))
        crossing = self.grad_dtype or grad.dtype
        for pc in self._cpu_pieces_of[index]:
            g = pc.view(grad)
            if g.is_cuda:  # the transfer, into pinned memory, on the copy stream: the worker waits for layer.event
                if pc.host_grad is None:
                    pc.host_grad = torch.empty(g.shape, dtype=crossing, device="cpu", pin_memory=True)
                with torch.cuda.stream(self._copy_stream):
                    sent = g.to(crossing)  # rounded on the device when it crosses in the compute dtype
                    pc.grad = pc.host_grad.copy_(sent, non_blocking=True)
                    if self.clip_norm is not None:  # of the gradient as computed, as the device's clipping sees it
                        pc.norm = torch.linalg.vector_norm(g)
                        pc.norm_host = pc.norm.to("cpu", non_blocking=True)
                # the allocator must not give the gradient's memory to backward's stream before the copy has read it
                g.record_stream(self._copy_stream)
                sent.record_stream(self._copy_stream)
                continue
            # already in host memory, and final until the next backward, which step() keeps it from; rounded to
            # the crossing dtype as a GPU's transfer rounds it, so both train alike
            pc.grad = g if crossing == g.dtype else g.to(crossing)
            if self.clip_norm is not None:
                pc.norm = pc.norm_host = torch.linalg.vector_norm(g)
        with self._lock:
            if index in layer.arrived:
                raise InvalidArgumentError(
                    "a second backward before step(): the first one's gradients were already handed to the update. "
                    + SECOND_BACKWARD)
            layer.arrived.add(index)
            if layer.arrived == layer.cpu_params and not layer.futures:
                if grad.is_cuda:  # the worker waits for the copies (and norms) to land on the host
                    layer.event = torch.cuda.Event()
                    layer.event.record(self._copy_stream)
                if submit and self.schedule == "overlap":
                    self._submit(layer, "final" if self.clip_norm is None else "speculative")
                    self._queued.append(layer)

    @contextmanager
    def no_sync(self):
        """Micro-batches before a step's last: gradients accumulate in ``.grad``, nothing is copied or queued (with
        DDP, the model's own ``no_sync()`` already keeps its all-reduce, and so the hand-over, for the last). It may be
        entered inside itself (hot switching runs a pipelined home's earlier buckets under it, and the pipeline's
        backward enters it again per micro-batch): leaving the inner one keeps the outer one's."""
        before, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = before

    # -- the worker thread ---------------------------------------------------------------------------------------

    def _submit(self, layer: Layer, kind: str, scale: torch.Tensor | None = None) -> None:
        layer.log = self._log
        if layer.group is None:  # this step's lr: a scheduler may change it before the update has run
            layer.group = {k: v for k, v in self.param_groups[layer.index].items() if k != "params"}
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="nbtrain-offload",
                                                initializer=torch.set_num_threads, initargs=(self.threads,))
        layer.futures.append(self._executor.submit(self._cpu_update, layer, kind, scale))

    def _cpu_update(self, layer: Layer, kind: str, scale: torch.Tensor | None) -> None:
        cpu_update(layer, kind, scale, self.clip_norm)  # on the worker, in queue order

    # -- the step ------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        """Clip (when asked), update the device's share; wait for the CPU's and copy its weights into the model now
        (``land_at="step"``) or as the next forward reaches each layer (``"forward"``)."""
        if self._closed:
            raise InvalidArgumentError("this OffloadedAdamW is closed; make a new one to go on training")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        failed = True
        try:
            self._step()
            failed = False
        finally:
            self._end_step(failed)
        return loss

    def _step(self) -> None:
        self.synchronize()  # the last step's layers that no forward reached
        for layer in self._layers:  # gradients no hook handed over (hooks off, or no .grad hook ran)
            for i in sorted(layer.cpu_params - layer.arrived):
                if self._params[i].grad is not None:
                    self._grad_arrived(i, self._params[i].grad, submit=False)
        if self._copy_stream is not None:  # the offloaded pieces' norms were computed on the copy stream
            torch.cuda.current_stream(self._copy_stream.device).wait_stream(self._copy_stream)
        settle_gradients(self._params)  # those no hook settled (hooks off)
        device = [pc for layer in self._layers for pc in layer.device if pc.param.grad is not None]
        device_grads = [pc.view(pc.param.grad) for pc in device]
        scale = None
        if self.clip_norm is not None:
            for pc, g in zip(device, device_grads):
                pc.norm = torch.linalg.vector_norm(g)
            total = self._total_norm()
            self.last_grad_norm = float(total)
            coef = self.clip_norm / (total + 1e-6)  # torch.nn.utils.clip_grad_norm_'s coefficient
            if float(coef) < 1.0:
                scale = coef
                self.clipped_steps += 1
                # the worker speculated unless the first layer queued already showed the step clips (as it decides)
                first = self._queued[0].cpu if self._queued else []
                self.rollbacks += bool(first) and sum(float(pc.norm_host) ** 2 for pc in first) <= self.clip_norm ** 2
        cpu_scale = None if scale is None else scale.to("cpu")
        for layer in reversed(self._layers):  # backward order: the CPU's queue stays in the order grads arrived
            if not layer.arrived:
                continue
            if not layer.futures:
                self._submit(layer, "final", cpu_scale)
            elif self.clip_norm is not None:  # after a speculative update
                if scale is not None and layer.futures[-1].cancel():
                    layer.futures.pop()
                self._submit(layer, "resolve", cpu_scale)
        started = perf_counter()
        if scale is not None and device_grads:
            torch._foreach_mul_(device_grads, scale.to(device_grads[0].device))
        by_group: dict = {}
        for pc, g in zip(device, device_grads):
            group = self.param_groups[self._layer_of[pc.index]]
            key = (group["lr"], group["betas"], group["eps"], group["weight_decay"])
            by_group.setdefault(key, (group, [], []))
            by_group[key][1].append(pc)
            by_group[key][2].append(g if g.dtype == torch.float32 else g.float())
        for group, pieces, grads in by_group.values():
            adamw_step(pieces, grads, group)
            for pc in pieces:
                pc.copy_back()
        if device:
            self._log.add("device", "update", started)
        self._pending = [layer for layer in reversed(self._layers) if layer.futures]  # in the CPU's queue order
        if self.land_at == "step":
            self._log.events += device_events(self._layers, self._log.t0)  # before landing forgets the times
            self._log.device_logged = True
            self.synchronize()

    def _total_norm(self) -> torch.Tensor:
        """The norm of every gradient of the step, over every rank (:func:`global_norm`)."""
        norms = [[pc.norm for pc in pieces if (pc.on_cpu and pc.index in self._layers[self._layer_of[i]].arrived)
                  or (not pc.on_cpu and pc.param.grad is not None)] if i not in self._counted_elsewhere else []
                 for i, pieces in enumerate(self._pieces_of)]
        total = global_norm(norms, self._norm_groups, [local_shard(p).device for p in self._params])
        if self._pipeline_group is None:
            return total
        square = total.square().to(local_shard(self._params[0]).device)  # the stages' squares, over the pp group
        dist.all_reduce(square, group=self._pipeline_group)
        return square.cpu().sqrt()

    def _end_step(self, failed: bool) -> None:
        """Record the step's device events and start the next step's log; after a failure, first wait for whatever
        is still queued (nothing may run on into the next step) and land nothing."""
        if failed:
            for layer in self._layers:
                for future in layer.futures:
                    if not future.cancel():
                        future.exception()  # waits; an exception was raised by step() already
            self._pending = []
        log = self._log
        if not log.device_logged:
            log.events += device_events(self._layers, log.t0)
        for layer in self._layers:
            if layer not in self._pending:
                self._forget(layer)
        self.last_overlapped, self._queued = len(self._queued), []
        self._log = StepLog()
        if self._pending:
            self._landing = log
        else:
            self.last_trace = log.trace()

    def _forget(self, layer: Layer) -> None:
        layer.reset()
        for pc in layer.cpu:
            pc.grad = None  # no gradient kept alive past its update

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``Optimizer.zero_grad``; it also marks the start of the next step for the trace."""
        super().zero_grad(set_to_none)
        self._log.t0 = perf_counter()

    # -- life cycle and checkpoints -----------------------------------------------------------------------------

    def close(self) -> None:
        """Land the last updates (raising a worker's exception), remove the hooks, stop the worker; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.synchronize()
        finally:
            for handle in self._handles:
                handle.remove()
            if self._executor is not None:
                self._executor.shutdown(wait=True, cancel_futures=True)
                self._executor = None

    def __enter__(self) -> OffloadedAdamW:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def state_dict(self) -> dict:
        """torch AdamW's layout (``state[i]``: ``step``, ``exp_avg``, ``exp_avg_sq``, whole tensors on the CPU) plus
        ``master``, the fp32 weights; ``param_groups`` one per layer. Loads back whatever the offload split."""
        self.synchronize()
        return save_state(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """Also takes a plain ``torch.optim.AdamW`` state dict over the same parameters (masters then come from the
        model's weights). The model's parameters are set from the masters."""
        self.synchronize()
        load_state(self, state_dict)

