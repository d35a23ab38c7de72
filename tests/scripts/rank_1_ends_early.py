"""Rank 1 finishes at once (``sys.exit(0)``) while rank 0 works a while, then goes into an all-reduce that rank 1
never joins: rank 1 waits alone in the launch's closing barrier, rank 0 in the all-reduce."""

import sys
import time

import torch
import torch.distributed as dist

if dist.get_rank() == 1:
    sys.exit(0)
time.sleep(3)
dist.all_reduce(torch.ones(1))
