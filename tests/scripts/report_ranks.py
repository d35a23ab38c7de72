"""Each rank of ``accelerate launch`` / ``torchrun`` writes ``OUT.<RANK>``: what ``nbtrain.launch`` saw in it.

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 report_ranks.py OUT
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from nbtrain.run.launch.workers import launch


def world():
    total = torch.tensor([1])
    dist.all_reduce(total)  # one per rank that joined the group
    return {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "ranks_reduced": int(total),
            "pid": os.getpid()}


seen = launch(world)
with open(f"{sys.argv[1]}.{os.environ.get('RANK', 'main')}", "w") as f:
    json.dump(seen, f)
