"""``nbtrain demo``: the whole path on one screen — profile, plan, train under the plan, measured beside predicted.

    $ nbtrain demo                                   # GPT-2 planned for 8 × H100, then a small GPT trained here
    $ nbtrain demo --gpus 64 --memory 40GiB --processes 2 --steps 20

1. Profile GPT-2 (124M) on fake tensors and plan it for the described cluster: the plan table and the
   comparison with the baselines users know.
2. Plan a small LLaMA-shaped GPT for this machine (``--processes`` CPU processes; its layers timed as a worker
   runs them, its communication measured once and cached) and train it under that plan for ``--steps`` steps on real text — the bytes of Python's standard library
   sources — with losses, and the measured step time and tensor memory beside the predicted ones.
"""

from __future__ import annotations

import torch

from nbtrain.data import stdlib_batches
from nbtrain.models import GPT, GPTConfig
from nbtrain.planner.planned import plan_and_compare
from nbtrain.planner.recommend import plan
from nbtrain.planner.search_space import SearchOptions
from nbtrain.profiler.hardware import Cluster
from nbtrain.profiler.model import profile
from nbtrain.profiler.timed import timed_profile
from nbtrain.run.fit import fit

# Untied embeddings, so that every strategy (tensor parallel embedding, pipeline stages) applies.
DEMO_MODEL = GPTConfig(vocab_size=256, block_size=256, n_layer=4, n_head=4, n_kv_head=2, n_embd=128,
                       ffn_hidden=344, norm="rmsnorm", mlp="swiglu", position="rope", bias=False,
                       tie_embeddings=False)


def run(gpus: int = 8, gpu: str = "H100", memory=None, processes: int = 2, steps: int = 10, batch: int = 8,
        seq: int = 128) -> None:
    print("== 1. GPT-2 (124M), planned for", f"{gpus} × {gpu}", "==\n")
    cluster = Cluster.from_catalog(gpu, num_devices=gpus, device_memory=memory) if memory else \
        Cluster.from_catalog(gpu, num_devices=gpus)
    job = plan_and_compare(profile("gpt2", batch_size=1, seq_len=1024), cluster, global_batch=max(gpus * 4, 8),
                           seq_len=1024)
    for part in job.report():
        print(part, "\n")

    print(f"== 2. A small GPT trained here: {processes} CPU processes, {steps} steps on standard-library text ==\n")
    local = Cluster.this_machine(processes)  # rates measured, communication measured once per machine and cached
    if local.num_devices != processes:  # a GPU machine: the GPUs the launch uses
        local = local.replace(num_devices=processes, devices_per_node=processes)
    torch.manual_seed(0)
    model = GPT(DEMO_MODEL)
    small = timed_profile(model, batch_size=max(1, batch // processes), seq_len=seq)  # timed as a worker runs
    # CPU update offload trades host memory and CPU time for device memory: as the magic, only when asked
    local_plan = plan(small, local, global_batch=batch, seq_len=seq, options=SearchOptions(offload_levels=(0.0,)))
    print(local_plan.summary(label="plan for this machine"), "\n")
    result = fit(model, stdlib_batches(batch, seq, count=steps), plan=local_plan, steps=steps,
                 num_processes=processes, lr=3e-3, cluster=local)
    print(result)
