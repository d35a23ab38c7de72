"""Hot switching (HotSPa) against the best static plan, on Python's standard library as a long-tailed corpus.

    python bench/switching.py            # ~3-5 min on 2 cores; tables on stdout

Part 1, measured here: two gloo processes train a small LLaMA-shaped GPT on the stdlib corpus (documents packed
into rows of 128, 512 and 2048 tokens, per-document attention). The memory budget is set so that the longest bucket
does not fit plain data parallelism: the planner's static plan (one strategy for every bucket) must use tensor
parallelism or checkpointing, and ``plan_buckets`` gives the short buckets their own strategy. Both plans run on
``nbtrain.run.switching.hot.HotSwitching`` (the static one is the same executor with one strategy, so no switch), on the
same documents per step; tokens/s are medians over the measured steps. The budget binds in the planner's memory
model (a CPU has no device memory to run out of): what is measured is the time of each plan the planner chose.

Part 2, predicted: ``plan_buckets`` for LLaMA-7B on 8 and 16 A100s with 32K context, the buckets of a 1M-token step
of the same corpus cut at 4K / 16K / 32K, beside the strategies HotSPa's artifact uses (REFERENCE.md).
"""

from __future__ import annotations

import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP: no spinning threads

import torch  # noqa: E402

import nbtrain  # noqa: E402
from nbtrain.data import length_batches, stdlib_documents  # noqa: E402
from nbtrain.models import GPT, GPTConfig  # noqa: E402
from nbtrain.planner.switching.bucket_search import padded_rows  # noqa: E402
from nbtrain.planner.switching.buckets import plan_buckets  # noqa: E402
from nbtrain.planner.cost import CostModel  # noqa: E402
from nbtrain.planner.plan import Plan  # noqa: E402
from nbtrain.planner.strategy import Strategy  # noqa: E402
from nbtrain.run.launch.workers import launch  # noqa: E402
from nbtrain.units import format_bytes  # noqa: E402

VOCAB = 2048
CONFIG = GPTConfig(vocab_size=VOCAB, block_size=2048, n_layer=4, n_head=4, n_embd=128, ffn_hidden=344,
                   norm="rmsnorm", mlp="swiglu", position="rope", bias=False, tie_embeddings=False)
BOUNDS = [128, 512, 2048]
TOKENS_PER_STEP = 16384
WARMUP, STEPS = 1, 4


def bucket_rows(documents, bounds, tokens_per_step, steps=8):
    """Mean rows per bucket per step, rounded up to a whole row and at least one: the planner's input (it prices
    the empty rows the executor pads a bucket with to a multiple of its dp)."""
    rows = {b: [] for b in bounds}
    for buckets in length_batches(documents, tokens_per_step=tokens_per_step, bounds=bounds, steps=steps):
        for b in bounds:
            rows[b].append(next((r.ids.shape[0] for r in buckets if r.bound == b), 0))
    return [(b, max(1, -(-sum(v) // len(v)))) for b, v in rows.items()]


def budget_forcing_tp_or_ac(profile, cluster, bound, rows):
    """A memory budget under which the longest bucket fits only with TP or checkpointing: between the least memory
    of those plans and the least of plain data-parallel ones (both from the cost model, each at the bucket's rows
    padded to a multiple of its dp, as the planner prices them)."""
    n = len(profile.layers)

    def memory(s):
        padded = padded_rows(rows, s.dp)
        model = CostModel(profile, cluster, global_batch=padded, seq_len=bound)
        return model.estimate(Plan(num_devices=cluster.num_devices, layers=(s,) * n, global_batch=padded)).memory_bytes

    plain = min(memory(Strategy(dp_replicate=2)), memory(Strategy(dp_shard=2)))
    helped = min(memory(s) for s in (Strategy(tp=2), Strategy(dp_replicate=2, ac=True), Strategy(dp_shard=2, ac=True)))
    if helped >= plain:
        raise RuntimeError("TP or checkpointing saves no memory for this model and bucket: nothing to force")
    return (helped + plain) / 2


def train(strategies: dict, bounds: list[int], steps: int, tokens_per_step: int) -> dict:
    """In each worker: train under ``strategies`` (bound → strategy), return rank 0's measurements."""
    from nbtrain.run.switching.hot import HotSwitching

    documents = stdlib_documents(VOCAB)
    switching = HotSwitching(lambda: GPT(CONFIG), strategies, lr=1e-3)
    records = []
    for buckets in length_batches(documents, tokens_per_step=tokens_per_step, bounds=bounds, steps=WARMUP + steps):
        records.append(switching.step(buckets))
    measured = records[WARMUP:]
    switch = {}
    for r in measured:
        for s in r.switches:
            switch.setdefault((s.what, s.strategy), []).append((s.seconds, s.bytes_received))
    return {"tokens_per_s": statistics.median(r.tokens / r.seconds for r in measured),
            "loss": measured[-1].loss,
            "switch_s": statistics.median(r.switch_seconds for r in measured),
            "switches": {k: (statistics.median(x for x, _ in v), v[0][1]) for k, v in switch.items()}}


def part_one():
    torch.set_num_threads(1)
    documents = stdlib_documents(VOCAB)
    buckets = bucket_rows(documents, BOUNDS, TOKENS_PER_STEP)
    model = GPT(CONFIG)
    started = time.perf_counter()
    profile = nbtrain.profile(model, batch_size=1, seq_len=BOUNDS[-1], dtype="float32", measure="cpu")
    cluster = nbtrain.Cluster.detect().replace(num_devices=2, devices_per_node=2)
    budget = budget_forcing_tp_or_ac(profile, cluster, *buckets[-1])
    hot = plan_buckets(profile, cluster, buckets, memory=budget)
    print(f"corpus: {len(documents)} stdlib files; step: ~{TOKENS_PER_STEP} tokens, buckets (bound, rows) "
          f"{buckets}; budget {format_bytes(budget)} per device (planned in {time.perf_counter() - started:.0f} s)\n")
    print(hot, "\n")
    if hot.static is None:
        raise RuntimeError("no static plan fits the budget")
    static = {b: hot.static.strategy for b in hot.static.bounds}  # the static plan's packing: as given, or all in one
    plans = {"static": (static, list(hot.static.bounds)), "switching": (hot.strategies(), sorted(hot.strategies()))}
    results = {}
    for name, (strategies, bounds) in plans.items():
        results[name] = launch(train, strategies, bounds, STEPS, TOKENS_PER_STEP, num_processes=2, timeout=900)
    s, h = results["static"], results["switching"]
    print(f"{'plan':<10} {'tokens/s':>9} {'switch s/step':>13}  strategies")
    for name, r in results.items():
        described = ", ".join(f"{b}: {st}" for b, st in plans[name][0].items())
        print(f"{name:<10} {r['tokens_per_s']:>9.0f} {r['switch_s']:>13.3f}  {described}")
    print(f"\nmeasured speed-up {h['tokens_per_s'] / s['tokens_per_s']:.2f}x; predicted "
          f"{hot.speedup:.2f}x (target >= 1.3x)")
    predicted = {(sw.what, str(sw.target if sw.what == "weights" else sw.source)): sw for sw in hot.switches}
    print("\nswitches, measured (median per step, rank 0) beside predicted:")
    if not h["switches"]:
        print("  none: the plan's strategies share one layout (they differ only in checkpointing)")
    for (what, strategy), (seconds, received) in sorted(h["switches"].items()):
        guess = predicted.get((what, strategy))
        beside = f"{guess.seconds * 1e3:8.2f} ms, {format_bytes(guess.bytes)}" if guess else "—"
        print(f"  {what:<9} {strategy:<22} {seconds * 1e3:8.2f} ms, {format_bytes(received)} received  |  "
              f"predicted {beside}")


def part_two():
    documents = stdlib_documents(VOCAB)
    bounds = [4096, 16384, 32768]
    buckets = bucket_rows(documents, bounds, 1 << 20, steps=4)
    profile = nbtrain.profile("llama-7b", batch_size=1, seq_len=4096)
    print(f"\nLLaMA-7B, 32K context, buckets (bound, rows) of a 1M-token step of the corpus: {buckets}")
    print("HotSPa's artifact on 8 GPUs (dp, tp, pp): (8,1,1) under 4K, (2,2,2) 4K-16K, (1,4,2) 16K-32K")
    for gpus in (8, 16):
        hot = plan_buckets(profile, nbtrain.Cluster.from_catalog("A100", num_devices=gpus), buckets)
        chosen = ", ".join(f"{b.bound}: {b.strategy}" for b in hot.buckets)
        static = f"{hot.static.strategy} (rows of {list(hot.static.bounds)})" if hot.static else "none fits"
        speedup = f"{hot.speedup:.2f}x" if hot.speedup else "n/a"
        print(f"  {gpus:>2} x A100: {chosen}; static {static}; predicted speed-up {speedup}")


if __name__ == "__main__":
    part_one()
    part_two()
