"""Workers: processes started through torch elastic (as accelerate's launchers do), one process group each.

``workers`` launches a function on N ranks and returns their results (CPU mode forced where there is no GPU, the
world size checked in each worker); ``failures`` turns a rank's error into one message and stops the others;
``stacks`` dumps every rank's stack when a run hangs; ``script`` is the entry of ``nbtrain run train.py``.
"""
