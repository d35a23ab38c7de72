"""The cost model: memory per device and time per step of a plan, from a model profile and a cluster.

    >>> from nbtrain.planner.cost import estimate
    >>> pred = estimate(Plan.parse("dp_shard=8 ac", num_devices=8, num_layers=34, global_batch=64, seq_len=2048),
    ...                 profile, cluster)
    >>> pred.step_time_s, pred.memory_bytes

Units: bytes, seconds, FLOP/s; everything per device. The mesh is laid out ``pp × dp_replicate × dp_shard × tp``
with tp innermost (Megatron-LM's order), so a group of ``k`` consecutive devices stays inside a node when
``k ≤ devices_per_node``. Terms, each with its source:

* **Model states** (Rajbhandari et al. 2020, ZeRO §3): compute-dtype parameters and gradients, fp32 master
  copy and two Adam moments (12 bytes/param; 8 when the compute dtype is fp32). TP divides all of them by ``tp``
  (Shoeybi et al. 2019); ZeRO-2 shards gradients and optimizer state over ``dp_shard``, ZeRO-3 parameters too.
  The offloaded fraction of the optimizer state lives in host memory.
* **Activations** (Korthikanti et al. 2022): the profiled saved bytes of a micro-batch; tensor parallelism without
  sequence parallelism divides them by ``tp`` except the hidden-sized tensors every rank holds whole (a block's
  norms' inputs and outputs: four hidden states), with it (``sp``) all of a block's (§4.2.2: ``34sbh/t +
  5as²b/t``); with checkpointing only the layer's input is kept, whole (under ``sp`` a block's ``1/tp`` of it);
  with ``ac=op`` (per-op selective, torchtitan's policy) also the outputs of attention and of every other projection.
  Micro-batches in flight: GPipe all ``m``; 1F1B stage ``i`` holds ``min(pp − i, m)`` (Narayanan et al. 2021).
* **Transient peak**: while one layer runs backward it holds its gathered parameters (ZeRO-3), its unsharded
  gradients (before the reduce-scatter), and with checkpointing its recomputed activations (``ac=op``: the part
  it did not keep). A stage's memory is
  the sum of its layers' resident bytes plus the largest transient of its layers plus the reserve.
* **The loss** (the head's): :mod:`nbtrain.planner.memory_terms`, checked by ``tests/test_memory_oracle.py``; under
  TP on the logits split over the vocabulary when the loss is nbtrain's own (:mod:`nbtrain.run.parallel.vocab_parallel`,
  Megatron-LM's parallel cross-entropy: its all-reduces priced as measured, ``tp_loss``), else on whole logits
  gathered on every rank.
* **Reserve**: what a GPU process holds before the model has a byte: the CUDA context with a step's kernels, and
  with more than one device NCCL's buffers (:func:`reserve_parts`); a constant per device (a 1 M-parameter model
  on 8 GPUs needs its ~1 GiB as much as a 7 B one), out of the budget (``--memory``, the device's whole memory)
  first. None on the CPU, where a worker is an ordinary process.
* **Compute**: on a GPU, each kernel class at its own rate, no layer faster than its kernels' launches
  (:mod:`nbtrain.planner.compute_time`); else (a CPU, an old profile) FLOPs / sustained FLOP/s; or, when the
  profile was measured on this machine's device and the cluster is this machine, each layer's measured time scaled
  by FLOPs to the micro-batch (Galvatron-BMW profiles compute so; ``CostOptions.measured_compute``);
  checkpointing adds one forward (Chen et al. 2016), or for ``ac=op`` the recomputation of the dropped projections and
  the other ops (:mod:`nbtrain.planner.selective_cost`). ``ac=1/k`` is per-layer ``ac``.
* **TP**: 2 all-reduces of the hidden state per block in forward and again in backward (Shoeybi et al. 2019; ``sp``:
  all-gathers and reduce-scatters of the same bytes, Korthikanti et al. 2022 §4.2.2); embeddings and head one each
  way (``sp``: an all-gather more); as measured where it was (:mod:`nbtrain.planner.link_costs`). Ring cost
  ``(k − 1)/k · bytes / bandwidth`` (Thakur et al. 2005) plus NCCL's small-message latency. Not overlapped.
* **ZeRO-3** gathers each layer's parameters in forward and again in backward, every micro-batch; prefetching
  hides them under that layer's compute, so only the excess shows.
* **Data-parallel gradient sync**, once per step, in fp32: all-reduce ``2(k − 1)/k · bytes / bw`` (DDP), or
  reduce-scatter (+ all-gather of the updated shard for ZeRO-2) over ``dp_shard`` and an all-reduce of the shard
  over ``dp_replicate``. It overlaps with backward: a layer's collective runs while the layer before it computes
  its backward, slowed by contention (Galvatron measures ×1.3); only the excess shows.
* **The loss's all-reduce**, once per step on more than one device: the executor sums the step's loss over every
  rank and reads it on the host (:meth:`CostModel.loss_sync`, priced with the layer that computes the loss); on
  this 2-core machine a gloo scalar all-reduce costs 0.5-0.8 ms of a 2-process step (``bench/ddp_overhead.py``).
* **CPU update offload**: the offloaded fraction's AdamW runs on the host at the node's rate shared by its
  devices, its gradients down and parameters up over PCIe in the compute dtype (as Reflow sends them). CoTrain
  (Liu et al. 2023) overlaps both with backward: a layer's update starts when its gradients are ready, so only the
  excess over that layer's backward shows; ZeRO-Offload's schedule (``offload_overlap=False``) adds all of it. A CPU
  "device" shares the host's memory: no PCIe, but the update copies its new weights into the parameters (at the
  copy bandwidth), and the device's own share of the update takes the same cores' time (``Time.update``).
* **Expert parallelism** (``ep``): the experts' model states on ``1/ep`` of the ranks, the all-to-alls of the
  dispatch and the wait for the most loaded rank (:mod:`nbtrain.planner.expert_cost`).
* **Re-layout** between consecutive layers whose (dp, tp, sp) layout differs: the hidden state moves once forward,
  once backward (Galvatron-BMW's transformation cost); one all-gather over ``tp`` where only ``sp`` differs.
* **Pipeline**: each stage sends its output forward and receives its gradient back per micro-batch, and pays the
  schedule's own work per micro-batch where it was measured (:meth:`CostModel.schedule_overhead`); step time
  ``Σᵢ Tᵢ + (m − 1) · maxᵢ Tᵢ`` (GPipe, Huang et al. 2019; the same bubble for 1F1B). Once-per-step costs (the
  gradient sync, the update, offloaded or not) are spread over the schedule's ``pp + m − 1`` slots, so that with
  balanced stages the step pays each stage's once, after the pipeline drains, as the stages run them side by side
  (the executor's loss all-reduce ends every rank's pipeline at once); spread over ``m`` they were paid
  ``(pp + m − 1)/m`` times. Exact for ``pp = 1``; every stage's time stays a sum over its layers, so the search
  stays exact.
"""

from __future__ import annotations

from functools import cached_property, lru_cache

from nbtrain.errors import InvalidPlanError
from nbtrain.planner.cost_options import CostOptions
from nbtrain.planner.expert_cost import dispatch_seconds, spread_experts
from nbtrain.planner.link_costs import (fsdp_seconds, gather_seconds, replica_seconds, schedule_seconds,
                                       split_loss_seconds, tp_seconds)
from nbtrain.planner.layer_terms import LayerTerms
from nbtrain.planner.memory_terms import model_states
from nbtrain.planner.plan import Plan
from nbtrain.planner.plan_checks import check_against
from nbtrain.planner.reserve import reserve_parts
from nbtrain.planner.prediction import LayerCost, Memory, Prediction, StagePrediction, Time
from nbtrain.planner.selective_cost import kept_per_rank
from nbtrain.planner.strategy import Strategy
from nbtrain.planner.update_cost import update_seconds
from nbtrain.profiler.hardware import Cluster
from nbtrain.profiler.result import ModelProfile

GiB = 2**30


UNRUNNABLE = 1e30
"""Bytes and seconds of a strategy the executor cannot run on a layer: more than any budget, finite for the tables."""

def _ring(k: int, nbytes: float, bandwidth: float, latency: float = 0.0) -> float:
    """One all-gather or reduce-scatter over a ring of ``k`` devices (Thakur et al. 2005), plus ``latency``."""
    return 0.0 if k <= 1 else latency + (k - 1) / k * nbytes / bandwidth


class CostModel(LayerTerms):
    """Evaluates layers and plans for one model, cluster, global batch and sequence length."""

    def __init__(self, profile: ModelProfile, cluster: Cluster, *, global_batch: int, seq_len: int | None = None,
                 budget_bytes: float | None = None, options: CostOptions = CostOptions()):
        self.profile, self.cluster, self.options = profile, cluster, options
        self.global_batch = global_batch
        self.seq_len = seq_len or profile.seq_len
        self.budget = float(budget_bytes if budget_bytes is not None else cluster.device_memory)
        self.reserve_parts = reserve_parts(cluster, options, self.budget)
        self.reserve = sum(nbytes for _, nbytes in self.reserve_parts)
        self.e = profile.dtype_bytes
        self._trained_params = sum(layer.trained for layer in profile.layers)
        self.host_budget = cluster.host_memory / cluster.devices_per_node
        on = profile.measured_on or ""
        self.measured = options.measured_compute and bool(on) and cluster.source != "catalog" and \
            on.startswith("cpu") == (cluster.device == "cpu")
        self.links = cluster.links
        # compute was timed by one process alone: with the plan's processes computing at once, each runs slower
        self.slowdown = max(cluster.links.slowdown(cluster.num_devices) or 1.0, cluster.core_share)
        self._eval = lru_cache(maxsize=None)(self._evaluate)

    # -- profile lookups -------------------------------------------------------------------------------------
    def _evaluate(self, layer: int, quantity: str, batch: float) -> float:
        """A profiled quantity of ``layer`` at ``batch`` sequences of the plan's length."""
        return float(self.profile.layers[layer].scaling[quantity](batch, self.seq_len)) if batch else 0.0

    def _hidden(self, layer: int, batch: float) -> float:
        """Bytes of the hidden state entering ``layer`` (what TP collectives and re-layouts move); for the first
        layer, whose input is token ids, the hidden state it produces."""
        return self._eval(max(layer - 1, 0), "output_bytes", batch)

    def _grad_bytes(self, tp: int) -> float:
        """Bytes of the whole model's gradients as the data-parallel reduction moves them, on one TP rank (a frozen
        weight has none)."""
        return max(1.0, self._trained_params * self.options.grad_reduce_bytes / tp)

    def _arch_list(self, key: str, layer: int, default: int) -> int:
        """A per-layer fact of the profile (``tp_pairs``: the collectives TP issues each way), or ``default`` for a
        block (1 for other layers) when the profile does not say."""
        values = self.profile.arch.get(key)
        if values and layer < len(values):
            return values[layer]
        return default if self.profile.layers[layer].kind == "block" else 1

    def _bandwidth(self, span: int) -> float:
        c = self.cluster
        return c.intra_node_bandwidth if span <= c.devices_per_node else c.inter_node_bandwidth

    def _gather(self, group: int, nbytes: float) -> float:
        """One all-gather producing ``nbytes`` over ``group`` consecutive devices: as measured here, else a ring."""
        measured = gather_seconds(self.links, self.cluster.num_devices, group, nbytes)
        return measured if measured is not None else _ring(group, nbytes, self._bandwidth(group))

    def _latency(self, span: int) -> float:  # a collective's floor over ``span`` consecutive devices (0 on a CPU)
        c = self.cluster
        return c.collective_latency_s if span <= c.devices_per_node else c.inter_node_latency_s

    def loss_sync(self) -> float:
        """Seconds of the executor's all-reduce of the step's loss over every device (``trainer.step``: one number,
        which the host then reads, so the step waits for it), once a step: the smallest all-reduce measured here
        (a line fitted through 64 KiB to 8 MiB reads under a scalar's floor on gloo: 0.1 ms where 64 KiB took
        0.45), else the collective's latency over the cluster. 0 on one device."""
        world = self.cluster.num_devices
        if world <= 1:
            return 0.0
        link = self.links.find("all_reduce", world, world)
        if link is not None:
            return min(seconds for _, seconds in link.points) if link.points else link.latency_s
        return self._latency(world)

    def micro_batch(self, strategy: Strategy, microbatches: int) -> float:
        """Sequences per device per micro-batch."""
        return self.global_batch / (microbatches * strategy.dp)

    # -- one layer -------------------------------------------------------------------------------------------
    def layer(self, index: int, s: Strategy, microbatches: int, pp: int = 1) -> LayerCost:
        if s.tp > 1 and index in self.profile.arch.get("tp_unsplit_layers", ()):
            # a block the model's tensor-parallel plan splits none of (Jamba's Mamba layers beside its split attention
            # layers): the executor runs it with tp=1 only (plan_checks refuses a typed plan), so it fits no budget
            # (finite: the search's tables multiply and subtract these, and inf · 0 would be NaN)
            return LayerCost(Memory(params=UNRUNNABLE), UNRUNNABLE, UNRUNNABLE, Time(compute=UNRUNNABLE), 0.0)
        prof, c, e = self.profile.layers[index], self.cluster, self.e
        b = self.micro_batch(s, microbatches)
        whole, _ = self._whole(index, s, b)
        p = (prof.params - whole) / s.tp + whole  # what TP splits, and what every TP rank holds whole
        shard = s.dp_shard
        spread = spread_experts(self.profile.arch, index, s, b * self.seq_len, self._eval(index, "flops_fwd", b))
        dense = p - spread.params if spread else p  # under ep, the experts' 1/ep under their own data parallelism
        states = [model_states(dense, s, e)] + ([model_states(spread.params / s.ep, spread.strategy, e)] if spread
                                                else [])
        params, grads, optimizer_state = (sum(part) for part in zip(*states))
        # a frozen weight is held (in the compute dtype: nothing updates it, so no fp32 master copy) and gathered,
        # but has no gradient, no optimizer state, nothing to sync, update or offload (LoRA's base, frozen layers)
        trained = prof.trained_share
        grads, optimizer_state = grads * trained, optimizer_state * trained
        held = dense + (spread.params / s.ep if spread else 0.0)  # what one rank gathers of the layer (ZeRO-3)
        # torch's pipeline stage turns FSDP2's gradient sync off for every micro-batch's backward and reduces once,
        # after the last: until then a sharded stage's layers hold their whole gradients, accumulated in the reduce
        # dtype (FSDP2's unsharded_accumulated_grad); measured: a 6.4M-parameter fp32 stage over 2 held 24.5 MiB
        # more before that reduce, its whole gradients where 12.3 were priced (tests/test_pipeline_memory.py)
        whole_grads = pp > 1 and shard > 1
        if whole_grads:
            grads = held * self.options.grad_reduce_bytes * trained
        full_act = self._tp_activations(index, s, b)
        loss_saved, loss_backward = self._loss_bytes(index, s, b, full_act)
        split = s.sp and prof.kind == "block"  # the executor runs an sp plan's embedding and head on the whole sequence
        if s.ac == "op":  # the input and the matmuls' and attention's outputs (selective_cost.py; sp: 1/tp of all)
            selective = self._eval(index, "selective_bytes", b)
            act = (selective / s.tp if split else kept_per_rank(selective, self._hidden(index, b), prof.kind, s.tp,
                                                                 full_act)) + loss_saved
        elif s.ac:  # keep only the layer's input (token ids for the first layer), whole on every TP rank (sp: a
            # slice); and what the loss saves
            act = (self._hidden(index, b) / (s.tp if split else 1) if index > 0 else 8 * b * self.seq_len) + loss_saved
        else:
            act = full_act
        # in its backward the recomputed activations are back: all (full), or what ac=op dropped; the loss's backward
        # comes first, one after the other (memory_terms.loss_bytes)
        recomputed = max(0.0, full_act - act) if s.ac == "op" else full_act - loss_saved if s.ac else 0.0
        transient = max(loss_backward, (held * e if s.zero == 3 and shard > 1 else 0.0)
                        + (held * e * trained if shard > 1 and not whole_grads else 0.0) + recomputed)

        fwd, bwd = self._compute(index, s, b)
        compute = fwd + bwd + (self._selective_recompute(index, s, b, fwd) if s.ac == "op" else fwd if s.ac else 0.0)
        compute *= 1 + (spread.share * (spread.factor - 1) if spread else 0.0)  # the most loaded expert rank's wait

        passes = 3 if s.ac else 2  # forward, backward, and the recomputed forward (ac=op recomputes the collectives)
        world, links = c.num_devices, self.links
        hidden = self._hidden(index, b)
        tp_comm = tp_seconds(links, world, s, prof.kind, hidden=hidden,
                             output=self._eval(index, "output_bytes", b), pairs=self._arch_list("tp_pairs", index, 2),
                             gathers_output=self._gathers_output(index),
                             passes=passes, sequence_parallel=split) if s.tp > 1 else 0.0
        if tp_comm is None:  # 4 ring passes per block and pass: 2 all-reduces (sp: 2 all-gathers, 2 reduce-scatters)
            tp_comm = passes * (4 if prof.kind == "block" else 1) * _ring(s.tp, hidden, self._bandwidth(s.tp),
                                                                          self._latency(s.tp))
        if s.tp > 1 and self._splits_loss(index):  # the split cross-entropy: 3 all-reduces of a number a token
            loss = split_loss_seconds(links, world, s, tokens=b * self.seq_len)
            tp_comm += loss if loss is not None else 6 * _ring(s.tp, 4 * b * self.seq_len, self._bandwidth(s.tp),
                                                               self._latency(s.tp))
        if s.sp and not split:  # the embedding's sliced output's gradient, the head's input (each forward) gathered
            tp_comm += (1 if index == 0 else passes - 1) * self._gather(s.tp, hidden)
        # the trainer syncs a sharded layer's gradients every micro-batch (torchtitan's accumulation under FSDP2,
        # trainer.gradient_sync), one stage without offload; a pipeline's schedule and an offload sync at the last
        each = pp == 1 and s.offload == 0
        zero3, dp_comm, dp_each = self._data_parallel(index, s, dense, compute, bwd, trained=trained, each=each)
        ep_comm = 0.0
        if spread:
            ep_comm = dispatch_seconds(links, world, self._gather, s.ep, hidden, spread.per_token, spread.experts,
                                       spread.factor, passes)
            zero3, dp_comm, dp_each = (a + b for a, b in zip((zero3, dp_comm, dp_each), self._data_parallel(
                index, spread.strategy, spread.params / s.ep, compute, bwd, stride=s.ep, trained=trained,
                each=each)))
        # the update of what this rank holds: its shard of the layer, and under ep its experts' shard
        offload, update = self._optimizer(index, s, trained * (dense + (
            spread.params / s.ep / spread.strategy.dp_shard * shard if spread else 0.0)), bwd)
        # once a step, spread over the schedule's pp + m − 1 slots (the module docstring's "Pipeline"); the
        # reduce-scatters of every micro-batch but the last, each micro-batch
        last = index == len(self.profile.layers) - 1
        loss_sync = self.loss_sync() if last else 0.0  # with the loss's layer
        per_step = Time(dp_comm=dp_comm - dp_each + loss_sync, offload=offload,
                        update=update).scaled(1 / (microbatches + pp - 1))
        time = Time(compute=compute, tp_comm=tp_comm, zero3_comm=zero3, ep_comm=ep_comm, dp_comm=dp_each) + per_step
        memory = Memory(params=params, grads=grads, optimizer=optimizer_state * (1 - s.offload), activations=act)
        if pp > 1 and last and prof.tied:  # the last stage's copy of the embedding
            memory = memory + self._tied_copy(s)  # priced with the head, so the search's stages hold it too
        return LayerCost(memory, act, transient, time, host_bytes=optimizer_state * s.offload)

    def _data_parallel(self, index: int, s: Strategy, p: float, compute: float, bwd: float,
                       stride: int = 1, trained: float = 1.0, each: bool = False) -> tuple[float, float, float]:
        """(FSDP2's per-micro-batch gathers, the last micro-batch's gradient sync, the sync every other micro-batch
        also runs) of a layer of ``p`` parameters per TP rank, ``trained`` of them trained (the others frozen:
        gathered, never synced): as measured here where it was (:mod:`nbtrain.planner.link_costs`), else by
        bandwidth, over groups of ranks ``stride`` apart (spread experts' peers: ``ep``), which may span more nodes.
        ``each``: a sharded layer's sync runs every micro-batch (``trainer.gradient_sync``; the measured FSDP2 costs
        hold its reduce-scatter already)."""
        e, opt, world = self.e, self.options, self.cluster.num_devices
        shard, grad_bytes = s.dp_shard, p * trained * opt.grad_reduce_bytes
        zero3 = fsdp_seconds(self.links, world, s, self.profile.layers[index].kind, param_bytes=p * e)
        sync = 0.0
        if zero3 is None:
            span = shard * s.tp * stride
            shard_bw, shard_lat = self._bandwidth(span), self._latency(span)
            gathers = 2 * _ring(shard, p * e, shard_bw, shard_lat) * opt.overlap_slowdown if s.zero == 3 else 0.0
            zero3 = max(0.0, gathers - compute)
            sync = _ring(shard, grad_bytes, shard_bw, shard_lat)  # reduce-scatter (all-reduce = RS + all-gather)
            if shard > 1 and s.zero == 2:
                sync += _ring(shard, p * trained * e, shard_bw, shard_lat)  # gather the updated shard
        if not trained:  # every weight frozen: no gradient to sync
            return zero3, 0.0, 0.0
        replicas = replica_seconds(self.links, world, s, grad_bytes=grad_bytes,
                                   model_grad_bytes=self._grad_bytes(s.tp))
        if replicas is not None:
            sync += replicas
        else:
            span = s.devices * stride
            sync += 2 * _ring(s.dp_replicate, grad_bytes / shard, self._bandwidth(span), self._latency(span))
            sync = max(0.0, sync * opt.overlap_slowdown - bwd)
        return zero3, sync, sync if each and shard > 1 else 0.0

    def _optimizer(self, index: int, s: Strategy, p: float, bwd: float) -> tuple[float, float]:
        """(the offloaded update's time not hidden under backward, the device's own update and clipping)."""
        return update_seconds(self.cluster, self.options, self.links, s, p, bwd, dtype_bytes=self.e,
                              layers=len(self.profile.layers))

    def relayout(self, index: int, before: Strategy, after: Strategy, microbatches: int) -> float:
        """Seconds per micro-batch to move the hidden state entering ``index`` between two layouts."""
        if before.layout == after.layout:
            return 0.0
        nbytes = max(self._hidden(index, self.micro_batch(s, microbatches)) / s.tp for s in (before, after))
        if before.layout[:2] == after.layout[:2]:  # sp on one side: gather the sequence forward, or its gradient back
            return self._gather(before.tp, nbytes * before.tp)
        gather = self.links.find("all_gather", before.devices, self.cluster.num_devices)
        if gather is not None:  # measured: one gather of the hidden state forward, one of its gradient back
            return 2 * gather.seconds(nbytes * before.devices)
        return 2 * (nbytes / self._bandwidth(before.devices) + self._latency(before.devices))

    def p2p(self, last_layer: int, s: Strategy, microbatches: int, pp: int, stage: int) -> float:
        """Seconds per micro-batch that ``stage`` (ending at ``last_layer``) spends sending its output forward and
        receiving the gradient back. pp is the outermost mesh axis: stage i runs on devices [i·D, (i+1)·D), so its
        next stage is in another node unless both sit inside one."""
        nbytes = self._eval(last_layer, "output_bytes", self.micro_batch(s, microbatches)) / s.tp
        gather = 2 * self._gather(s.tp, nbytes * s.tp) if s.sp else 0.0  # sp: sent whole
        per_stage, node = self.cluster.num_devices // pp, self.cluster.devices_per_node
        boundary = (stage + 1) * per_stage  # first device of the next stage
        same_node = per_stage < node and boundary % node != 0
        c = self.cluster
        measured = self.links.find("p2p", 2, c.num_devices)
        if measured is not None and c.num_nodes == 1:  # measured here: the activation forward, its gradient back
            return 2 * measured.seconds(nbytes) + gather
        return 2 * (nbytes / c.intra_node_bandwidth + c.collective_latency_s if same_node else
                    nbytes / c.inter_node_bandwidth + c.inter_node_latency_s) + gather

    def schedule_overhead(self) -> float:
        """Seconds per micro-batch the pipeline schedule itself costs each stage (:func:`schedule_seconds`)."""
        return schedule_seconds(self.links, self.cluster.num_devices, self.cluster.num_nodes)

    def in_flight(self, stage: int, pp: int, microbatches: int, schedule: str) -> int:
        return microbatches if schedule == "gpipe" else min(pp - stage, microbatches)

    # -- a whole plan ----------------------------------------------------------------------------------------
    def stage(self, plan: Plan, i: int, start: int, end: int) -> tuple[StagePrediction, Time]:
        k = self.in_flight(i, plan.pp, plan.microbatches, plan.schedule)
        costs = [self.layer(j, plan.layers[j], plan.microbatches, plan.pp) for j in range(start, end)]
        memories = [Memory(reserve=self.reserve, transient=max(cost.transient for cost in costs))]
        times = [Time()]
        for j, cost in zip(range(start, end), costs):
            memories += [cost.memory, Memory(activations=(k - 1) * cost.activations)]
            times.append(cost.time)
            if j > start:
                times.append(Time(relayout=self.relayout(j, plan.layers[j - 1], plan.layers[j], plan.microbatches)))
        memory, time = Memory.summed(memories), Time.summed(times)
        if i < plan.pp - 1:
            time = time + Time(pp_comm=self.p2p(end - 1, plan.layers[end - 1], plan.microbatches, plan.pp, i))
        if plan.pp > 1:
            time = time + Time(pp_comm=self.schedule_overhead())
        host = sum(cost.host_bytes for cost in costs)
        return StagePrediction(start, end, k, memory, time.total, host), time

    def _tied_copy(self, s: Strategy) -> Memory:
        """The last stage's own copy of a weight tied to the first stage's embedding (Megatron-LM's embedding
        group: both stages hold it and sum its gradients once a step, a cost left out of the step time): its
        parameters, gradients and Adam state, under the head's strategy, as :meth:`layer` counts them."""
        arch = self.profile.arch
        params, grads, optimizer = model_states((arch.get("vocab_size") or 0) * (arch.get("n_embd") or 0) / s.tp, s,
                                                self.e)
        return Memory(params=params, grads=grads, optimizer=optimizer * (1 - s.offload))

    def estimate(self, plan: Plan) -> Prediction:
        self.check(plan)
        stages, times = zip(*(self.stage(plan, i, a, b) for i, (a, b) in enumerate(plan.stage_ranges())))
        slowest = max(stage.time_per_microbatch for stage in stages)
        m = plan.microbatches
        step = sum(stage.time_per_microbatch for stage in stages) + (m - 1) * slowest
        total = times[max(range(len(stages)), key=lambda i: stages[i].time_per_microbatch)].over_step(step, m, plan.pp)
        peak = self.cluster.num_devices * self.cluster.peak_flops
        return Prediction(step, self.global_batch * self.seq_len / step, self._model_flops / (step * peak), stages,
                          total, self.budget, self.host_budget, self.reserve_parts)

    _model_flops = cached_property(lambda self: self.profile.at(self.global_batch, self.seq_len).flops_per_step)

    def check(self, plan: Plan) -> None:
        """Reject plans this model and cluster cannot take, with what to change (:mod:`nbtrain.planner.plan_checks`)."""
        check_against(plan, self.profile, self.cluster, self.global_batch)


def estimate(plan: Plan, profile: ModelProfile, cluster: Cluster, *, global_batch: int | None = None,
             seq_len: int | None = None, memory: float | None = None, options: CostOptions = CostOptions()
             ) -> Prediction:
    """Predict any plan — recommended or typed — on ``cluster``: step time, throughput, memory per stage."""
    batch = global_batch or plan.global_batch
    if not batch:
        raise InvalidPlanError("estimate needs the global batch: pass global_batch=... or put it in the plan")
    model = CostModel(profile, cluster, global_batch=batch, seq_len=seq_len or plan.seq_len,
                      budget_bytes=memory, options=options)
    return model.estimate(plan)
