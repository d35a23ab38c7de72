"""What the check before a pipeline trains costs, beside the step it guards.

    PYTHONPATH=. python bench/stage_check.py        # ~1 min on 2 cores; a table on stdout

``fit`` with ``pp > 1`` first chains the pipeline stages in the notebook on the first micro-batch and compares each
hand-over with what the model's own forward gives the next layer (``nbtrain/run/parallel/stage_check.py``). For
each model (transformers' default configs at test sizes, from ``tests/any_models.py``, and nbtrain's LLaMA-shaped
``llama-tiny``), this prints the check's time (median of 5, after one warm-up), and the measured step of the same
``pp=2 mb=2`` plan in 2 processes (median of the steps after the first), and their ratio.
"""

from __future__ import annotations

import statistics
import time

import torch

import nbtrain
import tests.any_models as zoo
from nbtrain.models.description import describe
from nbtrain.planner.plan import Plan
from nbtrain.run.batches import model_vocab_size
from nbtrain.run.parallel.stage_check import check_stages
from nbtrain.table import Table

MODELS = {"Qwen2 (test size)": zoo.qwen2, "Cohere 2 (test size)": zoo.cohere2, "Jamba (test size)": zoo.jamba,
          "llama-tiny": lambda: nbtrain.build_preset("llama-tiny", device="cpu")}
ROWS, SEQ, STEPS = 8, 64, 6


def main() -> None:
    t = Table(["model", "parameters", "check (ms)", "step pp=2 mb=2 (ms)", "check / step"], align="lrrrr")
    t.title = f"the stage check before a pipeline trains: {ROWS} × {SEQ} tokens a step, first micro-batch checked"
    for name, build in MODELS.items():
        model = build()
        vocab = model_vocab_size(model)
        g = torch.Generator().manual_seed(0)
        batches = [(ids, torch.roll(ids, -1, 1)) for ids in
                   (torch.randint(0, vocab, (ROWS, SEQ), generator=g) for _ in range(STEPS))]
        d = describe(model)
        plan = Plan.parse("pp=2 mb=2", num_devices=2, num_layers=len(d.layers), global_batch=ROWS, seq_len=SEQ)
        first = batches[0][0].chunk(2)[0]
        check_stages(model, d, plan, first)  # warm-up
        checks = [check_stages(model, d, plan, first) for _ in range(5)]
        result = nbtrain.fit(model, batches, plan="pp=2 mb=2", steps=STEPS, num_processes=2, progress=False)
        step = statistics.median(r.seconds for r in result.records[1:])
        check = statistics.median(checks)
        t.add(name, f"{sum(p.numel() for p in model.parameters()):,}", f"{check * 1e3:.1f}", f"{step * 1e3:.1f}",
              f"{check / step:.2f}")
    t.footer.append(f"{time.strftime('%Y-%m-%d')}, torch {torch.__version__}; the check runs in this process, one "
                    "thread, the steps in 2 workers, one thread each")
    print(t)


if __name__ == "__main__":
    main()
