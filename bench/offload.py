"""CPU update offload on one machine: no offload, ZeRO-Offload's schedule, FSDP2's CPUOffloadPolicy, and nbtrain's
overlap with and without split.

    python bench/offload.py          # ~2-4 min on 2 cores; the table on stdout

One process, as issue 6 describes for a CPU-only machine: the "device" (forward, backward, the device's share of
the update) is the main thread on one core, the CPU update is OffloadedAdamW's worker thread on the other, one
intra-op thread each. One GPT (fp32, untied head, fused AdamW everywhere), three tokens-per-step settings chosen so
that the CPU update of the whole model takes about 0.5x, 1x and 2x the backward (measured and printed: ``upd/bwd``).

Schedules, all but FSDP2's ``nbtrain.run.offload.optimizer.OffloadedAdamW``:

- ``no offload``: offload 0, the whole update on the device after backward (plain fused AdamW);
- ``ZeRO-Offload``: offload 1, ``schedule="after_backward"``, ``land_at="step"``: the CPU update starts once
  backward has finished, and the next step starts once it is done;
- ``FSDP2-CPU``: ``fully_shard(..., offload_policy=CPUOffloadPolicy())`` per layer, in a process group of one, with
  ``torch.optim.AdamW(fused=True)`` over its CPU-resident sharded parameters, stepped after backward: FSDP2's own
  ZeRO-Offload (on a CPU-only machine its copies between "device" and host are host copies, and the gather of a
  world of one a copy too: what FSDP2 adds to the schedule is measured, not a PCIe transfer);
- ``overlap``: offload 1, ``schedule="overlap"`` (CoTrain, coarse grain): each layer's update starts when
  backward has produced its gradients and lands when the next forward reaches the layer;
- ``overlap+split``: CoTrain's fine grain: the first layers' updates stay on the device. The split comes from
  ``balanced_offload``: with each layer's forward, backward and CPU update time measured from the ``overlap``
  run's trace (and the device's update rate taken equal to the CPU's, as both are one core here), it simulates
  steady-state steps for each candidate (layers 0..k-1 on the device, layer k cut by a fraction in tenths, the
  rest on the CPU) and keeps the one with the shortest step, so neither side waits for the other longer than a
  tenth of a layer.

``floor`` is max(forward + backward, CPU update of the whole model) (REFERENCE.md, physical limits; no PCIe
here), which a GPU can approach: its share of the update is nearly free there, so the split can move layers to it
until the CPU's queue fits under the step. Here the "device" is a core like the CPU's and the CPU idles from its
last update to the next step's first gradient (the next forward of the offloaded layers, the head's backward):
``sim`` is what the chosen split can reach on this machine, :func:`~nbtrain.planner.offload_split.step_period` of
each layer's forward, backward and CPU update measured with nothing beside them. Both take forward + backward
from the ``no offload`` or ``ZeRO-Offload`` run (nothing runs beside them there), whichever was faster, and the
CPU update from the ``ZeRO-Offload`` run.
``zero/ovl`` is ZeRO-Offload's step over the best overlapped one; ``best/floor`` the best overlapped step over the
floor. Step times are medians over ``STEPS`` steps after ``WARMUP``; each schedule runs ``ROUNDS`` times,
interleaved, and keeps its fastest round (the machine may be shared: ``busy`` is the number of cores other
processes kept busy meanwhile, from /proc/stat).

A second table sets the planner's predicted step beside each measured one: ``CostModel.estimate`` of the same
plan (offload 0, 1 with ``offload_overlap=False``, 1, and the split) for the same tokens, from a profile measured
here (``nbtrain.profile(..., measure="cpu")``, so compute is each layer's measured time, as Galvatron-BMW
profiles it) and ``Cluster.detect()`` as one device (its calibrated CPU AdamW rate and copy bandwidth). The planner
models no FSDP2 CPUOffloadPolicy.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP: no spinning threads

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard  # noqa: E402

import nbtrain  # noqa: E402
from nbtrain.models import GPT, GPTConfig  # noqa: E402
from nbtrain.models.description import layer_slots, slot_module  # noqa: E402
from nbtrain.planner.cost import CostModel, CostOptions  # noqa: E402
from nbtrain.planner.offload_split import balanced_offload, step_period  # noqa: E402
from nbtrain.planner.plan import Plan  # noqa: E402
from nbtrain.planner.strategy import Strategy  # noqa: E402
from nbtrain.profiler.model import lm_loss  # noqa: E402
from nbtrain.run.offload.optimizer import OffloadedAdamW  # noqa: E402

CONFIG = GPTConfig(vocab_size=8192, block_size=1024, n_layer=8, n_head=8, n_embd=512, tie_embeddings=False)
RATIOS = (0.5, 1.0, 2.0)
WARMUP, STEPS, ROUNDS = 2, 6, 3
SEQ = 128


def busy_cores():
    """(jiffies all processes kept the cores busy, jiffies of this process) so far."""
    with open("/proc/stat") as f:
        cpu = [int(x) for x in f.readline().split()[1:]]
    with open("/proc/self/stat") as f:
        mine = f.read().rsplit(")", 1)[1].split()
    return sum(cpu) - cpu[3] - cpu[4], int(mine[11]) + int(mine[12])


def shape(tokens: int) -> tuple[int, int]:
    """(batch, seq) with about ``tokens`` tokens: rows of SEQ, or one shorter row."""
    if tokens <= SEQ:
        return 1, max(8, tokens)
    return max(1, round(tokens / SEQ)), SEQ


def fsdp2_cpu_offload(model):
    """The model under FSDP2 with CPUOffloadPolicy (each layer a group, one root) and fused AdamW over it."""
    policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    for slots in layer_slots(model):
        fully_shard([slot_module(parent, attr) for parent, attr in slots], offload_policy=policy)
    fully_shard(model, offload_policy=policy)
    return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)


def run(model, ids, offload, schedule, steps, land_at="forward"):
    """Median step time and the medians of forward, backward (s), and the traces of the measured steps.
    ``offload`` None: ``model`` is under FSDP2's CPUOffloadPolicy, with its own optimizer ``schedule``."""
    total, forward, backward, traces = [], [], [], []
    opt = contextlib.nullcontext(schedule) if offload is None else OffloadedAdamW.from_model(
        model, offload, lr=1e-4, schedule=schedule, land_at=land_at)
    with opt as opt:
        for _ in range(WARMUP + steps):
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = lm_loss(model(ids), torch.roll(ids, -1, 1))
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            t3 = time.perf_counter()
            total.append(t3 - t0), forward.append(t1 - t0), backward.append(t2 - t1)
            traces.append(getattr(opt, "last_trace", None))  # landed at the next forward: the previous step's
    med = [statistics.median(x[WARMUP:]) for x in (total, forward, backward)]
    return med[0], med[1], med[2], traces[WARMUP + 1:]


def per_layer(traces, kind: str, n: int) -> list[float]:
    """Per layer, the median over ``traces`` of the duration of its events ``"<kind> <layer>"`` (0 if none)."""
    steps = []
    for trace in traces:
        out = [0.0] * n
        for _, label, start, end in trace:
            name, _, layer = label.partition(" ")
            if name == kind and layer.isdigit():
                out[int(layer)] += end - start
        steps.append(out)
    return [statistics.median(step[i] for step in steps) for i in range(n)]


def predicted(model, cluster, batch: int, seq: int, split: list[float]) -> dict[str, float]:
    """The planner's step time (s) of each offload schedule, from a profile measured here at this shape."""
    prof = nbtrain.profile(model, batch_size=batch, seq_len=seq, dtype="float32", measure="cpu")
    n = len(prof.layers)
    cases = {"no offload": ((0.0,) * n, True), "ZeRO-Offload": ((1.0,) * n, False), "overlap": ((1.0,) * n, True),
             "overlap+split": (tuple(split), True)}
    out = {}
    for name, (offload, overlap) in cases.items():
        cost = CostModel(prof, cluster, global_batch=batch, seq_len=seq, options=CostOptions(offload_overlap=overlap))
        plan = Plan(num_devices=1, layers=tuple(Strategy(offload=f) for f in offload), global_batch=batch)
        out[name] = cost.estimate(plan).step_time_s
    return out


SCHEDULES = {"no offload": (0.0, "overlap", "forward"), "ZeRO-Offload": (1.0, "after_backward", "step"),
             "FSDP2-CPU": (None, None, None), "overlap": (1.0, "overlap", "forward"),
             "overlap+split": ("split", "overlap", "forward")}


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # FSDP2 needs one
    torch.manual_seed(0)
    model = GPT(CONFIG)
    sharded = GPT(CONFIG)
    fsdp_opt = fsdp2_cpu_offload(sharded)
    n_params = sum(p.numel() for p in model.parameters())
    n_layers = CONFIG.n_layer + 2
    # CPU update of the whole model alone, and backward at a first guess of the tokens, to aim each ratio
    _, _, _, trace = run(model, torch.randint(0, CONFIG.vocab_size, (1, SEQ)), 1.0, "after_backward", 3, "step")
    update_s = sum(per_layer(trace, "update", n_layers))
    print(f"GPT {CONFIG.n_layer} layers x {CONFIG.n_embd}, vocab {CONFIG.vocab_size}: {n_params / 1e6:.1f}M "
          f"parameters; CPU AdamW (fused, 1 thread): {update_s * 1e3:.0f} ms = {n_params / update_s / 1e9:.2f} "
          f"G params/s; threads: main 1, worker 1; {os.cpu_count()} cores\n")
    header = (f"{'tokens':>6} {'upd/bwd':>7} {'fwd+bwd':>8} {'update':>7} {'floor':>7} {'sim':>7} {'no offload':>10} "
              f"{'ZeRO-Off':>9} {'FSDP2-CPU':>9} {'overlap':>8} {'ovl+split':>9} {'zero/ovl':>8} {'fsdp/ovl':>8} "
              f"{'best/floor':>10} {'best/sim':>8} {'busy':>5}  split")
    print(header)
    cluster = nbtrain.Cluster.detect().replace(num_devices=1, devices_per_node=1)
    predictions = []
    for ratio in RATIOS:
        tokens = SEQ
        for _ in range(2):  # aim, measure backward, aim again: backward is not quite linear in the tokens
            b, s = shape(tokens)
            ids = torch.randint(0, CONFIG.vocab_size, (b, s))
            _, _, bwd, _ = run(model, ids, 0.0, "overlap", 2)
            tokens = max(8, round(b * s * update_s / (ratio * bwd)))
        b, s = shape(tokens)
        ids = torch.randint(0, CONFIG.vocab_size, (b, s))
        best: dict[str, tuple] = {}
        split = None
        busy0 = busy_cores()
        start = time.perf_counter()
        for r in range(ROUNDS):
            order = list(SCHEDULES)  # the split needs the overlap run's trace: it runs last
            for name in order if r % 2 == 0 else order[-2::-1] + order[-1:]:
                offload, schedule, land_at = SCHEDULES[name]
                if name == "overlap+split" and split is None:
                    trace = best["overlap"][3]
                    cpu = per_layer(trace, "update", n_layers)
                    split = balanced_offload(per_layer(trace, "backward", n_layers), cpu, cpu,
                                             forward_s=per_layer(trace, "forward", n_layers))
                if name == "FSDP2-CPU":
                    result = run(sharded, ids, None, fsdp_opt, STEPS)
                else:
                    result = run(model, ids, split if offload == "split" else offload, schedule, STEPS, land_at)
                if name not in best or result[0] < best[name][0]:
                    best[name] = result
        busy1 = busy_cores()
        elapsed = time.perf_counter() - start
        other = ((busy1[0] - busy0[0]) - (busy1[1] - busy0[1])) / os.sysconf("SC_CLK_TCK") / elapsed
        fwd, bwd = min((best[k][1], best[k][2]) for k in ("no offload", "ZeRO-Offload"))
        update = sum(per_layer(best["ZeRO-Offload"][3], "update", n_layers))
        floor = max(fwd + bwd, update)
        alone = [per_layer(best["no offload"][3], kind, n_layers) for kind in ("forward", "backward")]
        cpu_alone = per_layer(best["ZeRO-Offload"][3], "update", n_layers)
        sim = step_period(*alone, cpu_alone, cpu_alone, split)
        t = {k: v[0] for k, v in best.items()}
        ovl = min(t["overlap"], t["overlap+split"])
        print(f"{b * s:>6} {update / bwd:>7.2f} {(fwd + bwd) * 1e3:>6.0f}ms {update * 1e3:>5.0f}ms "
              f"{floor * 1e3:>5.0f}ms {sim * 1e3:>5.0f}ms {t['no offload'] * 1e3:>8.0f}ms {t['ZeRO-Offload'] * 1e3:>7.0f}ms "
              f"{t['FSDP2-CPU'] * 1e3:>7.0f}ms {t['overlap'] * 1e3:>6.0f}ms {t['overlap+split'] * 1e3:>7.0f}ms "
              f"{t['ZeRO-Offload'] / ovl:>8.2f} {t['FSDP2-CPU'] / ovl:>8.2f} {ovl / floor:>10.2f} {ovl / sim:>8.2f} "
              f"{other:>5.1f}  "
              f"{','.join(f'{f:g}' for f in split)}", flush=True)
        predictions.append((b * s, t, predicted(model, cluster, b, s, split)))
    print("\nupd/bwd: CPU update of the whole model / backward; floor: max(fwd+bwd, update); sim: the split's step "
          "simulated from times measured alone; zero/ovl, fsdp/ovl: ZeRO-Offload schedule, FSDP2 CPUOffloadPolicy / "
          "best overlapped; busy: cores other processes used meanwhile; split: offload per layer (embeddings, blocks, "
          "head) of overlap+split")
    print(f"\nplanner's prediction / measured step ({cluster.summary()}; CPU AdamW "
          f"{cluster.cpu_optimizer_rate / 1e6:.0f} M params/s, copy {cluster.host_to_device_bandwidth / 1e9:.1f} GB/s):")
    names = [k for k in SCHEDULES if k != "FSDP2-CPU"]
    print(f"{'tokens':>6} " + " ".join(f"{name:>22}" for name in names))
    for tokens, measured, guess in predictions:
        print(f"{tokens:>6} " + " ".join(f"{guess[k] * 1e3:>6.0f} / {measured[k] * 1e3:>4.0f}ms = {guess[k] / measured[k]:4.2f}"
                                         for k in names))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
