"""``nbtrain demo``: the whole path on one screen — profile, plan, train under the plan, measured beside predicted.

    $ nbtrain demo                                   # GPT-2 planned for 8 × H100, then a small GPT trained here
    $ nbtrain demo --gpus 64 --memory 40GiB --processes 2 --steps 20

1. Profile GPT-2 (124M) on fake tensors and plan it for the described cluster: the plan table and the
   comparison with the baselines users know.
2. Plan a small LLaMA-shaped GPT for this machine (``--processes`` CPU processes, measured by micro-benchmarks)
   and train it under that plan for ``--steps`` steps on real text — the bytes of Python's standard library
   sources — with losses, and the measured step time beside the predicted one.
"""

from __future__ import annotations

import pathlib
import random
import sysconfig

import torch

import nbtrain
from nbtrain.models import GPTConfig
from nbtrain.planner.recommend import baselines
from nbtrain.planner.report import comparison_table
from nbtrain.planner.search import SearchOptions

# Untied embeddings, so that every strategy (tensor parallel embedding, pipeline stages) applies.
DEMO_MODEL = GPTConfig(vocab_size=256, block_size=256, n_layer=4, n_head=4, n_kv_head=2, n_embd=128,
                       ffn_hidden=344, norm="rmsnorm", mlp="swiglu", position="rope", bias=False,
                       tie_embeddings=False)


def stdlib_batches(batch: int, seq: int, count: int, seed: int = 0,
                   vocab_size: int = 256) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` batches of ``batch`` windows of ``seq + 1`` bytes from Python's standard library sources:
    real text that is on every machine. Token = byte; a vocabulary smaller than 256 takes the bytes folded into it
    (``byte % vocab_size``)."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.stat().st_size > 4 * (seq + 1))[:200]
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        rows = []
        for _ in range(batch):
            data = rng.choice(files).read_bytes()
            start = rng.randrange(len(data) - seq - 1)
            rows.append(torch.tensor(list(data[start:start + seq + 1])) % vocab_size)
        window = torch.stack(rows)
        out.append((window[:, :-1].contiguous(), window[:, 1:].contiguous()))
    return out


def run(gpus: int = 8, gpu: str = "H100", memory=None, processes: int = 2, steps: int = 10, batch: int = 8,
        seq: int = 128) -> None:
    print("== 1. GPT-2 (124M), planned for", f"{gpus} × {gpu}", "==\n")
    profile = nbtrain.profile("gpt2", batch_size=1, seq_len=1024)
    cluster = nbtrain.Cluster.from_catalog(gpu, num_devices=gpus, device_memory=memory) if memory else \
        nbtrain.Cluster.from_catalog(gpu, num_devices=gpus)
    best = nbtrain.plan(profile, cluster, global_batch=max(gpus * 4, 8), seq_len=1024)
    print(best.table(), "\n")
    print(comparison_table(best, baselines(profile, cluster, global_batch=max(gpus * 4, 8), seq_len=1024)), "\n")
    print(best.summary(), "\n")

    print(f"== 2. A small GPT trained here: {processes} CPU processes, {steps} steps on standard-library text ==\n")
    local = nbtrain.Cluster.detect(calibrate=True)
    if local.num_devices != processes:
        local = local.replace(num_devices=processes, devices_per_node=processes)
    torch.manual_seed(0)
    model = nbtrain.GPT(DEMO_MODEL)
    small = nbtrain.profile(model, batch_size=1, seq_len=seq, dtype="fp32")
    # the executor does not run the CPU update offload yet: plan without it
    local_plan = nbtrain.plan(small, local, global_batch=batch, seq_len=seq,
                              options=SearchOptions(offload_levels=(0.0,)))
    print(local_plan.summary(label="plan for this machine"), "\n")
    result = nbtrain.fit(model, stdlib_batches(batch, seq, count=steps), plan=local_plan, steps=steps,
                         num_processes=processes, lr=3e-3, cluster=local)
    print(result)
