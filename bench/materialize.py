"""Models bigger than a process: a 1 B-parameter transformers Llama built on the meta device, against the same model
built whole in the notebook, each trained one step under ``dp_shard=2`` in two CPU processes here.

    python bench/materialize.py          # ~3-5 min on 2 cores and 24 GiB; the table on stdout

Per run, rank 0's peak resident memory (``ru_maxrss``: the process, torch included) once its part of the model is in
place, before the first step (``FitResult.materialize_peak_bytes``), and after the first step (the step record's);
beside them the prediction (the cost model's tensor memory per device for the plan, profiled on fake tensors, plus
the baseline) and the target: 0.6 × the whole model's training state (fp32 weights, gradients and AdamW's two
moments: 16 bytes a parameter) plus the baseline. The baseline is what a worker holds having allocated nothing
(torch, gloo and the launch), measured by launching an empty function the same way.

The whole model's run starts from the notebook's copy: its forked workers map the notebook's pages (shared, counted
in their resident memory as in the notebook's) and fill their shards from them. The meta run's notebook holds no
weights; each worker initialises each module in host memory, one at a time, and keeps its shard. Both write the
trained weights with ``save_dir`` (each rank its shards): gathering a 4 GiB model on every rank would not fit here.
"""

from __future__ import annotations

import os
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("NBTRAIN_NONINTERACTIVE", "1")

import torch  # noqa: E402

import nbtrain  # noqa: E402
from nbtrain.planner.plan import Plan  # noqa: E402
from nbtrain.table import Table  # noqa: E402
from nbtrain.units import format_bytes, format_seconds  # noqa: E402

LLAMA_1B = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=256,
                tie_word_embeddings=False, use_cache=False)
PLAN, BATCH, SEQ = "dp_shard=2", 2, 32
TARGET_SHARE = 0.6


def build(meta: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        return LlamaForCausalLM(LlamaConfig(**LLAMA_1B))


def batches():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, LLAMA_1B["vocab_size"], (BATCH, SEQ + 1), generator=g)
    return [(ids[:, :-1], ids[:, 1:])]


def _resident() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def baseline() -> int:
    """Rank 0's peak resident memory in a launch that allocates nothing."""
    return nbtrain.launch(_resident, num_processes=2)


def predicted_tensor_bytes(model) -> float:
    """The cost model's memory per device for the plan (tensors: weights, gradients, optimizer state, activations)."""
    prof = nbtrain.profile(model, batch_size=BATCH // 2, seq_len=SEQ, dtype="fp32")
    plan = Plan.parse(PLAN, num_devices=2, num_layers=len(prof.layers), global_batch=BATCH, seq_len=SEQ)
    cluster = nbtrain.Cluster.from_catalog("cpu", num_devices=2, host_cores=2)
    return nbtrain.estimate(plan, prof, cluster).memory_bytes


def run(meta: bool) -> dict:
    model = build(meta)
    params = sum(p.numel() for p in model.parameters())
    notebook = _resident()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        result = nbtrain.fit(model, batches(), plan=PLAN, steps=1, num_processes=2, save_dir=folder, lr=1e-4,
                             progress=False)
    return {"params": params, "notebook": notebook, "materialized": result.materialize_peak_bytes,
            "step": result.records[0].peak_memory_bytes, "loss": result.records[0].loss,
            "seconds": time.perf_counter() - started, "predicted": predicted_tensor_bytes(model)}


def main() -> None:
    base = baseline()  # before any model is in this process: what the workers inherit is torch alone
    print(f"baseline (a worker that allocates nothing): {format_bytes(base)}", file=sys.stderr)
    runs = {"built on meta": run(meta=True), "built whole": run(meta=False)}
    state = 16 * runs["built on meta"]["params"]
    target = TARGET_SHARE * state + base
    t = Table(["model", "notebook", "rank 0 before step 1", "after step 1", "predicted", "target", "≤ target",
               "loss", "time"], align="lrrrrrlrr")
    t.title = (f"Llama {runs['built on meta']['params'] / 1e9:.2f} B, fp32, {PLAN} in 2 CPU processes, "
               f"{BATCH} × {SEQ} tokens; training state {format_bytes(state)}")
    for name, r in runs.items():
        t.add(name, format_bytes(r["notebook"]), format_bytes(r["materialized"]), format_bytes(r["step"]),
              format_bytes(r["predicted"] + base), format_bytes(target), "yes" if r["step"] <= target else "no",
              f"{r['loss']:.4f}", format_seconds(r["seconds"]))
    t.footer.append(f"target = {TARGET_SHARE} × training state + baseline ({format_bytes(base)}); predicted = the "
                    "cost model's tensor memory per device + baseline; memory is ru_maxrss (resident, the process)")
    print(t)


if __name__ == "__main__":
    main()
