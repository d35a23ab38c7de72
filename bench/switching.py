"""Hot switching (HotSPa) against the best static plan, through ``nbtrain.fit`` on documents, on two length mixes.

    NBTRAIN_NONINTERACTIVE=1 python bench/switching.py          # ~6-10 min on 2 cores; tables on stdout
    python bench/switching.py --part 2                           # only the predicted LLaMA-7B rows (seconds)

Part 1, measured here: two gloo processes train a small LLaMA-shaped GPT with ``nbtrain.fit(model, documents)``:
once as the planner chooses (a strategy and micro-batch size per length bucket, or one strategy when switching
does not pay), once under the planner's best static plan (one strategy for every bucket, with the better of two
packings: the buckets as given, or every document in rows of the longest bound), each priced by the same cost
model and measured on the same documents per step. The memory budget is 1.25 × the least any strategy needs for
the longest bucket: the best static plan then needs tensor parallelism or checkpointing there (checked, and the
run refuses otherwise). A CPU has no device memory to run out of: the budget binds in the planner's memory model,
and the tensor memory each run held is shown beside it. Two corpora:

* the Wikipedia length mix (``nbtrain.data.WIKIPEDIA``: FlexSP's histogram of 1,000,000 documents), every length
  ÷ 8 so that 32K-token documents become this machine's 4K rows, filled with standard-library text;
* Python's standard library sources, as files (98% of tokens in the longest bucket: ~1.0× is the honest answer).

Part 2, predicted: the planner's strategies for LLaMA-7B on 8 and 16 A100s at 32K, on the unscaled Wikipedia mix
(1M tokens per step), beside the hand-set strategies of HotSPa's artifact for that setting (REFERENCE.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP: no spinning threads

import torch  # noqa: E402

import nbtrain  # noqa: E402
from nbtrain.data import WIKIPEDIA, histogram_documents, mean_bucket_rows, stdlib_documents  # noqa: E402
from nbtrain.models import GPT, GPTConfig  # noqa: E402
from nbtrain.planner.switching.buckets import plan_buckets  # noqa: E402
from nbtrain.run.switching.planned import longest_bucket_needs  # noqa: E402
from nbtrain.units import format_bytes  # noqa: E402

VOCAB, CONTEXT, SCALE = 2048, 4096, 8
CONFIG = GPTConfig(vocab_size=VOCAB, block_size=CONTEXT, n_layer=4, n_head=4, n_embd=128, ffn_hidden=336,
                   norm="rmsnorm", mlp="swiglu", position="rope", bias=False, tie_embeddings=False)
BOUNDS = [128, 256, 512, 1024, 2048, 4096]
TOKENS_PER_STEP = 32768
STEPS = 4  # the first is warm-up: the tables take the median of the rest
HEADROOM = 1.25


def corpora() -> dict[str, list]:
    return {f"Wikipedia mix, lengths ÷ {SCALE}": histogram_documents(WIKIPEDIA, 6000, scale=SCALE, vocab_size=VOCAB),
            "stdlib files": stdlib_documents(VOCAB)}


def budget_for(model, documents, cluster) -> tuple[float, str]:
    """HEADROOM × the least memory the longest bucket needs under any strategy (the planner's model), and why."""
    needs = longest_bucket_needs(model, documents, num_processes=2, tokens_per_step=TOKENS_PER_STEP, bounds=BOUNDS,
                                 cluster=cluster)
    budget = HEADROOM * needs.least
    if budget >= needs.plain:
        raise RuntimeError(f"the budget lets plain data parallelism run the longest bucket: nothing to force ({needs})")
    return budget, f"{format_bytes(budget)} per device ({HEADROOM} × the least: {needs})"


def run(model_state, documents, plan, cluster, budget):
    model = GPT(CONFIG)
    model.load_state_dict(model_state)
    return nbtrain.fit(model, documents, plan=plan, steps=STEPS, num_processes=2, tokens_per_step=TOKENS_PER_STEP,
                       bounds=BOUNDS, memory=budget, cluster=cluster, lr=1e-3, timeout=1800, progress=False)


def tokens_per_s(result) -> float:
    measured = result.details[1:]
    return statistics.median(r.tokens / r.seconds for r in measured)


def part_one():
    torch.manual_seed(0)
    state = GPT(CONFIG).state_dict()
    cluster = nbtrain.Cluster.this_machine(2)
    summary = []
    for name, documents in corpora().items():
        started = time.perf_counter()
        budget, why = budget_for(GPT(CONFIG), documents, cluster)
        print(f"\n=== {name}: {len(documents)} documents, ~{TOKENS_PER_STEP:,} tokens per step, buckets {BOUNDS}; "
              f"budget {why}\n")
        planned = run(state, documents, None, cluster, budget)
        print(planned)
        chosen = planned.layout
        # the best static plan under the same budget, as the planner found it beside its own
        static = chosen.static
        if static is None:
            raise RuntimeError("no static plan fits the budget")
        if static.strategy.tp == 1 and not static.strategy.ac:
            raise RuntimeError(f"the static plan '{static.strategy}' needs neither TP nor checkpointing")
        plan = {b: static.strategy for b in static.bounds}
        fixed = run(state, documents, plan, cluster, budget) if chosen.switching else planned
        if chosen.switching:
            print(fixed)
        ratio = tokens_per_s(planned) / tokens_per_s(fixed)
        predicted = static.step_time_s / chosen.predicted.step_time_s if chosen.switching else 1.0
        summary.append((name, chosen.describe(), f"{static.strategy} in rows of {list(static.bounds)}",
                        tokens_per_s(fixed), tokens_per_s(planned), ratio, predicted,
                        time.perf_counter() - started))
    print("\n=== summary (tokens/s: median of steps 2-4 on rank 0; predicted: the planner's static / chosen step)")
    print(f"{'corpus':<26} {'static tok/s':>12} {'chosen tok/s':>12} {'measured':>9} {'predicted':>9}  chosen · static")
    for name, chosen, static, s, h, ratio, predicted, seconds in summary:
        print(f"{name:<26} {s:>12,.0f} {h:>12,.0f} {ratio:>8.2f}x {predicted:>8.2f}x  {chosen} · {static} "
              f"({seconds:.0f} s)")


ARTIFACT = {8: "(dp, tp, pp) = (8,1,1) under 4K, (2,2,2) for 4K-16K, (1,4,2) for 16K-32K",
            16: "not published (the artifact's strategies are for 8 GPUs)"}


def part_two():
    documents = histogram_documents(WIKIPEDIA, 10000, scale=1, vocab_size=VOCAB)
    bounds = [4096, 8192, 16384, 32768]
    buckets = mean_bucket_rows(documents, tokens_per_step=1 << 20, bounds=bounds, steps=4)
    profile = nbtrain.profile("llama-7b", batch_size=1, seq_len=4096)
    print(f"\n=== LLaMA-7B, 32K context, the unscaled Wikipedia mix: buckets (bound, rows) of a 1M-token step "
          f"{buckets}")
    for gpus in (8, 16):
        hot = plan_buckets(profile, nbtrain.Cluster.from_catalog("A100", num_devices=gpus), buckets)
        chosen = ", ".join(f"{b.bound}: {b.strategy}" + (f" ({b.microbatches} mb)" if b.microbatches > 1 else "")
                           for b in hot.buckets)
        static = f"{hot.static.strategy} (rows of {list(hot.static.bounds)})" if hot.static else "none fits"
        speedup = f"{hot.speedup:.2f}x" if hot.speedup else "n/a"
        print(f"  {gpus:>2} x A100 (80 GB), planner: {chosen}; static {static}; predicted speed-up {speedup}")
        print(f"  {'':>2}   HotSPa's artifact, by hand: {ARTIFACT[gpus]}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", type=int, choices=(1, 2), help="only part 1 (measured) or 2 (predicted)")
    args = parser.parse_args()
    if args.part in (None, 1):
        part_one()
    if args.part in (None, 2):
        part_two()
