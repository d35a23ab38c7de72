"""Python's cyclic garbage collector held off while a training step runs, and let run between steps.

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
