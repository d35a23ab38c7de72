"""Two memory terms of the cost model that torch's ``FSDPMemTracker`` found missing (issue 28, point 7).

    >>> gradient_bytes(8e6, 2, shard=8, microbatches=2, reduce_bytes=4)    # a block accumulating: whole, fp32
    32000000.0
    >>> loss_bytes(16e6, dtype_bytes=2, saved=90e6)    # bf16 logits of 16 MB: (saved fp32 copy, backward's two)
    (32000000.0, 64000000.0)

Each is checked against the tracker's count of nbtrain's own FSDP2 step (``tests/test_memory_oracle.py``;
``bench/memory_oracle.py`` prints the table). :class:`~nbtrain.planner.cost.CostModel` adds them per layer.
"""

from __future__ import annotations


def gradient_bytes(params: float, dtype_bytes: int, shard: int, microbatches: int, reduce_bytes: int) -> float:
    """Gradient bytes a layer of ``params`` parameters (on one TP rank) holds at the step's peak.

    Sharded over ``shard`` ranks after FSDP2's reduce-scatter (ZeRO-2 and 3, Rajbhandari et al. 2020). But
    accumulating over ``microbatches`` > 1, the trainer turns FSDP2's gradient sync off for all but the last
    (``set_requires_gradient_sync(False)``; torch's pipeline stages do too), and FSDP2 then keeps every layer's
    whole gradient from one micro-batch to the next, in the reduction's dtype (``reduce_bytes``, fp32):
    ``FSDPMemTracker`` counts 81.11 MiB of them for nbtrain's GPT (21.3 M parameters) at ``dp_shard=8 mb=2``, in
    fp32 and in bf16 under ``MixedPrecisionPolicy(reduce_dtype=fp32)``, where the sharded ones are 10.14 MiB.
    (torchtitan reduce-scatters every micro-batch instead, pytorch/torchtitan#1710: more traffic, sharded
    gradients.) Unsharded (``shard`` = 1, DDP), the whole gradients in the compute dtype."""
    if shard > 1 and microbatches > 1:
        return params * reduce_bytes
    return params * dtype_bytes / shard


def loss_bytes(logits: float, *, dtype_bytes: int, saved: float) -> tuple[float, float]:
    """(bytes the loss saves for backward, bytes its backward holds at once) for a head whose output, the logits,
    takes ``logits`` bytes in the compute dtype (``dtype_bytes``) and which saves ``saved`` bytes in all.

    The loss nbtrain trains with (``lm_loss``, Hugging Face's causal-LM loss alike) upcasts the logits to fp32 and
    takes their cross-entropy, which saves the log-probabilities (one fp32 copy of the logits, already among the
    head's profiled saved bytes, hence at most ``saved``) and in backward holds two fp32 logits-sized gradients at
    once (of the log-probabilities and of the logits). ``FSDPMemTracker`` on nbtrain's GPT (vocabulary 8192,
    2 × 512 tokens a device) counts exactly these: 64 MiB of "temp" at the step's peak, during the loss's backward,
    and 32 MiB of log-probabilities among the saved activations with the head checkpointed (the loss runs after
    the model, outside the checkpoint). The loss's backward runs before the head's, whose gradient hooks have not
    yet gathered its weights nor made its gradients: the two peaks come one after the other, not together."""
    fp32 = logits * 4 / dtype_bytes
    return min(fp32, saved), 2 * fp32
