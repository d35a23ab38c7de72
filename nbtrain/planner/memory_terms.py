"""Memory terms of the cost model: the loss's, which torch's ``FSDPMemTracker`` found missing (issue 28, point 7),
and the model states of a layer's parameters under a strategy.

    >>> loss_bytes(16e6, dtype_bytes=2, saved=90e6)    # bf16 logits of 16 MB: (saved fp32 copy, backward's two)
    (32000000.0, 64000000.0)

It is checked against the tracker's count of nbtrain's own FSDP2 step (``tests/test_memory_oracle.py``;
``bench/memory_oracle.py`` prints the table). :class:`~nbtrain.planner.cost.CostModel` adds it to the head.

    >>> model_states(1e6, Strategy(dp_shard=2), dtype_bytes=2)   # bf16, ZeRO-3 over 2: params, grads, Adam state
    (1000000.0, 1000000.0, 6000000.0)
"""

from __future__ import annotations

from nbtrain.planner.strategy import Strategy


def loss_bytes(logits: float, *, dtype_bytes: int, saved: float, chunk: float | None = None,
               tokens: float = 0.0) -> tuple[float, float]:
    """(bytes the loss saves for backward, bytes its backward holds at once) for a head whose output, the logits,
    takes ``logits`` bytes in the compute dtype (``dtype_bytes``) and which saves ``saved`` bytes in all; ``chunk``:
    the share of the logits a :class:`~nbtrain.profiler.chunked_loss.ChunkedLMLoss` takes at a time (of ``tokens``).

    The chunked loss saves the logits as they are and one fp32 log-sum-exp a token; its backward holds their
    gradient (the logits' size and dtype) and two fp32 chunks (the upcast rows and their softmax):
    ``loss_bytes(16e6, dtype_bytes=2, saved=90e6, chunk=1 / 8, tokens=1000) == (16004000.0, 24000000.0)``.

    The loss nbtrain trains with (``lm_loss``, Hugging Face's causal-LM loss alike) upcasts the logits to fp32 and
    takes their cross-entropy, which saves the log-probabilities (one fp32 copy of the logits, already among the
    head's profiled saved bytes, hence at most ``saved``) and in backward holds two fp32 logits-sized gradients at
    once (of the log-probabilities and of the logits). ``FSDPMemTracker`` on nbtrain's GPT (vocabulary 8192,
    2 × 512 tokens a device) counts exactly these: 64 MiB of "temp" at the step's peak, during the loss's backward,
    and 32 MiB of log-probabilities among the saved activations with the head checkpointed (the loss runs after
    the model, outside the checkpoint). The loss's backward runs before the head's, whose gradient hooks have not
    yet gathered its weights nor made its gradients: the two peaks come one after the other, not together."""
    fp32 = logits * 4 / dtype_bytes
    if chunk is not None:
        return min(logits + 4 * tokens, saved), logits + 2 * min(1.0, chunk) * fp32
    return min(fp32, saved), 2 * fp32


def model_states(params: float, s: Strategy, dtype_bytes: int) -> tuple[float, float, float]:
    """(parameters, gradients, optimizer state) bytes on one device of ``params`` parameters (one TP rank's) under
    ``s`` (Rajbhandari et al. 2020, ZeRO §3): compute-dtype parameters, sharded over ``dp_shard`` under ZeRO-3;
    compute-dtype gradients, sharded; the fp32 master copy and two Adam moments (12 bytes a parameter, 8 when the
    compute dtype is fp32 and the parameters are the master), sharded, offloaded or not. Under ZeRO-2 in fp32 the
    sharded master is held beside the gathered parameters (FSDP2 gathers into buffers of its own: issue 45, 3.1 GiB
    a device at a Llama-7B shape on 8)."""
    shard, e = s.dp_shard, dtype_bytes
    master = params * 4 / shard if s.zero == 2 and shard > 1 and e == 4 else 0.0
    return (params * e / (shard if s.zero == 3 else 1) + master, params * e / shard,
            params * (8 + (4 if e < 4 else 0)) / shard)
