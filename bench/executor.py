"""The executor's speed: nbtrain against plain DDP on the same work, and the cost model against measured steps.

    NBTRAIN_NONINTERACTIVE=1 python bench/executor.py        # ~3 min on 2 cores; record it in bench/RESULTS.md

1. **Overhead.** One small GPT (untied head, fp32, AdamW), one list of global batches, 2 processes forked by
   ``nbtrain.launch`` in both cases: ``nbtrain.fit(plan="dp_replicate=2")`` and ``plan="dp_shard=2"`` (FSDP2),
   against a function under ``nbtrain.launch`` that wraps the model in ``DistributedDataParallel``, takes its half
   of each global batch and times the same step as nbtrain's ``Trainer``: forward, ``lm_loss``, backward, AdamW
   step, zero_grad, and an all-reduce of the loss. Clipping is off on both sides (it is its own row: nbtrain
   clips by the norm over every mesh, DDP with ``clip_grad_norm_``). A third column runs the same FSDP2 wrapping
   (``nbtrain.run.parallelize``) under the DDP loop, which separates FSDP2's own cost from the Trainer's.
   Each variant runs ``ROUNDS`` times, interleaved, so a slow minute of the machine hits all of them.
2. **Cost model.** Each plan runs through ``nbtrain.fit(..., cluster=...)`` with a cluster measured on this
   machine (``Cluster.detect(calibrate=True, allreduce=True)``: one-thread matmul, copy and AdamW rates, gloo
   all-reduce bandwidth). The cost model was written for GPUs; nothing is tuned to make the CPU numbers agree.

Step times are medians over the steps after ``WARMUP`` (the first steps pay FSDP2's lazy initialisation and the
first gloo connections). Every worker runs one intra-op thread (``nbtrain.launch`` sets it), so 2 processes use
the 2 cores and 4 processes share them.
"""

from __future__ import annotations

import copy
import os
import platform
import statistics
import time

os.environ.setdefault("NBTRAIN_NONINTERACTIVE", "1")

import torch  # noqa: E402

import nbtrain  # noqa: E402
from nbtrain.models.gpt import GPT, GPTConfig  # noqa: E402
from nbtrain.profiler.hardware import Cluster  # noqa: E402
from nbtrain.profiler.model import lm_loss  # noqa: E402
from nbtrain.table import Table  # noqa: E402
from nbtrain.units import format_count, format_seconds  # noqa: E402

# ~6 M parameters: a step of 8 × 128 tokens takes ~100 ms per process on one core. Untied, so tp and pp run too.
CONFIG = GPTConfig(vocab_size=2048, block_size=256, n_layer=4, n_head=4, n_embd=192, tie_embeddings=False)
BATCH, SEQ = 8, 128
STEPS, WARMUP, ROUNDS = 14, 4, 2
LR = 3e-4

PLANS = [  # (plan, processes)
    ("dp_replicate=2", 2),
    ("dp_shard=2", 2),
    ("dp_shard=2 ac", 2),
    ("tp=2", 2),
    ("pp=2 mb=2", 2),
    (f"0: dp_shard=2; 1-{CONFIG.n_layer}: tp=2; {CONFIG.n_layer + 1}: dp_shard=2", 2),
    ("dp_shard=2 tp=2", 4),
]


def make_batches(n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    ids = [torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ), generator=g) for _ in range(n)]
    return [(x, torch.roll(x, -1, dims=1)) for x in ids]


def median_after_warmup(seconds: list[float]) -> float:
    return statistics.median(seconds[WARMUP:])


def _bare_loop(model, batches, steps: int, fsdp_plan: str | None, clip: bool) -> list[float]:
    """Runs in each of 2 workers: DDP (``fsdp_plan=None``) or nbtrain's FSDP2 wrapping, under the same plain loop."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    if fsdp_plan is None:
        net = DistributedDataParallel(model)
    else:
        from nbtrain.planner.strategy import Plan
        from nbtrain.run.mesh import PlanMeshes
        from nbtrain.run.parallelize import parallelize

        plan = Plan.parse(fsdp_plan, num_devices=world, num_layers=CONFIG.n_layer + 2, global_batch=BATCH,
                          seq_len=SEQ)
        net = parallelize(model, plan, PlanMeshes(plan))
    optimizer = torch.optim.AdamW(net.parameters(), lr=LR)  # as nbtrain.fit builds it
    seconds = []
    for step in range(steps):
        ids, targets = batches[step % len(batches)]
        started = time.perf_counter()
        x, y = ids.chunk(world)[rank], targets.chunk(world)[rank]
        loss = lm_loss(net(x), y)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)  # the Trainer's loss average: the same collective on both sides
        seconds.append(time.perf_counter() - started)
    return seconds


def run_bare(model, batches, fsdp_plan: str | None = None, clip: bool = False) -> float:
    seconds = nbtrain.launch(_bare_loop, copy.deepcopy(model), batches, STEPS, fsdp_plan, clip, num_processes=2)
    return median_after_warmup(seconds)


def run_fit(model, batches, plan: str, processes: int = 2, clip: bool = False, cluster=None):
    result = nbtrain.fit(copy.deepcopy(model), batches, plan=plan, steps=STEPS, num_processes=processes, lr=LR,
                         clip_norm=1.0 if clip else None, cluster=cluster, progress=False)
    return median_after_warmup([r.seconds for r in result.records]), result


def overhead_table(model, batches) -> Table:
    variants = {  # name → () -> median step seconds
        "ddp": lambda: run_bare(model, batches),
        "ddp clip": lambda: run_bare(model, batches, clip=True),
        "fsdp2 loop dp_replicate=2": lambda: run_bare(model, batches, "dp_replicate=2"),
        "fsdp2 loop dp_shard=2": lambda: run_bare(model, batches, "dp_shard=2"),
        "fit dp_replicate=2": lambda: run_fit(model, batches, "dp_replicate=2")[0],
        "fit dp_shard=2": lambda: run_fit(model, batches, "dp_shard=2")[0],
        "fit dp_replicate=2 clip": lambda: run_fit(model, batches, "dp_replicate=2", clip=True)[0],
    }
    runs: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(ROUNDS):
        for name, fn in variants.items():
            runs[name].append(fn())
    best = {name: statistics.median(v) for name, v in runs.items()}

    def spread(name: str) -> str:
        return " / ".join(format_seconds(t) for t in runs[name])

    t = Table(["nbtrain", "step", "runs", "same wrapping, bare loop", "plain DDP", "nbtrain / DDP"],
              align="lrrrrr")
    t.title = (f"nbtrain vs DistributedDataParallel, 2 processes, {format_count(model.num_params())} params, "
               f"{BATCH} × {SEQ} = {BATCH * SEQ} tokens/step, fp32, AdamW; median step after {WARMUP} warm-up, "
               f"median of {ROUNDS} runs")
    for plan, ddp in (("dp_replicate=2", "ddp"), ("dp_shard=2", "ddp")):
        t.add(f"fit {plan}", format_seconds(best[f"fit {plan}"]), spread(f"fit {plan}"),
              format_seconds(best[f"fsdp2 loop {plan}"]), format_seconds(best[ddp]),
              f"{best[f'fit {plan}'] / best[ddp]:.3f}")
    t.add("fit dp_replicate=2, clip_norm=1", format_seconds(best["fit dp_replicate=2 clip"]),
          spread("fit dp_replicate=2 clip"), "", format_seconds(best["ddp clip"]),
          f"{best['fit dp_replicate=2 clip'] / best['ddp clip']:.3f}")
    t.footer.append(f"DDP runs: {spread('ddp')} (no clip), {spread('ddp clip')} (clip_grad_norm_); "
                    f"bare FSDP2 dp_replicate=2: {spread('fsdp2 loop dp_replicate=2')}, "
                    f"dp_shard=2: {spread('fsdp2 loop dp_shard=2')}")
    return t


def clusters() -> dict[int, Cluster]:
    detected = Cluster.detect(calibrate=True, allreduce=True)
    # 4 workers on 2 cores: each gets half a core's time for compute and copies; the node's AdamW rate and the
    # loopback all-reduce bandwidth stay as measured.
    four = Cluster.from_catalog("cpu", num_devices=4, peak_flops=detected.peak_flops / 2, flops_efficiency=1.0,
                                host_to_device_bandwidth=detected.host_to_device_bandwidth / 2,
                                cpu_optimizer_rate=detected.cpu_optimizer_rate,
                                intra_node_bandwidth=detected.intra_node_bandwidth, source="calibrated")
    return {2: detected, 4: four}


def prediction_table(model, batches, by_processes: dict[int, Cluster]) -> Table:
    t = Table(["plan", "processes", "predicted", "measured", "measured / predicted"], align="lrrrr")
    t.title = (f"cost model vs measured step, {format_count(model.num_params())} params, {BATCH} × {SEQ} tokens, "
               f"fp32, clip_norm=1 (fit's default)")
    for plan, processes in PLANS:
        measured, result = run_fit(model, batches, plan, processes, clip=True, cluster=by_processes[processes])
        t.add(plan, processes, format_seconds(result.predicted_step_s), format_seconds(measured),
              f"{measured / result.predicted_step_s:.2f}")
    for n, c in by_processes.items():
        t.footer.append(f"{n} processes: {c.summary()} · AdamW {c.cpu_optimizer_rate / 1e6:.0f} M params/s per node"
                        + (" (2 cores shared: per-device compute and copy halved)" if n > os.cpu_count() else ""))
    return t


def main() -> None:
    started = time.perf_counter()
    print(f"nbtrain executor benchmark — {platform.platform()}, {platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}\n")
    torch.manual_seed(0)
    model = GPT(CONFIG)
    batches = make_batches()
    print(overhead_table(model, batches), "\n", flush=True)
    print(prediction_table(model, batches, clusters()))
    print(f"\ntotal {format_seconds(time.perf_counter() - started)}")


if __name__ == "__main__":
    main()
