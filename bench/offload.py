"""CPU update offload on one machine: no offload, ZeRO-Offload's schedule, and nbtrain's overlap with and without split.

    python bench/offload.py          # ~2-4 min on 2 cores; the table on stdout

One process, as issue 6 describes for a CPU-only machine: the "device" (forward, backward, the device's share of
the update) is the main thread on one core, the CPU update is OffloadedAdamW's worker thread on the other, one
intra-op thread each. One GPT (fp32, untied head, fused AdamW everywhere), three tokens-per-step settings chosen so
that the CPU update of the whole model takes about 0.5x, 1x and 2x the backward (measured and printed: ``upd/bwd``).

Schedules, all ``nbtrain.run.offload.OffloadedAdamW``:

- ``no offload``: offload 0, the whole update on the device after backward (plain fused AdamW);
- ``ZeRO-Offload``: offload 1, ``schedule="after_backward"``: the CPU update starts once backward has finished;
- ``overlap``: offload 1, ``schedule="overlap"`` (CoTrain, coarse grain): each layer's update starts when
  backward has produced its gradients;
- ``overlap+split``: CoTrain's fine grain: the first layers' updates stay on the device. The split comes from
  ``balanced_offload``: with each layer's backward time and CPU update time measured from the ``overlap`` run's
  trace (and the device's update rate taken equal to the CPU's, as both are one core here), it simulates the step
  for each candidate (layers 0..k-1 on the device, layer k cut by a fraction in tenths, the rest on the CPU) and
  keeps the one whose later side (device: backward then its share of the update; CPU: the queue of layer updates
  in gradient order) ends first, so neither side waits for the other longer than a tenth of a layer.

``floor`` is max(forward + backward, CPU update of the whole model) (REFERENCE.md, physical limits; no PCIe
here), from the ``no offload`` run's forward and backward and the ``ZeRO-Offload`` run's CPU update, each alone.
``zero/ovl`` is ZeRO-Offload's step over the best overlapped one; ``best/floor`` the best overlapped step over the
floor. Step times are medians over ``STEPS`` steps after ``WARMUP``; each schedule runs ``ROUNDS`` times,
interleaved, and keeps its fastest round (the machine may be shared: ``busy`` is the number of cores other
processes kept busy meanwhile, from /proc/stat). FSDP2's ``CPUOffloadPolicy`` is not measured: on a CPU-only
machine it has no device to offload from.
"""

from __future__ import annotations

import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP: no spinning threads

import torch  # noqa: E402

from nbtrain.models import GPT, GPTConfig  # noqa: E402
from nbtrain.profiler.model import lm_loss  # noqa: E402
from nbtrain.run.offload import OffloadedAdamW  # noqa: E402
from nbtrain.run.offload_split import balanced_offload  # noqa: E402

CONFIG = GPTConfig(vocab_size=8192, block_size=1024, n_layer=8, n_head=8, n_embd=512, tie_embeddings=False)
RATIOS = (0.5, 1.0, 2.0)
WARMUP, STEPS, ROUNDS = 2, 6, 2
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


def run(model, ids, offload, schedule, steps):
    """Median step time and the medians of forward, backward (s), and the last step's trace."""
    total, forward, backward = [], [], []
    with OffloadedAdamW.from_model(model, offload, lr=1e-4, schedule=schedule) as opt:
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
        trace = opt.last_trace
    med = [statistics.median(x[WARMUP:]) for x in (total, forward, backward)]
    return med[0], med[1], med[2], trace


def per_layer(trace, kind: str, n: int) -> list[float]:
    """Durations of the trace's events ``"<kind> <layer>"`` by layer (0 for layers without one)."""
    out = [0.0] * n
    for _, label, start, end in trace:
        name, _, layer = label.partition(" ")
        if name == kind and layer.isdigit():
            out[int(layer)] += end - start
    return out


def main():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(CONFIG)
    n_params = sum(p.numel() for p in model.parameters())
    n_layers = CONFIG.n_layer + 2
    # CPU update of the whole model alone, and backward at a first guess of the tokens, to aim each ratio
    _, _, _, trace = run(model, torch.randint(0, CONFIG.vocab_size, (1, SEQ)), 1.0, "after_backward", 3)
    update_s = sum(per_layer(trace, "update", n_layers))
    print(f"GPT {CONFIG.n_layer} layers x {CONFIG.n_embd}, vocab {CONFIG.vocab_size}: {n_params / 1e6:.1f}M "
          f"parameters; CPU AdamW (fused, 1 thread): {update_s * 1e3:.0f} ms = {n_params / update_s / 1e9:.2f} "
          f"G params/s; threads: main 1, worker 1; {os.cpu_count()} cores\n")
    header = (f"{'tokens':>6} {'upd/bwd':>7} {'fwd+bwd':>8} {'update':>7} {'floor':>7} {'no offload':>10} "
              f"{'ZeRO-Off':>9} {'overlap':>8} {'ovl+split':>9} {'zero/ovl':>8} {'best/floor':>10} {'busy':>5}  split")
    print(header)
    rows = []
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
            order = ["no offload", "ZeRO-Offload", "overlap", "overlap+split"]  # split needs overlap's trace
            for name in order if r % 2 == 0 else ["overlap", "ZeRO-Offload", "no offload", "overlap+split"]:
                offload, schedule = {"no offload": (0.0, "overlap"), "ZeRO-Offload": (1.0, "after_backward"),
                                     "overlap": (1.0, "overlap"), "overlap+split": (split, "overlap")}[name]
                if name == "overlap+split" and split is None:
                    trace = best["overlap"][3]
                    cpu = per_layer(trace, "update", n_layers)
                    split = balanced_offload(per_layer(trace, "backward", n_layers), cpu, cpu)
                    offload = split
                result = run(model, ids, offload, schedule, STEPS)
                if name not in best or result[0] < best[name][0]:
                    best[name] = result
        busy1 = busy_cores()
        elapsed = time.perf_counter() - start
        other = ((busy1[0] - busy0[0]) - (busy1[1] - busy0[1])) / os.sysconf("SC_CLK_TCK") / elapsed
        fwd, bwd = best["no offload"][1], best["no offload"][2]
        update = sum(per_layer(best["ZeRO-Offload"][3], "update", n_layers))
        floor = max(fwd + bwd, update)
        ovl = min(best["overlap"][0], best["overlap+split"][0])
        t = {k: v[0] for k, v in best.items()}
        rows.append(f"{b * s:>6} {update / bwd:>7.2f} {(fwd + bwd) * 1e3:>6.0f}ms {update * 1e3:>5.0f}ms "
                    f"{floor * 1e3:>5.0f}ms {t['no offload'] * 1e3:>8.0f}ms {t['ZeRO-Offload'] * 1e3:>7.0f}ms "
                    f"{t['overlap'] * 1e3:>6.0f}ms {t['overlap+split'] * 1e3:>7.0f}ms {t['ZeRO-Offload'] / ovl:>8.2f} "
                    f"{ovl / floor:>10.2f} {other:>5.1f}  {','.join(f'{f:g}' for f in split)}")
        print(rows[-1], flush=True)
    print("\nupd/bwd: CPU update of the whole model / backward; floor: max(fwd+bwd, update); zero/ovl: ZeRO-Offload "
          "schedule / best overlapped; busy: cores other processes used meanwhile; split: offload per layer "
          "(embeddings, blocks, head) of overlap+split")


if __name__ == "__main__":
    main()
