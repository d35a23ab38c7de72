"""Planning time as a person waits for it, now and at the commit before (issue 46).

    python bench/plan_speed.py                     # now beside 9ed82b0, the commit before issue 46 (~12 min)
    python bench/plan_speed.py --against none      # now only (~2 min)
    python bench/plan_speed.py --against HEAD~3    # beside any commit (checked out in a temporary worktree)

Every side runs in its own fresh interpreter (``python <this file> --measure``, nbtrain imported from that side's
tree), on the same machine one after the other, so the two columns are comparable; the machine is shared, so run
it twice and look at both. What is measured:

1. **The plan explorer** (``PlanExplorer``) on the example people see: Hugging Face GPT-2 planned for 8 × H100,
   global batch 32 × 1024 (the ``%%autoparallel`` cell's plan, not timed), then one change after another, each
   timed from the control set to the explorer's plan shown (its replan, baselines and HTML); the typed boxes'
   pause for typing (0.6 s) is left out (``debounce_s=0``).
2. **``nbtrain plan`` on the command line**, wall time and peak memory of the whole process, profile included:
   GPT-2 on 4 × H100 at 3 GiB, LLaMA-70B on 64 H100s (8 a node, 80 GiB, batch 512 × 4096) and on 1,024
   (batch 2048 × 4096). "first" runs with an empty ``NBTRAIN_CACHE_DIR`` (each case its own), "again" right
   after it (a preset's profile is kept from the first since issue 46).
3. **``nbtrain.plan`` in the process**, the profile taken beforehand and not counted: Mixtral-8x7B's shape with
   expert parallelism on 64 H100s (batch 128 × 4096), LLaMA-7B on 8 H100s at 16/24/36/48 GiB (batch 64 × 2048) and
   LLaMA-70B on 64 (batch 64 × 2048), the cases this benchmark had before.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BEFORE = "9ed82b0"
"""The commit before issue 46's speed-up."""
ROOT = Path(__file__).resolve().parent.parent

EXPLORER_CHANGES = [("devices", 4), ("memory", "3GiB"), ("global_batch", 64), ("seq_len", 512),
                    ("device", "A100-80GB"), ("devices", 8), ("memory", ""), ("devices_per_node", 4)]
COMMANDS = [
    ("gpt2 on 4 × H100 at 3 GiB", ["gpt2", "--gpus", "4", "--gpu", "H100", "--memory", "3GiB", "--batch", "32",
                                   "--seq", "1024"]),
    ("llama-70b on 64 H100s", ["llama-70b", "--gpus", "64", "--gpus-per-node", "8", "--memory", "80GiB", "--batch",
                               "512", "--seq", "4096"]),
    ("llama-70b on 1,024 H100s", ["llama-70b", "--gpus", "1024", "--gpu", "H100", "--batch", "2048", "--seq",
                                  "4096"]),
]
IN_PROCESS = [("mixtral-8x7b", 64, None, 128, 4096)] + \
    [("llama-7b", 8, budget, 64, 2048) for budget in (16, 24, 36, 48)] + [("llama-70b", 64, 80, 64, 2048)]


# --- one side, in its own interpreter ------------------------------------------------------------------------------

def _profile(name: str, seq: int):
    import nbtrain

    if name != "mixtral-8x7b":
        return nbtrain.profile(name, batch_size=1, seq_len=seq)
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    with torch.device("meta"):
        model = MixtralForCausalLM(MixtralConfig())
    return nbtrain.profile(model, batch_size=1, seq_len=seq, name=name)


def _explorer() -> list[dict]:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import nbtrain
    from nbtrain.notebook.widgets import PlanExplorer

    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config())
    prof = nbtrain.profile(model, batch_size=1, seq_len=1024, name="gpt2 (Hugging Face)")
    cluster = nbtrain.Cluster.from_catalog("H100", num_devices=8)
    opening = (nbtrain.plan(prof, cluster, global_batch=32, seq_len=1024),
               nbtrain.baselines(prof, cluster, global_batch=32, seq_len=1024), cluster)
    explorer = PlanExplorer(prof, num_devices=8, device="H100", global_batch=32, seq_len=1024, opening=opening,
                            debounce_s=0)
    rows = []
    for name, value in EXPLORER_CHANGES:
        started = time.perf_counter()
        explorer.controls[name].value = value
        explorer.settle()
        rows.append({"change": f"{name} → {value or 'the device’s own'}", "seconds": time.perf_counter() - started,
                     "plan": explorer.plan.summary() if explorer.plan is not None else f"error: {explorer.error}"})
    return rows


PEAK = ("import atexit, resource, runpy, sys; out = sys.argv.pop(1); "
        "atexit.register(lambda: open(out, 'w').write(str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))); "
        "runpy.run_module('nbtrain.cli', run_name='__main__')")
"""``python -m nbtrain.cli ...`` that writes its own peak resident memory (KiB, Linux) to the file named first."""


def _commands(root: Path) -> list[dict]:
    rows = []
    for label, args in COMMANDS:
        with tempfile.TemporaryDirectory(prefix="nbtrain-bench-cache-") as cache:  # each case's first profiles
            env = {**os.environ, "PYTHONPATH": str(root), "NBTRAIN_CACHE_DIR": cache, "NBTRAIN_NONINTERACTIVE": "1"}
            peak = Path(cache) / "peak"
            for when in ("first", "again"):
                started = time.perf_counter()
                done = subprocess.run([sys.executable, "-c", PEAK, str(peak), "plan", *args], cwd=root, env=env,
                                      capture_output=True, text=True)
                seconds = time.perf_counter() - started
                last = (done.stdout.strip().splitlines() or [done.stderr.strip()])[-1]
                rows.append({"case": f"nbtrain plan {label} ({when})", "seconds": seconds,
                             "peak_gb": int(peak.read_text()) * 1024 / 1e9 if peak.exists() else None,
                             "plan": last[:100]})
                peak.unlink(missing_ok=True)
    return rows


def _in_process() -> list[dict]:
    import nbtrain
    from nbtrain.units import format_bytes

    profiles, rows = {}, []
    for name, devices, budget, batch, seq in IN_PROCESS:
        prof = profiles.get((name, seq)) or profiles.setdefault((name, seq), _profile(name, seq))
        memory = {"device_memory": f"{budget}GiB"} if budget else {}
        cluster = nbtrain.Cluster.from_catalog("H100", num_devices=devices, **memory)
        started = time.perf_counter()
        best = nbtrain.plan(prof, cluster, global_batch=batch, seq_len=seq)
        rows.append({"case": f"{name} on {devices}" + (f" at {budget} GiB" if budget else "") + f", {batch} × {seq}",
                     "seconds": time.perf_counter() - started,
                     "plan": f"{best.predicted.step_time_s:.4g} s/step, {format_bytes(best.predicted.memory_bytes)}"})
    return rows


def measure(root: Path) -> dict:
    """This side's numbers: the explorer, the commands and the in-process plans. The commands run first, while
    this process is small: Linux counts the parent's resident memory at the fork in a child's peak (execve keeps
    the old image's high-water mark), and torch would put 0.4 GB there."""
    commands = _commands(root)
    return {"explorer": _explorer(), "commands": commands, "in_process": _in_process()}


def run_side(root: Path) -> dict:
    """:func:`measure` in a fresh interpreter with nbtrain imported from ``root``."""
    with tempfile.TemporaryDirectory(prefix="nbtrain-bench-") as folder:
        script, out = Path(folder) / "plan_speed.py", Path(folder) / "out.json"
        shutil.copy(__file__, script)
        env = {**os.environ, "PYTHONPATH": str(root), "NBTRAIN_NONINTERACTIVE": "1"}
        subprocess.run([sys.executable, str(script), "--measure", str(root), str(out)], cwd=root, env=env, check=True)
        return json.loads(out.read_text())


# --- both sides, side by side --------------------------------------------------------------------------------------

def _worktree(rev: str) -> Path:
    folder = Path(tempfile.mkdtemp(prefix="nbtrain-before-"))
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(folder), rev], check=True,
                   capture_output=True)
    return folder


def _seconds(x: float | None) -> str:
    return "" if x is None else f"{x:.2f} s" if x >= 0.1 else f"{x * 1000:.0f} ms"


def table(now: dict, before: dict | None, rev: str) -> str:
    from nbtrain.table import Table

    t = Table(["", f"at {rev}" if before else "", "now", "now / before", "peak memory (before → now)", "now shows"],
              align="lrrrrl")
    t.title = f"planning time ({platform.machine()}, {os.cpu_count()} cores, {platform.python_version()})"
    sections = [("explorer", "change", "explorer: GPT-2, 8 × H100, 32 × 1024; "),
                ("commands", "case", ""), ("in_process", "case", "nbtrain.plan: ")]
    for key, name, prefix in sections:
        for i, row in enumerate(now[key]):
            old = before[key][i] if before else None
            ratio = f"{row['seconds'] / old['seconds']:.2f}" if old else ""
            peak = ""
            if row.get("peak_gb") is not None:
                peak = (f"{old['peak_gb']:.2f} → " if old and old.get("peak_gb") else "") + f"{row['peak_gb']:.2f} GB"
            t.add(prefix + row[name], _seconds(old["seconds"]) if old else "", _seconds(row["seconds"]), ratio, peak,
                  row["plan"])
    return str(t)


def main() -> None:
    if sys.argv[1:2] == ["--measure"]:
        Path(sys.argv[3]).write_text(json.dumps(measure(Path(sys.argv[2]))))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default=BEFORE, help=f"a commit to measure beside now (default {BEFORE}, the "
                                                            "commit before issue 46), or 'none'")
    args = parser.parse_args()
    now = run_side(ROOT)
    before = None
    if args.against != "none":
        tree = _worktree(args.against)
        try:
            before = run_side(tree)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], capture_output=True)
    sys.path.insert(0, str(ROOT))
    print(table(now, before, args.against))


if __name__ == "__main__":
    main()
