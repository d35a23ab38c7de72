"""A session's later calls beside a fresh launch of the same each time: the wall time, and the steps inside.

    PYTHONPATH=. python bench/session.py                 # small model only, ~1 min on 2 cores
    PYTHONPATH=. python bench/session.py --large         # and LoRA on a ~1 B model on meta from a checkpoint
                                                         # (~15 min, ~12 GiB of memory)

Each model trains ``CALLS`` times ``fit(steps=STEPS)`` under ``dp_shard=2`` in 2 processes, two ways:

- **fresh**: ``nbtrain.fit`` each time, as a notebook without a session does (every call forks the workers, builds
  and fills the model — for the large one: built on the meta device, its weights read from a safetensors folder
  each time, ``weights=``, and gathered back at the end);
- **session**: one ``nbtrain.Session`` started once (its start timed apart), then ``s.fit(steps=STEPS)`` each time.

The table gives each call's wall time (median of the calls after the first), the ratio fresh / session, and the
median step time inside each (the steps themselves must not differ: a session trains the same steps, the same way).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import nbtrain  # noqa: E402
from nbtrain.run.batches import model_vocab_size  # noqa: E402
from nbtrain.table import Table  # noqa: E402

CALLS, STEPS, PLAN = 4, 10, "dp_shard=2"


def small():
    return nbtrain.build_preset("llama-tiny", device="cpu"), None


def large(folder: Path):
    """A LLaMA-shaped GPT of ~1 B parameters, fine-tuned with LoRA (r=16 on q, k, v, o): its base written once as a
    safetensors folder, then built on meta (the notebook holds no weights) and read from the folder in every launch;
    the adapters come back into the notebook. (Full training of it under dp_shard=2 holds 8 GiB a rank, and gathering
    it back 4 GiB more: more than this 24 GiB machine has for two ranks.)"""
    from safetensors.torch import save_file

    config = nbtrain.GPTConfig(vocab_size=32000, block_size=256, n_layer=16, n_head=16, n_embd=2048,
                               position="rope", norm="rmsnorm", mlp="swiglu", ffn_hidden=5504, bias=False,
                               tie_embeddings=False)
    if not (folder / "model.safetensors").exists():
        torch.manual_seed(0)
        model = nbtrain.GPT(config)
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, folder / "model.safetensors")
        del model
    from peft import LoraConfig, get_peft_model

    with torch.device("meta"):
        base = nbtrain.GPT(config)
    return get_peft_model(base, LoraConfig(r=16, target_modules=["q", "k", "v", "o"])), str(folder)


def batches(vocab: int, rows: int = 4, seq: int = 16):
    g = torch.Generator().manual_seed(0)
    return [(ids, torch.roll(ids, -1, 1)) for ids in (torch.randint(0, vocab, (rows, seq), generator=g)
                                                      for _ in range(CALLS * STEPS))]


def measure(name: str, build, table: Table) -> None:
    model, weights = build()
    data = batches(model_vocab_size(model))
    params = sum(p.numel() for p in model.parameters())
    fresh, fresh_steps = [], []
    for call in range(CALLS):
        model, weights = build()
        started = time.perf_counter()
        result = nbtrain.fit(model, data[call * STEPS:], plan=PLAN, steps=STEPS, num_processes=2, progress=False,
                             weights=weights)
        fresh.append(time.perf_counter() - started)
        fresh_steps.append(result.measured_step_s)
    model, weights = build()
    started = time.perf_counter()
    session = nbtrain.Session(model, PLAN, num_processes=2, weights=weights)
    opened = time.perf_counter() - started
    kept, kept_steps = [], []
    try:
        for _ in range(CALLS):
            started = time.perf_counter()
            result = session.fit(data, steps=STEPS, progress=False)
            kept.append(time.perf_counter() - started)
            kept_steps.append(result.measured_step_s)
    finally:
        session.close()
    later_fresh, later_kept = statistics.median(fresh[1:]), statistics.median(kept[1:])
    table.add(name, f"{params / 1e6:,.0f} M", f"{later_fresh:.2f} s", f"{opened:.2f} s", f"{later_kept:.2f} s",
              f"{later_fresh / later_kept:.1f}×", f"{statistics.median(fresh_steps) * 1e3:.0f} ms",
              f"{statistics.median(kept_steps) * 1e3:.0f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--large", action="store_true", help="also the ~1 B model on meta from a checkpoint")
    args = parser.parse_args()
    t = Table(["model", "parameters", f"fresh fit({STEPS})", "session start", f"session fit({STEPS})",
               "fresh / session", "step, fresh", "step, session"], align="lrrrrrrr")
    t.title = (f"{CALLS} calls of fit(steps={STEPS}) under {PLAN} in 2 processes: wall time of a call (median of the "
               "calls after the first) and the step inside (median)")
    measure("llama-tiny", small, t)
    if args.large:
        folder = Path(tempfile.mkdtemp(prefix="nbtrain-bench-1b-"))
        try:
            measure("LoRA on a LLaMA-shaped ~1 B, on meta, weights= its base's folder", lambda: large(folder), t)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    t.footer.append(f"{time.strftime('%Y-%m-%d')}, torch {torch.__version__}, batches of 4 × 16 tokens")
    print(t)


if __name__ == "__main__":
    main()
