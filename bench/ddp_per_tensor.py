"""What DistributedDataParallel adds to a backward here for the same gradient bytes held in one tensor or in many
(issue 45's open 2-process gap: the link benchmark measures DDP on a few Linear layers, a model has dozens of small
tensors).

    PYTHONPATH=. python bench/ddp_per_tensor.py          # ~10 s on 2 cores; 3 rounds of 2 gloo processes

Per round, in the same two workers (one thread each): a forward and backward of 64 rows through Linear layers without
bias, 560 KB of fp32 weights as one 374 × 374 layer or as 30 layers of 68 × 68, plain and under DDP (one bucket: the
bytes are below its 25 MB), the median of 50 steps after 10. The difference is what DDP adds; the difference of the
differences, over 29 tensors more, is what each tensor adds (its gradient hook and its copy into the bucket).
Its rounds disagree by more than that difference (0.054, -0.011, 0.038 ms in one run): measured as the trainer steps,
5 rounds in alternation, a tensor adds at most ~0.01 ms (bench/RESULTS.md, "DDP per tensor, measured as the trainer
steps: small").
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import nbtrain  # noqa: E402
from nbtrain.table import Table  # noqa: E402

SHAPES = {1: 374, 30: 68}
"""Tensors → the width of each square layer: 560 KB of weights either way (559.5 and 554.9 KB)."""


def _step_ms(model, x) -> float:
    import torch.distributed as dist

    times = []
    for _ in range(60):
        dist.barrier()
        started = time.perf_counter()
        model(x).square().sum().backward()
        times.append(time.perf_counter() - started)
    return statistics.median(times[10:]) * 1e3


def _round() -> dict[int, tuple[float, float]]:
    """Inside a worker: tensors → (plain ms, DDP ms)."""
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    found = {}
    for tensors, width in SHAPES.items():
        torch.manual_seed(0)
        layers = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(tensors)])
        x = torch.randn(64, width)
        found[tensors] = (_step_ms(layers, x), _step_ms(DistributedDataParallel(layers), x))
    return found


def main(rounds: int = 3) -> None:
    table = Table(["round", "tensors", "grad bytes", "plain", "DDP", "DDP adds", "per extra tensor"],
                  title="What DDP adds to a backward for 560 KB of gradients in 1 or 30 tensors (ms; 2 gloo "
                        "processes, rank 0's medians)")
    for r in range(rounds):
        found = nbtrain.launch(_round, num_processes=2)
        added = {n: ddp - plain for n, (plain, ddp) in found.items()}
        for n, (plain, ddp) in found.items():
            extra = (added[30] - added[1]) / 29 if n == 30 else None
            table.add(r + 1, n, f"{n * SHAPES[n] ** 2 * 4 / 1e3:.1f} KB", f"{plain:.2f}", f"{ddp:.2f}",
                      f"{added[n]:.2f}", f"{extra:.3f}" if extra is not None else "")
    print(table)


if __name__ == "__main__":
    main()
