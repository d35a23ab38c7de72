"""Hot switching (HotSPa): each length bucket of a step under its own strategy, one optimizer update per step.

    >>> switching = HotSwitching(lambda: GPT(config), {512: "dp_replicate=2", 2048: "dp_shard=2", 8192: "tp=2"},
    ...                          lr=3e-4)                  # in every worker, after the process group exists
    >>> for buckets in length_batches(docs, tokens_per_step=16384, bounds=[512, 2048, 8192], steps=10):
    ...     record = switching.step(buckets)              # SwitchStepRecord: loss, seconds, switches
    >>> switching.home                                    # the longest bucket's model: master weights, optimizer

The model is built and parallelized once per layout (:class:`~nbtrain.run.switching.layouts.Layout`: a uniform plan
of DDP, FSDP2, tensor parallel or their mixes, or a pipeline of them, ``"pp=2 tp=2"``, as HotSPa's (dp, tp, pp)).
The *home* strategy is the longest bucket's: its model holds the weights the optimizer updates and the optimizer
state, all step long (a pipelined home: each stage its layers'). A step runs the other strategies first, shortest
buckets first, each as HotSPa does:

1. switch the weights home → strategy (:class:`~nbtrain.run.switching.reshard.Resharding`, planned once per pair:
   each stage's slices, a rank holding none of another stage's layers) into the layout's storage, given back for
   the occasion;
2. forward and backward of each of its buckets' rows (each data-parallel rank its rows, in micro-batches of
   ``micro_rows[bound]`` rows whose gradients accumulate, padded with empty rows to whole micro-batches; the
   gradient sync of that layout once, after its last; a pipelined layout runs each bucket through the static
   pipeline's runner, GPipe or 1F1B over its own micro-batches, and sums its tied embedding's two copies once,
   after its last bucket);
3. switch the gradients strategy → home, *added* to the home model's ``.grad``; then free the layout's weights and
   gradients (HotSPa does too: only the home layout and the one running are resident, as the planner prices it);

then the home strategy's buckets (its gradient sync adds their gradients to what is there: DDP and FSDP2 reduce
``.grad`` plus the new local gradient, and what the switches put there is already the same on every replica), one
clipping (over the stages, for a pipelined home) and one optimizer step in the home layout. An offloaded home
(``offload``, or its strategy's ``offload=``) hands the gradients to its CPU update during its last bucket's last
backward, the switched gradients already in ``.grad`` (CoTrain's overlap, as for static plans); when no bucket runs
at home, ``step()`` hands them over. The loss is the token-level mean over the whole step: each rank
backpropagates ``Σ cross-entropy of its rows × dp / tokens of the step`` (DDP and FSDP2 divide by dp), so the
gradients are those of one process over all the buckets. Strategies that differ only in checkpointing share one
layout (one model, no switch): checkpointing is turned on and off per bucket (``set_checkpointing``). A layout's
weights are freed by giving their storage back: its parameters stay the same objects, so its wrappers and the
switch plans hold. DDP's own gradient buckets stay allocated (a DDP layout keeps one gradient-sized buffer). Each
record carries the tensor memory this rank held at each bucket's peak (:mod:`nbtrain.tensor_memory`: every
layout's resident weights and gradients, the home optimizer state, the activations saved for backward), the
quantity the planner predicts.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from nbtrain.errors import InvalidArgumentError, NonFiniteLossError
from nbtrain.gradients import clip_grad_norm, group_by_kind
from nbtrain.tensor_memory import count_where_needed, counting, state_bytes
from nbtrain.planner.switching.bucket_strategy import layout_key, parse_bucket_strategy, with_layers
from nbtrain.run.parallel.mesh import local_shard
from nbtrain.run.parallel.parallelize import set_checkpointing
from nbtrain.run.placement import reset_peak_memory, synchronize
from nbtrain.run.switching.layouts import Layout
from nbtrain.run.switching.reshard import Resharding
from nbtrain.run.trainer import check_on_nonfinite


@dataclass(frozen=True)
class MeasuredSwitch:
    """One re-layout of a step, as this rank measured it."""

    what: str
    """``"weights"`` (home → strategy) or ``"gradients"`` (strategy → home)."""
    strategy: str
    seconds: float
    bytes_received: int


@dataclass(frozen=True)
class SwitchStepRecord:
    step: int
    loss: float
    """Token-level mean cross-entropy over every bucket of the step."""
    tokens: int
    seconds: float
    bucket_seconds: dict[int, float]
    """Forward and backward seconds per bucket bound (on this rank)."""
    switches: list[MeasuredSwitch] = field(default_factory=list)
    bucket_tokens: dict[int, int] = field(default_factory=dict)
    """Tokens with a target per bucket bound (the whole step's, every rank's)."""
    bucket_tensor_bytes: dict[int, int] = field(default_factory=dict)
    """Tensor bytes this rank held at each bucket's peak (module docstring)."""
    grad_norm: float | None = None
    """The gradient norm before clipping, when clipping is on."""
    skipped: bool = False
    """The loss was not finite and the update was skipped (``on_nonfinite="skip"``)."""

    @property
    def switch_seconds(self) -> float:
        return sum(s.seconds for s in self.switches)

    @property
    def tensor_bytes(self) -> int | None:
        return max(self.bucket_tensor_bytes.values()) if self.bucket_tensor_bytes else None


class HotSwitching:
    """Train with one strategy per length bucket (module docstring). ``strategies``: bound → strategy (a
    ``Strategy``, a pipelined :class:`~nbtrain.planner.switching.bucket_strategy.BucketStrategy`, or their text,
    ``"dp_shard=2"``, ``"pp=2 tp=2"``); the largest bound's is the home. ``micro_rows``: bound → the rows of one
    micro-batch on each rank (default: all of them at once, in a pipeline about one micro-batch per stage;
    :meth:`BucketPlan.micro_rows`). ``build()`` makes the model on this process (called once per layout, each under
    ``torch.manual_seed(seed)``: the same initial weights). ``offload``: the home optimizer's CPU update offload
    (:class:`~nbtrain.run.offload.optimizer.OffloadedAdamW`, a fraction for every layer or one per layer; default
    the home strategy's ``offload``); its updates land before the next step's first switch. ``lr_schedule(step)``
    multiplies ``lr``; a step whose loss is not finite stops the run (``on_nonfinite="stop"``,
    :class:`~nbtrain.errors.NonFiniteLossError`) or is skipped (``"skip"``, not with offload) before its update.
    ``values``: when ``build()`` makes a model on the meta device, where each layout's tensors get their values
    once allocated (:mod:`nbtrain.run.state.materialize`)."""

    def __init__(self, build: Callable[[], nn.Module], strategies: Mapping[int, object], *, lr: float = 1e-3,
                 weight_decay: float = 0.0, clip_norm: float | None = None, seed: int = 0, offload=None,
                 micro_rows: Mapping[int, int] | None = None, betas=(0.9, 0.999), eps: float = 1e-8,
                 lr_schedule: Callable[[int], float] | None = None, on_nonfinite: str = "stop", values=None):
        if not strategies:
            raise InvalidArgumentError("strategies is empty: give at least one bucket bound and its strategy")
        self.bounds = sorted(strategies)
        world = dist.get_world_size()
        by_bound = {b: parse_bucket_strategy(strategies[b], world) for b in self.bounds}
        self.micro_rows = {b: (micro_rows or {}).get(b) for b in self.bounds}
        if any(r is not None and (not isinstance(r, int) or r < 1) for r in self.micro_rows.values()):
            raise InvalidArgumentError(f"micro_rows must be a positive number of rows per bound, got {micro_rows}")
        # strategies that differ only in checkpointing (or in the home's offload) share one layout (one model, no
        # switch between them); it is built with checkpointing where any of them has it, turned on and off per bucket
        layout_of = {b: layout_key(s) for b, s in by_bound.items()}
        home = layout_of[self.bounds[-1]]
        order = list(dict.fromkeys(layout_of[b] for b in self.bounds if layout_of[b] != home)) + [home]
        checkpointed = {key: next((s.ac for b, s in by_bound.items() if layout_of[b] == key and s.ac), False)
                        for key in order}
        # the same order on every rank: building a layout is collective
        self.layouts = {key: Layout(build, with_layers(key, ac=checkpointed[key]), seed, values) for key in order}
        self.strategy_of, self.layout_of = by_bound, layout_of
        self.home = self.layouts[home]
        self.device = self.home.meshes.device
        """Where this rank computes (every layout's shards, each bucket's rows, the switches' buffers)."""
        self.clip_norm, self.steps_done = clip_norm, 0
        self.on_nonfinite = check_on_nonfinite(on_nonfinite)
        forward = getattr(self.home.model, "forward", None)
        self.takes_doc_ids = forward is not None and "doc_ids" in inspect.signature(forward).parameters
        """Whether the model keeps attention inside each packed document (``forward(ids, doc_ids=...)``, as
        nbtrain's GPT does); other models attend across the documents of a row."""
        offload = by_bound[self.bounds[-1]].offload or None if offload is None else offload
        self.offloaded = offload is not None
        if self.offloaded:
            from nbtrain.run.offload.optimizer import OffloadedAdamW

            if on_nonfinite == "skip":
                raise InvalidArgumentError("on_nonfinite='skip' cannot undo the CPU updates an offloaded home starts "
                                           "during backward; use on_nonfinite='stop' with offload")
            stage = self.home.plan.stage_ranges()[self.home.meshes.stage]
            self.optimizer = OffloadedAdamW.from_model(self.home.wrapped, offload, lr=lr, weight_decay=weight_decay,
                                                       clip_norm=clip_norm, betas=betas, eps=eps, layers=stage)
            if self.home.pipeline is not None:  # the norm over the stages, the tied copies handed over at step()
                self.home.pipeline.hand_over_to(self.optimizer, self.home.pipeline_group)
        else:
            groups = [{"params": ps} for ps in group_by_kind(self.home.trained)]
            self.optimizer = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                               fused=True)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_schedule) \
            if lr_schedule is not None else None
        self._to = {s: Resharding(self.home.held, layout.held) for s, layout in self.layouts.items()
                    if layout is not self.home}
        self._back = {s: Resharding(layout.held, self.home.gradient_targets) for s, layout in self.layouts.items()
                      if layout is not self.home}
        for layout in self.layouts.values():
            if layout is not self.home:
                layout.free()  # resident only while its buckets run

    @property
    def schedule_epoch(self) -> int:
        """Steps of the learning-rate schedule taken (skipped steps take none)."""
        return self.scheduler.last_epoch if self.scheduler is not None else 0

    def restore_progress(self, steps_done: int, schedule_epoch: int = 0) -> None:
        """Go on from a checkpoint: the steps done and the schedule's position."""
        self.steps_done = steps_done
        if self.scheduler is not None:
            for _ in range(schedule_epoch):
                self.scheduler.step()

    def step(self, buckets) -> SwitchStepRecord:
        """One step over a global batch given as packed rows per bucket (objects with ``bound``, ``ids``,
        ``targets`` and, optionally, ``doc_ids``; every rank passes the same)."""
        started = time.perf_counter()
        buckets = sorted(buckets, key=lambda b: b.bound)
        unknown = [b.bound for b in buckets if b.bound not in self.strategy_of]
        if unknown:
            raise InvalidArgumentError(f"buckets of bound {unknown} have no strategy; strategies were given for "
                                       f"{self.bounds}")
        counted = {b.bound: int((b.targets != -100).sum()) for b in buckets}
        tokens = sum(counted.values())
        if tokens == 0:
            raise InvalidArgumentError("the step has no target token (every target is -100)")
        loss = torch.zeros((), dtype=torch.float64, device=self.device)
        seconds, switches, memory = {}, [], {}
        if self.offloaded:
            self.optimizer.synchronize()  # the last step's CPU updates, before the weights leave home
        for strategy, layout in self.layouts.items():
            mine = [b for b in buckets if self.layout_of[b.bound] == strategy]
            away = layout is not self.home
            if not mine:
                continue
            if away:
                layout.restore()
                self._to[strategy].run(self.home.shards(), layout.shards())
                switches.append(MeasuredSwitch("weights", str(strategy), self._to[strategy].seconds,
                                               self._to[strategy].bytes_received))
            offloaded = self.optimizer if self.offloaded and not away else None
            for i, bucket in enumerate(mine):
                t0 = time.perf_counter()
                set_checkpointing(layout.model, self.strategy_of[bucket.bound].ac)
                reset_peak_memory(self.device)
                saved = count_where_needed(self.device, exclude=layout.trained)
                with counting(saved):
                    loss += layout.run(bucket, tokens=tokens, micro_rows=self.micro_rows[bucket.bound],
                                       last=i == len(mine) - 1, keywords=self.takes_doc_ids, offloaded=offloaded)
                synchronize(self.device)
                seconds[bucket.bound] = time.perf_counter() - t0
                # a GPU's allocator knows the peak; on the CPU the tensors are counted (tensor_memory.py)
                memory[bucket.bound] = torch.cuda.max_memory_allocated(self.device) if saved is None \
                    else self._resident_bytes() + saved.peak
            if away:
                layout.finish()
                self._add_gradients(strategy, layout)
                switches.append(MeasuredSwitch("gradients", str(strategy), self._back[strategy].seconds,
                                               self._back[strategy].bytes_received))
                layout.free()
        self.home.finish()  # a pipelined home's tied copies: its buckets' and the switched gradients, summed once
        dist.all_reduce(loss)
        value = float(loss) / tokens
        self.steps_done += 1
        record = SwitchStepRecord(self.steps_done, value, tokens, 0.0, seconds, switches, counted, memory)
        if not math.isfinite(value):  # the same on every rank: all stop (or skip) before the update
            if self.on_nonfinite == "stop":
                raise NonFiniteLossError(self.steps_done, value)
            self.optimizer.zero_grad(set_to_none=True)
            return dataclasses.replace(record, seconds=time.perf_counter() - started, skipped=True)
        norm = None
        if self.clip_norm is not None and not self.offloaded:  # an offloaded optimizer clips itself, exactly
            shared = self.home.pipeline.counted_elsewhere() if self.home.pipeline is not None else ()
            norm = clip_grad_norm(self.home.trained, self.clip_norm, self.home.pipeline_group, shared)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        synchronize(self.device)
        return dataclasses.replace(record, seconds=time.perf_counter() - started, grad_norm=norm)

    def _resident_bytes(self) -> int:
        """This rank's weights and gradients of every resident layout, and the home optimizer's state."""
        return sum(state_bytes(layout.model, self.optimizer if layout is self.home else None)
                   for layout in self.layouts.values() if layout.resident)

    def _add_gradients(self, strategy, layout: Layout) -> None:
        """Add the layout's (synced) gradients into the home model's ``.grad``, then drop them."""
        for p in self.home.trained:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = []
        for p in layout.held:
            if p is None:  # another stage's parameter
                grads.append(None)
                continue
            g = torch.zeros_like(p) if p.grad is None else p.grad  # a parameter no bucket used moves zeros
            if isinstance(g, DTensor) and g.placements != p.placements:
                # tensor parallel leaves some gradients Partial (each rank a share of the sum): sum them first
                g = g.redistribute(p.device_mesh, p.placements)
            grads.append(local_shard(g))
        self._back[strategy].run(grads, self.home.shards([None if p is None else p.grad
                                                          for p in self.home.gradient_targets]), add=True)
