"""What a checkpoint costs: save time beside step time, and size on disk, per plan; and a resume under another plan.

    python bench/checkpoint.py          # ~1 min on 2 cores; a table on stdout

A GPT of ~25 M parameters (6 blocks, 512 wide, vocabulary 8192), trained 4 steps in 2 gloo processes with a checkpoint
after every step (weights and AdamW state: 3× the weights in fp32, plus ``nbtrain.json``), under DDP, FSDP2, tensor
parallelism and FSDP2 with the CPU-offloaded optimizer. Then the FSDP2 run is resumed under TP for 2 more steps: the
launch's extra time over a plain 2-step run is what loading costs.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

import nbtrain

PLANS = ["dp_replicate=2", "dp_shard=2", "tp=2", "dp_shard=2 offload=1"]
CONFIG = nbtrain.GPTConfig(vocab_size=8192, block_size=128, n_layer=6, n_head=8, n_embd=512, tie_embeddings=False)


def batches(n: int = 6):
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, CONFIG.vocab_size, (8, 128), generator=g) for _ in range(n)]
    return [(x, torch.roll(x, -1, 1)) for x in ids]


def model():
    torch.manual_seed(0)
    return nbtrain.GPT(CONFIG)


def size_mib(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 2**20


def main() -> None:
    data = batches()
    params = sum(p.numel() for p in model().parameters())
    print(f"GPT {params / 1e6:.1f} M parameters, 2 processes, a checkpoint after every step\n")
    print(f"{'plan':<22} {'step (median)':>13} {'save (median)':>13} {'save/step':>9} {'on disk':>9}")
    with tempfile.TemporaryDirectory() as root:
        for plan in PLANS:
            folder = Path(root) / plan.replace(" ", "_")
            result = nbtrain.fit(model(), data, plan=plan, steps=4, num_processes=2, progress=False,
                                 checkpoint_dir=folder, checkpoint_every=1, timeout=600)
            saves = [r.checkpoint_s for r in result.records[1:]]
            save = statistics.median(saves)
            print(f"{plan:<22} {result.measured_step_s * 1e3:>10.0f} ms {save * 1e3:>10.0f} ms "
                  f"{save / result.measured_step_s:>8.2f}× {size_mib(Path(result.checkpoint)):>6.0f} MiB")
        start = time.perf_counter()
        nbtrain.fit(model(), data, plan="tp=2", steps=2, num_processes=2, progress=False, timeout=600)
        plain = time.perf_counter() - start
        start = time.perf_counter()
        resumed = nbtrain.fit(model(), data, plan="tp=2", steps=6, num_processes=2, progress=False, timeout=600,
                              checkpoint_dir=Path(root) / "dp_shard=2", resume=True)
        again = time.perf_counter() - start - sum(r.checkpoint_s or 0 for r in resumed.records[4:])
    print(f"\nresume of the dp_shard=2 checkpoint under tp=2, 2 more steps: {again:.2f} s for the whole call, "
          f"{plain:.2f} s for a fresh 2-step run: loading ~{again - plain:.2f} s")


if __name__ == "__main__":
    main()
