"""Expert parallelism: Mixtral-8x7B's shape planned on 8 and 64 × H100, and ``ep=2`` against ``dp_shard=2`` on this
machine, measured beside predicted.

    NBTRAIN_NONINTERACTIVE=1 PYTHONPATH=. python bench/expert_parallel.py   # ~3 min on 2 cores (+1 min the first
                                                                            # time: measuring communication)

1. **Planned.** transformers' default ``MixtralConfig`` (Mixtral-8x7B: 32 blocks of 8 experts, 2 a token) built on
   the meta device and profiled at 1 × 4096 tokens; ``nbtrain.plan`` on 8 and 64 H100s, global batch 2 a GPU, with
   and without expert parallelism in the search (``SearchOptions(allow_ep=False)``).
2. **Measured.** A small Mixtral (8 experts, 2 a token) trained by ``nbtrain.fit`` on 2 processes under
   ``dp_shard=2`` (every rank holds all experts, sharded) and ``ep=2`` variants (each rank holds 4 of them and
   sends each token to its experts' rank); each run's median step after warm-up beside the cost model's prediction
   for this machine (``Cluster.detect``: its layers timed here, its communication measured here). Runs interleaved
   over ``ROUNDS`` rounds; the fastest of each is shown.
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
from nbtrain.planner.search_space import SearchOptions  # noqa: E402
from nbtrain.profiler.hardware import Cluster  # noqa: E402
from nbtrain.table import Table  # noqa: E402
from nbtrain.units import format_bytes, format_count, format_seconds  # noqa: E402

SMALL = dict(vocab_size=1024, hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, num_local_experts=8, num_experts_per_tok=2,
             use_cache=False)
BATCH, SEQ, STEPS, WARMUP, ROUNDS = 8, 128, 10, 3, 2
PLANS = ["dp_shard=2", "dp_shard=2 ep=2", "dp_replicate=2 ep=2"]


def mixtral_8x7b_profile():
    from transformers import MixtralConfig, MixtralForCausalLM

    with torch.device("meta"):
        model = MixtralForCausalLM(MixtralConfig())
    return nbtrain.profile(model, batch_size=1, seq_len=4096)


def planned_table(profile) -> Table:
    t = Table(["GPUs", "search", "plan", "memory / GPU", "predicted tok/s/GPU", "MFU"], align="rllrrr")
    t.title = (f"{profile.model}: {format_count(profile.params)} parameters, {format_count(profile.active_params)} "
               "active; H100 80 GiB, global batch 2 a GPU, 4096 tokens")
    for n in (8, 64):
        cluster = Cluster.from_catalog("H100", num_devices=n)
        for label, options in (("with ep", SearchOptions()), ("without ep", SearchOptions(allow_ep=False))):
            best = nbtrain.plan(profile, cluster, global_batch=2 * n, seq_len=4096, options=options)
            pred = best.predicted
            t.add(n, label, str(best), f"{format_bytes(pred.memory_bytes)}",
                  f"{pred.tokens_per_s / n:,.0f}", f"{pred.mfu:.1%}")
    return t


def small_mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(**SMALL))


def measured_table(cluster: Cluster) -> Table:
    model = small_mixtral()
    torch.manual_seed(1)
    batches = [(ids, ids.roll(-1, 1)) for ids in (torch.randint(0, SMALL["vocab_size"], (BATCH, SEQ))
                                                  for _ in range(4))]
    runs: dict[str, list] = {plan: [] for plan in PLANS}
    for _ in range(ROUNDS):
        for plan in PLANS:
            result = nbtrain.fit(copy.deepcopy(model), batches, plan=plan, steps=STEPS, num_processes=2,
                                 cluster=cluster, progress=False)
            runs[plan].append((statistics.median(r.seconds for r in result.records[WARMUP:]), result))
    t = Table(["plan", "predicted", "measured", "measured / predicted", "every run"], align="lrrrl")
    t.title = (f"small Mixtral ({format_count(sum(p.numel() for p in model.parameters()))} params, 8 experts, 2 a "
               f"token), {BATCH} × {SEQ} tokens, fp32, 2 processes; median of steps {WARMUP + 1}–{STEPS}")
    ratios = []
    for plan in PLANS:
        measured, result = min(runs[plan], key=lambda r: r[0])
        ratios.append(measured / result.predicted_step_s)
        t.add(plan, format_seconds(result.predicted_step_s), format_seconds(measured), f"{ratios[-1]:.2f}",
              " ".join(format_seconds(m) for m, _ in runs[plan]))
    t.footer.append(f"measured / predicted {min(ratios):.2f}–{max(ratios):.2f}")
    t.footer.append(f"cluster: {cluster.summary()}")
    return t


def main() -> None:
    started = time.perf_counter()
    print(f"nbtrain expert-parallel benchmark — {platform.platform()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}\n", flush=True)
    print(planned_table(mixtral_8x7b_profile()), "\n", flush=True)
    print(measured_table(Cluster.detect(calibrate=True)))
    print(f"\ntotal {format_seconds(time.perf_counter() - started)}")


if __name__ == "__main__":
    main()
