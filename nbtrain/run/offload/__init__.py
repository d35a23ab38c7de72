"""CoTrain: part of each layer's AdamW update runs on the CPU, overlapped with backward (REFERENCE.md, CoTrain).

``optimizer`` is ``OffloadedAdamW`` (per-layer CPU updates started from gradient hooks, landed before the next
forward needs the weights), ``split`` the cut inside a layer between device and CPU, ``state`` its state in the
layout every plan shares (checkpoints), ``ddp`` the gradient hooks for a plain data-parallel model. The fraction
offloaded per layer is chosen by the planner (``nbtrain.planner.offload_split``), never here.

What lives where. For the offloaded part of each layer (its ``offload`` fraction, cut by
:func:`~nbtrain.run.offload.split.cut_layer`): an fp32 master copy (a tensor of its own, whatever the parameter's
dtype: bf16 compute copies work), AdamW's two moments and its step count, on the CPU (pinned when a GPU exists).
The rest is updated on the device by the same fused AdamW (through an fp32 master there when the parameter is not
fp32). Gradients reach the CPU as backward produces them: from a GPU, copied into pinned buffers on a copy stream
of their own, which waits for backward's kernels so far and then runs beside the next ones (an event on it tells the
CPU worker when a layer's gradients are in host memory; the gradient's memory is recorded on that stream so the
allocator does not reuse it before the copy has read it); already in host memory (a CPU-only run), read where they
are, as a DMA engine would, not the device's cores. The new weights go back to a GPU on the compute stream, from
pinned memory without blocking, just before the forward that needs them: that forward could not start earlier.

Schedules. ``"overlap"`` (CoTrain): a post-accumulate-grad hook hands each parameter's gradient over as backward
produces it; when all of a layer's offloaded gradients are in, its update is queued to ONE worker thread, which
runs ``torch.optim.adamw.adamw(..., fused=True)`` (what ``AdamW(fused=True).step()`` runs) while backward goes on,
then writes the new weights into host-memory parameters (backward is done with a weight once its gradient is final;
a GPU's copies back wait for the landing). ``"after_backward"`` (ZeRO-Offload): the same hand-over, every update
queued in ``step()``. In both, ``step()`` updates the device's share on the calling thread.

Landing (``land_before``, what ``from_model`` passes by default). The next forward needs the layers' weights in
order, first layer first, while the CPU updates them in gradient order, last layer first: so ``step()`` returns
without waiting for the CPU, and a forward pre-hook on each layer's modules waits for that layer's update (and
copies a GPU's weights back) just before its forward. The CPU's queue runs on under the next forward's first
layers, which is why the split keeps those on the device (CoTrain's data-reuse distance). ``model.state_dict()``,
``state_dict()``, ``close()`` and :meth:`synchronize` wait for every update; read parameters directly only after
one of them. Without ``land_before``, ``step()`` waits for the worker: when it returns, the model holds exactly the
new weights. A worker's exception is raised where its update lands. Offload 0 everywhere is plain fused AdamW.
Between an overlapped backward and ``step()`` the worker is writing the weights, so a model from ``from_model``
refuses a forward then (a metric, a micro-batch not under ``no_sync()``) with what to do, rather than read some
layers old and some new.

Data parallel under DDP: :mod:`nbtrain.run.offload.ddp`. Under FSDP2 (``dp_shard``, and its hybrid
``dp_replicate``) the parameters are DTensors and everything above applies to each rank's local shard:
FSDP2 calls a sharded parameter's post-accumulate-grad hooks once its reduce-scatter (and, hybrid, all-reduce) has
produced the averaged gradient shard, so each rank hands over and updates its own shard, as it would in ZeRO-Offload.
Under tensor parallelism (``tp``, alone or with FSDP2) the parameters are DTensors split over the TP ranks, and
each rank again updates its own shard; a gradient may come with other placements than its parameter's (a row-wise
split embedding's is whole, a weight that saw split activations may hold partial sums), so each is first given its
parameter's (:func:`~nbtrain.run.offload.state.settle_gradients`). Spread experts (``ep``) are each rank's own.
In a pipeline each stage's optimizer holds that stage's layers; the schedule runs one backward per micro-batch,
all but the last under ``no_sync()``, and the last one hands the gradients over as it produces them (an FSDP2
stage reduce-scatters during it: :meth:`~nbtrain.run.parallel.pipeline.PipelineRunner.hand_over_to`); the norm
sums over the stages, counting a tied embedding once, and the tied copies are handed over in ``step()``, after the
two stages have summed their gradients.

Gradients cross to the CPU in the dtype ``grad_dtype`` says: bf16 when training in bf16 (half the PCIe bytes, as
DeepSpeed's Reflow sends them), widened to fp32 for the update; a CPU run rounds them alike, so it trains as a GPU
run does. Clipping's norm is of the gradients as computed.

Threads. A kernel runs on the thread that calls it, with that thread's OpenMP thread count, and a new thread
starts from the process-wide count. The worker sets its own count to ``threads`` (1) before any op, so it never
starts an OpenMP team; with the process at one intra-op thread too (``nbtrain.launch`` sets it), backward and the
CPU update each have one core (STACK.md: two threads per Python thread oversubscribe the cores and run slower).

Gradient clipping (``clip_norm``) is exact. The norm needs every gradient; the overlap updates before backward
has finished, so with clipping on each overlapped update is *speculative*. Before it, the worker saves what the
update overwrites (master, moments, step: 12 bytes per offloaded parameter more CPU memory, allocated on first use,
and a copy of 24 bytes per parameter per step, under half of AdamW's own ~28 bytes of traffic). It also sums the
squared gradient norms it has seen: once that partial sum exceeds the limit the step is known to clip, and the
remaining layers wait for ``step()`` (ZeRO-Offload's schedule) rather than being undone later (under FSDP2 the sum
is of this rank's shards, a lower bound of the whole: ranks may decide differently, which changes when an update
runs, not its result). ``step()`` computes the norm as ``torch.nn.utils.clip_grad_norm_`` does (a norm per tensor,
then the norm of those; shards' squares summed over their ranks) and, when it exceeds
the limit, undoes each speculative update from its saved copy and redoes it with the gradients scaled by
``clip_norm / (norm + 1e-6)``. ``clipped_steps`` counts the clipped steps, ``rollbacks`` those in which an update
had been speculated (undone, or dropped if it had not started yet). A step that clips costs up to one more CPU
update of the layers speculated; one that does not, only the saves. ``"after_backward"`` never speculates.

Learning rate. ``param_groups`` has one group per layer (``lr``, ``betas``, ``eps``, ``weight_decay``, and its
``offload``) and the class is a ``torch.optim.Optimizer``, so ``LambdaLR(opt, f)`` drives it. A layer's update may
start during backward, so a step's lr must be set before its backward: a scheduler stepped right after
``opt.step()`` (the usual loop, and nbtrain's Trainer) does that.
"""
