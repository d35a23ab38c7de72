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

Part 3, predicted (issue 47): HotSPa's own setting, LLaMA-7B on 8 × A100-80GB, contexts up to 32K in HotSPa's
buckets (0, 4K], (4K, 16K], (16K, 32K], on the Wikipedia mix and on a code-like one (the standard library's files,
cut at 32K): the planner's strategy per bucket as (dp, tp, pp), pipelines and the home's offload among its choices,
beside HotSPa's (8,1,1), (2,2,2), (1,4,2) priced by the same cost model (as given, and with checkpointing where
they do not fit), and the predicted speed-up over the best static plan beside the published 1.3-2.7×.

Part 4, measured here (issue 47): four gloo processes on the Wikipedia mix (lengths ÷ 8, buckets 512/2048/4096 as
HotSPa's 4K/16K/32K ÷ 8): what ``fit`` plans with pipelines among its choices, the planner's switching without
pipelines, HotSPa's shape by hand ((4,1,1), (2,1,2), (1,2,2)) and the best static plan, each measured (mean step
of steps 2-5 on rank 0) beside its prediction.

    python bench/switching.py --part 3         # ~2 min on 2 cores
    NBTRAIN_NONINTERACTIVE=1 python bench/switching.py --part 4         # a few minutes on 2 cores
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
from nbtrain.planner.switching.bucket_result import hotspa_form  # noqa: E402
from nbtrain.planner.switching.bucket_strategy import pp_of  # noqa: E402
from nbtrain.planner.switching.buckets import BucketOptions, plan_buckets, price_buckets  # noqa: E402
from nbtrain.run.switching.planned import longest_bucket_needs, plan_documents  # noqa: E402
from nbtrain.units import format_bytes  # noqa: E402

VOCAB, CONTEXT, SCALE = 2048, 4096, 8
CONFIG = GPTConfig(vocab_size=VOCAB, block_size=CONTEXT, n_layer=4, n_head=4, n_embd=128, ffn_hidden=336,
                   norm="rmsnorm", mlp="swiglu", position="rope", bias=False, tie_embeddings=False)
BOUNDS = [128, 256, 512, 1024, 2048, 4096]
TOKENS_PER_STEP = 32768
STEPS = 4  # the first is warm-up: the tables take the rest (their mean: a step over documents is not like the next)
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
    """The steps after the first: their tokens over their seconds (the mean step's rate, which the planner prices;
    a median of per-step rates picks whichever step sits in the middle)."""
    measured = result.details[1:]
    return sum(r.tokens for r in measured) / sum(r.seconds for r in measured)


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
    print("\n=== summary (tokens/s: steps 2-4 on rank 0, their tokens over their time; predicted: the planner's static / chosen step)")
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


HOTSPA_BOUNDS = [4096, 16384, 32768]
HOTSPA = {4096: "dp_replicate=8", 16384: "pp=2 dp_replicate=2 tp=2", 32768: "pp=2 tp=4"}
"""HotSPa's artifact, LLaMA-7B on 8 GPUs: (dp, tp, pp) = (8,1,1) under 4K, (2,2,2) for 4K-16K, (1,4,2) for 16K-32K."""
PUBLISHED = "1.3-2.7x (HotSPa's follow-ups over Megatron-LM's static plans)"


def _form(plan) -> str:
    return ", ".join(f"{b.bound // 1024}K: {hotspa_form(b.strategy)}" for b in plan.buckets)


def hotspa_checkpointed(profile, cluster, buckets):
    """HotSPa's degrees priced with checkpointing where they need it (the artifact's (dp, tp, pp) leave it unsaid):
    from none, the bucket most over the budget takes the next of selective (ac=op) and full checkpointing, until the
    plan fits or every bucket that does not is fully checkpointed."""
    levels, level = ("", " ac=op", " ac"), {b: 0 for b in HOTSPA}
    while True:
        priced = price_buckets(profile, cluster, buckets, {b: s + levels[level[b]] for b, s in HOTSPA.items()})
        over = [b for b in priced.buckets if b.memory.total > priced.budget_bytes and level[b.bound] < 2]
        if not over:
            return priced
        level[max(over, key=lambda b: b.memory.total).bound] += 1


def part_three():
    profile = nbtrain.profile("llama-7b", batch_size=1, seq_len=4096)
    a100 = nbtrain.Cluster.from_catalog("A100", num_devices=8)
    mixes = {"Wikipedia": histogram_documents(WIKIPEDIA, 10000, scale=1, vocab_size=VOCAB),
             "code (stdlib files)": stdlib_documents(VOCAB)}
    print("\n=== HotSPa's setting, predicted: LLaMA-7B on 8 x A100-80GB, buckets (0,4K] (4K,16K] (16K,32K], a 1M-token "
          "step; (dp, tp, pp) per bucket")
    rows = []
    for name, documents in mixes.items():
        buckets = mean_bucket_rows(documents, tokens_per_step=1 << 20, bounds=HOTSPA_BOUNDS, steps=4)
        hot = plan_buckets(profile, a100, buckets, options=BucketOptions(merge=False))
        print(f"\n--- {name} mix: (bound, rows) {buckets}\n{hot}")
        best = hot.static.step_time_s if hot.static else float("nan")
        rows.append((name, "nbtrain", ", ".join(f"{b.bound // 1024}K: {b.strategy}" for b in hot.buckets),
                     _form(hot), hot.step_time_s, best / hot.step_time_s, "fits"))
        for who, theirs in (("HotSPa", price_buckets(profile, a100, buckets, HOTSPA)),
                            ("HotSPa+ac", hotspa_checkpointed(profile, a100, buckets))):
            fits = "fits" if theirs.memory_bytes <= theirs.budget_bytes else \
                f"needs {format_bytes(theirs.memory_bytes)} > {format_bytes(theirs.budget_bytes)}"
            text = ", ".join(f"{b.bound // 1024}K: {b.strategy} in {b.microbatches} x {b.micro_rows}"
                             for b in theirs.buckets)
            rows.append((name, who, text, _form(theirs), theirs.step_time_s, best / theirs.step_time_s, fits))
            print("\n".join(f"{who}, why a pipeline: {why}" for why in theirs.why))
        rows.append((name, "static", str(hot.static.strategy) if hot.static else "none fits",
                     f"rows of {list(hot.static.bounds)}" if hot.static else "", best, 1.0, "fits"))
    print(f"\n=== summary: predicted step and speed-up over the best static plan (published: {PUBLISHED})")
    print(f"{'mix':<20} {'plan':<10} {'(dp,tp,pp) per bucket':<40} {'step':>8} {'speed-up':>8}  memory · strategies")
    for name, who, text, form, step, speedup, fits in rows:
        print(f"{name:<20} {who:<10} {form:<40} {step:>7.2f}s {speedup:>7.2f}x  {fits}"
              + (f" · {text}" if text else ""))


PIPE_PROCESSES, PIPE_BOUNDS, PIPE_TOKENS, PIPE_STEPS = 4, [512, 2048, 4096], 16384, 5
PIPE_HOTSPA = {512: "dp_replicate=4", 2048: "pp=2 dp_replicate=2", 4096: "pp=2 tp=2"}
"""HotSPa's shape on 4 processes: (4,1,1), (2,1,2), (1,2,2)."""


def part_four():
    torch.manual_seed(0)
    state = GPT(CONFIG).state_dict()
    documents = histogram_documents(WIKIPEDIA, 3000, scale=SCALE, vocab_size=VOCAB)
    cluster = nbtrain.Cluster.this_machine(PIPE_PROCESSES)
    needs = longest_bucket_needs(GPT(CONFIG), documents, num_processes=PIPE_PROCESSES, tokens_per_step=PIPE_TOKENS,
                                 bounds=PIPE_BOUNDS, cluster=cluster)
    budget = HEADROOM * needs.least
    common = dict(num_processes=PIPE_PROCESSES, bounds=PIPE_BOUNDS, tokens_per_step=PIPE_TOKENS, memory=budget,
                  cluster=cluster, progress=None)
    print(f"\n=== measured here: {PIPE_PROCESSES} gloo processes, Wikipedia mix ÷ {SCALE}, {len(documents)} documents, "
          f"~{PIPE_TOKENS:,} tokens per step, buckets {PIPE_BOUNDS}; budget {format_bytes(budget)} per device "
          f"({HEADROOM} × the least: {needs})")
    with_pp = plan_documents(GPT(CONFIG), documents, **common)
    without = plan_documents(GPT(CONFIG), documents, options=BucketOptions(max_pp=1), **common)
    hotspa = plan_documents(GPT(CONFIG), documents, plan=PIPE_HOTSPA, **common)
    static = with_pp.static or without.static
    runs = {"planned, pipelines allowed": (None, with_pp, PIPE_BOUNDS),
            "planned, no pipeline": (without.strategies, without, PIPE_BOUNDS),
            "HotSPa's shape by hand": (PIPE_HOTSPA, hotspa, PIPE_BOUNDS)}
    if static is not None:
        fixed = {b: static.strategy for b in static.bounds}
        runs["best static plan"] = (fixed, plan_documents(GPT(CONFIG), documents, plan=fixed,
                                                          **{**common, "bounds": list(static.bounds)}),
                                    list(static.bounds))
    summary, done = [], {}
    for name, (plan, layout, bounds) in runs.items():
        key = tuple((b, str(s)) for b, s in sorted(layout.strategies.items()))
        if key in done:  # the same strategies as a run before it (the planner chose no pipeline): measured once
            summary.append((name, *done[key][1:]))
            print(f"\n--- {name}: the same strategies as '{done[key][0]}'")
            continue
        model = GPT(CONFIG)
        model.load_state_dict(state)
        started = time.perf_counter()
        result = nbtrain.fit(model, documents, plan=plan, steps=PIPE_STEPS, num_processes=PIPE_PROCESSES,
                             tokens_per_step=PIPE_TOKENS, bounds=bounds, memory=budget, cluster=cluster, lr=1e-3,
                             timeout=1800, progress=False)
        print(f"\n--- {name}\n{result}")
        chosen = result.layout
        measured = result.measured_step_s  # the mean step (DocumentsFitResult)
        predicted = chosen.predicted.step_time_s if chosen.predicted else float("nan")
        piped = any(pp_of(s) > 1 for s in chosen.strategies.values())
        summary.append((name, chosen.describe(), measured, predicted, piped, time.perf_counter() - started,
                        statistics.mean(r.tokens for r in result.details[1:])))
        done[key] = summary[-1]
    static_row = next((row for row in summary if row[0] == "best static plan"), None)
    print(f"\n=== summary, {PIPE_PROCESSES} processes (measured: mean step of steps 2-{PIPE_STEPS} on rank 0; "
          "predicted: the planner's; speed-up: the best static plan's step / this one's)")
    print(f"{'run':<28} {'measured':>9} {'predicted':>9} {'meas/pred':>9} {'tok/s':>7} {'speed-up':>8} "
          f"{'predicted':>9}  pp?  strategies")
    for name, text, measured, predicted, piped, seconds, tokens in summary:
        ratios = (f"{static_row[2] / measured:>7.2f}x {static_row[3] / predicted:>8.2f}x" if static_row
                  else f"{'n/a':>8} {'n/a':>9}")
        print(f"{name:<28} {measured:>8.2f}s {predicted:>8.2f}s {measured / predicted:>9.2f} "
              f"{tokens / measured:>7,.0f} {ratios}  {'yes' if piped else 'no ':<3}  {text} ({seconds:.0f} s)")

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", type=int, choices=(1, 2, 3, 4),
                        help="only part 1 (measured), 2 (predicted), 3 (HotSPa's setting, predicted) or 4 (pipelined "
                             "buckets on 4 processes, measured)")
    args = parser.parse_args()
    if args.part in (None, 1):
        part_one()
    if args.part in (None, 2):
        part_two()
    if args.part in (None, 3):
        part_three()
    if args.part in (None, 4):
        part_four()
