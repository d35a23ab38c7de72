"""Profile time and peak memory of every preset, each in a fresh process.

    python bench/profile_presets.py            # prints a table; record it in bench/RESULTS.md

Each row runs ``nbtrain profile PRESET --json`` in its own process, so the wall time includes importing torch
and the peak resident memory is that process's own (``os.wait4``). ``trace`` is the profiler's own time.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time

from nbtrain.table import Table
from nbtrain.units import format_bytes, format_count, format_flops

SHAPES = {"gpt2": (8, 1024), "gpt2-medium": (8, 1024), "gpt2-large": (8, 1024), "gpt2-xl": (8, 1024),
          "llama-7b": (1, 4096), "llama-13b": (1, 4096), "llama-70b": (1, 4096)}


def run(preset: str, batch: int, seq: int) -> tuple[dict, float, int]:
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "nbtrain.cli", "profile", preset, "--batch", str(batch),
                             "--seq", str(seq), "--json"], stdout=subprocess.PIPE, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if status:
        raise SystemExit(f"profiling {preset} failed (status {status})")
    return json.loads(out), time.perf_counter() - started, usage.ru_maxrss * 1024


def main() -> None:
    table = Table(["preset", "params", "batch × seq", "layers", "FLOPs/step", "activations", "wall", "trace",
                   "peak RSS"], align="lrrrrrrrr")
    table.title = f"nbtrain profile, one fresh process each ({platform.processor() or platform.machine()}, " \
                  f"{os.cpu_count()} cores)"
    for preset, (batch, seq) in SHAPES.items():
        data, wall, peak = run(preset, batch, seq)
        table.add(preset, format_count(data["params"]), f"{batch} × {seq}", len(data["layers"]),
                  format_flops(data["flops_per_step"]), format_bytes(data["activation_bytes"]), f"{wall:.1f} s",
                  f"{data['profile_seconds']:.1f} s", format_bytes(peak))
    print(table)


if __name__ == "__main__":
    main()
