"""Python's cyclic garbage collector held off while a training step runs, let run between steps, and kept off what
was there before training began.

    >>> import gc
    >>> with collection_paused():
    ...     gc.isenabled()
    False

A step allocates thousands of small Python objects (module calls, autograd's saved tensors, on the CPU the hooks that
count them), so the collector's youngest generation fills several times a step, and each collection then walks the
tensors it finds, and through them the autograd graph the step is building. On a transformers Llama of two blocks,
two micro-batches on 2 CPU processes, those collections took 8 ms of a 25 ms step (``bench/RESULTS.md``, "FSDP2, TP
and DDP priced as a fine-tuned model's step pays them"). Paused during the step, they run at the first allocation
after it, when the step's graph is gone and walking what is left is cheap. torchtitan and Megatron-LM turn the
automatic collector off in their training loops for the same reason. Nothing is lost: a cycle made during a step is
collected after it.

A full collection walks every object the process holds, and a worker that imported torch and transformers and built a
model holds millions: 250-360 ms each here, twice in 30 steps of a 2-stage pipeline whose steps take 35-40 ms, and
while one rank collects the other waits for it, inside its own step. :func:`collections_frozen` moves what exists
when training starts out of the collector's reach (``gc.freeze``) for the steps, and back when they end: a full
collection then walks only what the steps made.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager


@contextmanager
def collection_paused():
    """No automatic garbage collection inside; the collector as it was afterwards (left off if it was off)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextmanager
def collections_frozen():
    """Every object alive on entry left out of garbage collection inside (``gc.freeze``), and let back on exit
    (``gc.unfreeze``): a training loop's collections walk only what its steps made."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
