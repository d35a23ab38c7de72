"""CPU update offload under tensor and pipeline parallelism, 2 processes: no offload, ZeRO-Offload's schedule and
nbtrain's overlapped one (CoTrain), each measured beside the planner's prediction of the same plan.

    python bench/offload_parallel.py          # ~3-5 min on 2 cores; the table on stdout

Each row runs ``fit``'s own worker (:func:`~nbtrain.run.fit_worker.fit_worker`: the plan applied by the executor,
the Trainer's step, ``OffloadedAdamW`` per rank) on 2 forked gloo processes, for one GPT (fp32, untied head, fused
AdamW everywhere) and a global batch chosen so that a rank's CPU update takes about as long as its backward
(``upd/bwd``: the summed CPU updates over the summed layer backwards, from rank 0's trace of the ZeRO-Offload run,
where nothing runs beside them). Schedules (``RunSettings.offload_schedule``):

- ``no offload``: the plan as typed, the whole update on the device (fused AdamW) after backward;
- ``ZeRO-Offload``: ``offload=1``, every update queued once backward is done, landed in ``step()``;
- ``overlap``: ``offload=1``, each layer's update queued as its last gradient arrives during backward (in a
  pipeline: the stage's last micro-batch backward), landed when the next forward reaches the layer.

``predicted`` is :func:`~nbtrain.run.predict_here.predict_here` of the same plan (each layer timed here at the
plan's micro-batch, ``Cluster.detect()``'s calibrated CPU AdamW rate and links), with ``offload_overlap=False``
for ZeRO-Offload's schedule. ``zero/ovl`` is ZeRO-Offload's step over the overlapped one. Step times are medians
over ``STEPS`` steps after ``WARMUP``; each row runs ``ROUNDS`` times, interleaved, and keeps its fastest.

What to expect on a 2-core machine: each process has one core for its backward and its CPU update. Under TP both
ranks compute through the whole backward, so no core is free for the overlap (the cost model says so: its
overlap needs a core the workers leave free); in a pipeline the last stage finishes its backward while the first
is still in its own, and its updates run on its idle core.
"""

from __future__ import annotations

import os
import statistics

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP: no spinning threads

import torch  # noqa: E402

import nbtrain  # noqa: E402
from nbtrain.models import GPT, GPTConfig  # noqa: E402
from nbtrain.planner.cost import CostOptions  # noqa: E402
from nbtrain.profiler.model import lm_loss  # noqa: E402
from nbtrain.run.fit import plan_for  # noqa: E402
from nbtrain.run.fit_worker import RunSettings, fit_worker  # noqa: E402
from nbtrain.run.launch.workers import launch  # noqa: E402
from nbtrain.run.predict_here import predict_here  # noqa: E402

CONFIG = GPTConfig(vocab_size=8192, block_size=512, n_layer=8, n_head=8, n_embd=512, tie_embeddings=False)
LAYOUTS = ("tp=2", "pp=2 mb=2")
SCHEDULES = (("no offload", "", "overlap"), ("ZeRO-Offload", "offload=1", "after_backward"),
             ("overlap", "offload=1", "overlap"))
BATCH, SEQ = 2, 16  # tokens per step where a rank's CPU update is about its backward (upd/bwd in the table)
WARMUP, STEPS, ROUNDS = 2, 5, 2
PROCESSES = 2


def typed(layout: str, offload: str) -> str:
    """The layout with ``offload`` for every layer (after the pipeline part, when there is one)."""
    if not offload:
        return layout
    pipeline = [t for t in layout.split() if t.split("=")[0] in ("pp", "mb", "schedule")]
    rest = [t for t in layout.split() if t not in pipeline]
    return " ".join(pipeline + (["|"] if pipeline else []) + (rest or ["dp_replicate=1"]) + [offload])


def batches():
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ), generator=g) for _ in range(4)]
    return [(x, torch.roll(x, -1, dims=1)) for x in ids]


def measure(plan, schedule: str):
    """(median step seconds after the warm-up, rank 0's offload trace) of ``plan`` under fit's worker."""
    data = batches()
    run = RunSettings(steps=WARMUP + STEPS, lr=1e-4, clip_norm=None, loss_fn=lm_loss, seed=0, progress=False,
                      precision="fp32", lr_schedule=None, save_dir=None, gather=False, offload_schedule=schedule)
    torch.manual_seed(0)
    model = GPT(CONFIG)
    records, _, trace, _ = launch(fit_worker, model, plan, lambda step: data[step % len(data)], run,
                                  num_processes=PROCESSES, timeout=900)
    return statistics.median(r.seconds for r in records[WARMUP:]), trace


def update_over_backward(trace) -> float:
    """Summed CPU updates over summed layer backwards in a trace (``(row, label, start, end)`` events)."""
    cpu = sum(end - start for row, label, start, end in trace if row == "cpu" and label.startswith("update"))
    bwd = sum(end - start for row, label, start, end in trace if row == "device" and label.startswith("backward"))
    return cpu / bwd if bwd else float("nan")


def main() -> None:
    torch.set_num_threads(1)
    cluster = nbtrain.Cluster.detect()
    model = GPT(CONFIG)
    rows = []
    for layout in LAYOUTS:
        plans = {name: plan_for(model, typed(layout, offload), PROCESSES, global_batch=BATCH, seq_len=SEQ)
                 for name, offload, _ in SCHEDULES}
        best: dict[str, float] = {}
        traces: dict = {}
        for _ in range(ROUNDS):
            for name, _, schedule in SCHEDULES:
                seconds, trace = measure(plans[name], schedule)
                best[name] = min(best.get(name, float("inf")), seconds)
                traces.setdefault(name, trace)
        ratio = update_over_backward(traces["ZeRO-Offload"]) if traces["ZeRO-Offload"] else float("nan")
        for name, _, schedule in SCHEDULES:
            options = CostOptions(offload_overlap=schedule == "overlap")
            predicted = predict_here(model, plans[name], cluster, num_processes=PROCESSES, seq_len=SEQ,
                                     options=options).step_time_s
            rows.append((layout, name, str(plans[name]), best[name], predicted, ratio,
                         best["ZeRO-Offload"] / best["overlap"]))
    print(f"{'layout':<10} {'schedule':<13} {'plan':<34} {'measured':>9} {'predicted':>9} {'pred/meas':>9} "
          f"{'upd/bwd':>7} {'zero/ovl':>8}")
    for layout, name, text, measured, predicted, ratio, zero_over_overlap in rows:
        print(f"{layout:<10} {name:<13} {text:<34} {measured * 1e3:>7.1f}ms {predicted * 1e3:>7.1f}ms "
              f"{predicted / measured:>9.2f} {ratio:>7.2f} {zero_over_overlap:>8.2f}")


if __name__ == "__main__":
    main()
