"""A training script as a user writes it: ``nbtrain.fit`` on a tiny GPT, 2 steps, then it saves what it ends with.

    python fit_tiny_gpt.py OUT                          # fit forks its 2 workers
    torchrun --nproc-per-node 2 fit_tiny_gpt.py OUT     # fit runs in each of torchrun's processes

Each process writes ``OUT.<RANK>.pt`` (``OUT.main.pt`` outside torchrun): the weights before and after ``fit``, the
model's class after it, and the FitResult's losses, steps, plan and state dict's names.
"""

import os
import sys

import torch

import nbtrain

out = sys.argv[1]
torch.manual_seed(0)
model = nbtrain.GPT(nbtrain.GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
initial = {k: v.clone() for k, v in model.state_dict().items()}
window = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(1))
batches = [(window[:, :-1], window[:, 1:])]
# as docs/running.md writes it: no num_processes (the plan's 2 devices; under torchrun, its WORLD_SIZE of 2)
result = nbtrain.fit(model, batches, plan="dp_shard=2", steps=2, progress=False)
torch.save({"initial": initial, "state": model.state_dict(), "model_class": type(model).__name__,
            "losses": result.losses, "steps": [r.step for r in result.records], "plan": str(result.plan),
            "result_state": result.state_dict}, f"{out}.{os.environ.get('RANK', 'main')}.pt")
