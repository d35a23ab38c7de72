"""Files the error table's reproductions (tests/test_error_table.py) write into their working folder.

Each is what a user would have beside them when they make the mistake: a module of models (``mods.py``), training
scripts for ``nbtrain run``, a module of loss functions (``fit_cases.py``). Line numbers matter where the message
names them (``fit_cases.py:11 in slow_loss``).
"""

from __future__ import annotations

MODS = '''\
"""Models a user refers to as mods:NAME."""
import torch


SIZE = 64  # not batches


def broken():
    raise RuntimeError("no weights here")


class NeedsMask(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(64, 8)

    def forward(self, ids, mask):
        return self.embed(ids) * mask


class Feat(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, features):
        return self.proj(features)


def build():
    return Feat()
'''

FIT_CASES = '''\
"""Loss functions for nbtrain.fit that misbehave in the workers."""
import time

from nbtrain.profiler.model import lm_loss


def slow_loss(logits, targets):
    # every rank stops here, outside any collective, for
    # longer than the launch's timeout
    loss = lm_loss(logits, targets)
    time.sleep(120)
    return loss


def nan_from_step_2():
    calls = []

    def loss_fn(logits, targets):
        calls.append(1)
        loss = lm_loss(logits, targets)
        return loss * float("nan") if len(calls) >= 2 else loss

    return loss_fn
'''
assert FIT_CASES.splitlines()[10].strip() == "time.sleep(120)"  # line 11, as the row in docs/errors.md says

FAILS = '''\
import torch.distributed as dist

if dist.get_rank() == 1:
    raise ValueError("this script fails on rank 1")
dist.barrier()  # rank 0 waits here for rank 1, which has gone
'''

KILLED = '''\
import os
import signal
import time

import torch.distributed as dist

if dist.get_rank() == 1:
    time.sleep(0.5)  # rank 0 is in the barrier by then
    os.kill(os.getpid(), signal.SIGKILL)  # as the out-of-memory killer would
dist.barrier()
'''

TRAIN = "print('training')\n"

EXITS = """\
import sys, torch.distributed as dist
if dist.get_rank() == 1:
    sys.exit(3)
dist.barrier()
"""

HANG_CELL = '''\
def rank_1_never_arrives():
    if dist.get_rank() == 1:
        time.sleep(3600)
    dist.barrier()
'''

INTERRUPT = '''\
import os
import signal
import time

import torch
import torch.distributed as dist

import nbtrain

STEPS = 6
g = torch.Generator().manual_seed(0)
BATCHES = [(x, torch.roll(x, -1, dims=1)) for x in (torch.randint(0, 64, (2, 8), generator=g) for _ in range(STEPS))]


def pressing_interrupt_at(step):
    def data(i):
        if i == step and dist.get_rank() == 0:
            os.kill(os.getppid(), signal.SIGINT)  # the workers are this process's children: Ctrl-C in its terminal
            time.sleep(60)
        return BATCHES[i]
    return data


model = nbtrain.GPT(nbtrain.GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16,
                                      tie_embeddings=False))
try:
    nbtrain.fit(model, pressing_interrupt_at(3), plan="dp_replicate=2", steps=STEPS, num_processes=2,
                progress=False, timeout=60, checkpoint_dir="runs/gpt", checkpoint_every=2)
except KeyboardInterrupt as error:
    print(f"{type(error).__name__}: {error}")
'''
