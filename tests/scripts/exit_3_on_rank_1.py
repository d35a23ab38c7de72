"""Rank 1 ends with ``sys.exit(3)`` while rank 0 waits for it in a barrier: ``nbtrain run exit_3_on_rank_1.py``."""

import sys

import torch.distributed as dist

if dist.get_rank() == 1:
    sys.exit(3)
dist.barrier()
