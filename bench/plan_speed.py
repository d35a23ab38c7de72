"""Search time of the planner on the settings the public Galvatron search engine was measured on.

    python bench/plan_speed.py          # prints a table; record it in bench/RESULTS.md

llama-7b on 8 × H100 (global batch 64, length 2048) at 16/24/36/48 GiB per device — Galvatron's engine takes
about 235 s per budget on this machine (REFERENCE.md) — and llama-70b on 64 × H100 (8 nodes). The profile is taken
once per model and not counted; each search is timed alone, best of three.
"""

from __future__ import annotations

import os
import platform
import time

import nbtrain
from nbtrain.table import Table
from nbtrain.units import format_bytes, format_seconds

CASES = [("llama-7b", 8, budget, 64, 2048) for budget in (16, 24, 36, 48)] + [("llama-70b", 64, 80, 64, 2048)]


def main() -> None:
    table = Table(["model", "devices", "budget", "batch × seq", "search", "plan", "predicted", "memory"],
                  align="lrrrrlrr")
    table.title = f"nbtrain.plan search time ({platform.machine()}, {os.cpu_count()} cores)"
    profiles = {}
    for model, devices, budget, batch, seq in CASES:
        prof = profiles.setdefault(model, nbtrain.profile(model, batch_size=1, seq_len=seq))
        cluster = nbtrain.Cluster.from_catalog("H100", num_devices=devices, device_memory=f"{budget}GiB")
        times = []
        for _ in range(3):
            started = time.perf_counter()
            best = nbtrain.plan(prof, cluster, global_batch=batch, seq_len=seq)
            times.append(time.perf_counter() - started)
        table.add(model, devices, f"{budget} GiB", f"{batch} × {seq}", format_seconds(min(times)), str(best),
                  format_seconds(best.predicted.step_time_s), format_bytes(best.predicted.memory_bytes))
    print(table)


if __name__ == "__main__":
    main()
