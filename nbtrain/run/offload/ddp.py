"""Offload under DistributedDataParallel: take each bucket's gradients from its all-reduce, averaged.

    >>> ddp = DistributedDataParallel(model, bucket_cap_mb=4)     # smaller buckets: updates start earlier
    >>> opt = OffloadedAdamW.from_model(ddp, offload=1.0)         # calls attach_ddp(opt, ddp)

A parameter's post-accumulate-grad hook fires when its *local* gradient is complete, before DDP has averaged it
over the ranks, so under DDP the offload engine must not read gradients there. Instead a DDP communication hook
all-reduces each bucket as DDP's default hook does (divide by the world size, then sum: ``allreduce_hook``) and,
in a ``.then`` callback on that all-reduce, hands the averaged gradient of each of the bucket's parameters to the
engine (which copies it to the host, or reads it where it is when that is host memory, and may queue the layer's
CPU update while backward goes on).

The ordering this relies on, all of it DDP's documented contract for communication hooks:

- DDP calls the hook once per bucket per synchronised backward, after every gradient of the bucket has been
  accumulated into it; ``bucket.gradients()`` are views of ``bucket.buffer()``, which ``all_reduce`` changes in place.
- The ``.then`` callback runs after the all-reduce has completed (on the process group's thread for gloo), so the
  views hold the averages when the engine takes them (a GPU's are copied out, asynchronously, before it returns).
- DDP waits for every bucket's future, callbacks included, before ``loss.backward()`` returns, and only then
  writes the averaged buffer back into each ``.grad`` (``gradient_as_bucket_view=False``): so in ``step()`` every
  offloaded gradient has been handed over, and the device-side share reads averaged gradients from ``.grad``.
- The bucket buffer is next written when the next backward copies gradients into it; ``step()`` waits for every
  CPU update before it returns, so an update reading the buffer in place never sees the next step's values.
- Under ``ddp.no_sync()`` the hook is not called: micro-batches before a step's last only accumulate.

Buckets fill in the order gradients are produced (last layers first; DDP rebuilds them after the first step to
follow the observed order), so with buckets no larger than a layer the CPU updates start as in one process. The
first step's buckets follow the reverse parameter order.
"""

from __future__ import annotations

import torch.distributed as dist


def attach_ddp(opt, model) -> None:
    """Make ``opt`` (an :class:`~nbtrain.run.offload.optimizer.OffloadedAdamW` over ``model.module``'s parameters) take its
    offloaded gradients from ``model``'s all-reduce. Call once, before the first backward."""
    group = model.process_group
    world = dist.get_world_size(group)

    def allreduce_then_hand_over(state, bucket):
        buffer = bucket.buffer()
        buffer.div_(world)
        pairs = list(zip(bucket.parameters(), bucket.gradients()))
        future = dist.all_reduce(buffer, group=group, async_op=True).get_future()

        def hand_over(fut):
            if not opt._closed and opt._sync:
                for param, grad in pairs:
                    index = opt._index.get(id(param))
                    if index in opt._cpu_pieces_of:
                        opt._grad_arrived(index, grad)
            return fut.value()[0]

        return future.then(hand_over)

    model.register_comm_hook(None, allreduce_then_hand_over)
    opt._ddp = True
