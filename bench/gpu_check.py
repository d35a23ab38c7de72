"""Every GPU path of nbtrain, checked once, the first time a GPU machine is at hand: one table, pass or fail.

    PYTHONPATH=. python bench/gpu_check.py                  # the GPU machine: ~4 min on one H200 (budget: 8)
    PYTHONPATH=. OUT=results python bench/gpu_check.py      # also results/gpu_check.md and results/gpu_check.json
    PYTHONPATH=. python bench/gpu_check.py --device cpu     # the same parts on the CPU, tiny models: ~10 s, 2 cores
    PYTHONPATH=. python bench/gpu_check.py --parts 3,5      # some parts only (to rerun one that failed)

stdout holds only the markdown table (part, what, measured, predicted, ratio, status); progress, and whatever nbtrain,
torch and the workers print, goes to stderr. $OUT gets the rows so far after each part (a run killed at the device's
time limit leaves them). Exit 0 when every row passed or was skipped with its reason, 1 when a row FAILED (with the
exception's first line; the traceback is on stderr), 2 when no GPU is visible and ``--device cpu`` was not given.
Needs only torch, accelerate and transformers: no notebook package.

1. **Environment**: torch, transformers, accelerate, CUDA, the devices, NCCL, the date.
2. **Calibration**: ``nbtrain.Cluster.detect()`` (CUDA: GPU 0's bf16 matmul rate, pinned host↔device copy, the
   slower way, CPU AdamW on every host thread) beside the datasheet figures of ``Cluster.detect(calibrate=False)``;
   on CUDA, GPU 0's memory streaming a 1 GiB copy (``calibrate.memory_bandwidth``) beside the catalog's
   HBM bandwidth × its streaming fraction (SKIPPED with ``--device cpu``).
3. **fit on one device**: ``nbtrain.fit(num_processes=1, cluster=<part 2's>)`` of a transformers ``LlamaForCausalLM``
   of 1.06 B parameters (hidden 2048, FFN 5632, 18 layers, 16 heads, vocab 32000: 16 GiB of fp32 AdamW state),
   4 × 1024 tokens a step, 4 steps, under ``dp_replicate=1`` (no parallelism), ``ac``, bf16, ``offload=1`` and
   ``offload=0.5``. Step time: ``FitResult.measured_step_s`` (median after the first). **MFU** = 6 · parameters
   (all, embeddings too) · tokens/s ÷ ``Cluster.peak_flops``, which on a GPU is the catalog's dense bf16 datasheet
   peak (989.4 TFLOP/s on H100/H200; ``detect()`` keeps it and stores measured/peak as ``flops_efficiency``) for
   the fp32 rows too, which therefore read low by design (TF32 is off: an H200 computes fp32 at ~67 TFLOP/s); on
   the CPU it is the measured one-thread fp32 matmul rate. Memory: the largest ``StepRecord.tensor_bytes`` (on a
   GPU the allocator's peak). A row fails on a non-finite loss, or a peak below the fp32 weights (the model did not
   train on the device).
4. **Offload schedules on the device** (bench/offload.py's, on the CPU there): a 0.54 B Llama (8 layers) on the
   device under ``OffloadedAdamW.from_model``: no offload, ZeRO-Offload (``offload=1, schedule="after_backward",
   land_at="step"``), CoTrain (``offload=1, schedule="overlap", land_at="forward"``); one CPU update thread as
   ``fit`` has it, no clipping, each from the same weights and batches. Median step after 2 warm-up steps,
   ZeRO-Offload's step over CoTrain's; the three runs' losses must agree within a relative 1e-3.
5. **Correctness**: a tiny Llama trained 5 steps by ``fit(num_processes=1)`` on the device (TF32 off) against a
   plain PyTorch loop on the CPU, same weights and batches, with fit's own defaults (lr, betas, eps, weight decay,
   clip norm: read from its signature): losses within a relative 1e-4 per step, weights within 1e-2 of the
   distance trained (``nbtrain.verify``'s tolerances).
6. **Multi-GPU plans**: ``nbtrain.verify("llama-tiny", plan, processes=...)`` for DDP, FSDP2, TP, PP (2 GPUs) and
   ``dp_shard=2 tp=2`` (4 GPUs); one SKIPPED row with one GPU; DDP and FSDP2 in 2 processes with ``--device cpu``.
   It runs first: its workers are forked, which a CUDA context in this process would forbid.

Budget on one H200 (estimated, not yet measured): start 15 s, calibration 10 s, part 3 ~2.5 min (each fit deep-copies
and profiles the 1 B model, trains 4 steps and brings the weights back to the CPU), part 4 ~40 s, part 5 10 s.

torch APIs called here directly (the GPU machine may bring torch 2.11): ``torch.__version__``, ``torch.version.cuda``,
``torch.cuda.device_count / get_device_name / synchronize / reset_peak_memory_stats / empty_cache``,
``torch.cuda.nccl.version``, ``torch.backends.cuda.matmul.allow_tf32`` and ``torch.backends.cudnn.allow_tf32``
(2.9+ may warn that they will be deprecated; see :func:`true_fp32`), ``torch.manual_seed``,
``torch.Generator``, ``torch.randint``, ``torch.roll``, ``torch.optim.AdamW``, ``torch.nn.utils.clip_grad_norm_``,
``torch.get_num_threads``. With ``--device cpu`` CUDA_VISIBLE_DEVICES is emptied before torch is imported: CUDA is
never initialised.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import inspect
import json
import math
import os
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

if "--device=cpu" in sys.argv or ["--device", "cpu"] in [sys.argv[i:i + 2] for i in range(len(sys.argv))]:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch is imported: it never sees, nor initialises, a GPU
os.environ.setdefault("NBTRAIN_NONINTERACTIVE", "1")  # no progress bars
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP: no spinning beside the offload

import torch  # noqa: E402

import nbtrain  # noqa: E402
from nbtrain.profiler.calibrate import memory_bandwidth  # noqa: E402
from nbtrain.profiler.catalog import local_gpus  # noqa: E402
from nbtrain.profiler.model import lm_loss  # noqa: E402
from nbtrain.run.offload.optimizer import OffloadedAdamW  # noqa: E402
from nbtrain.units import format_bytes, format_count, format_rate, format_seconds  # noqa: E402

LOSS_RTOL, WEIGHT_RTOL, SCHEDULE_RTOL = 1e-4, 1e-2, 1e-3
LLAMA_1B = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=18,
                num_attention_heads=16, num_key_value_heads=16)
LLAMA_TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)
FIT_PLANS = [("no parallelism", "dp_replicate=1", "fp32"), ("ac", "ac", "fp32"), ("bf16", "dp_replicate=1", "bf16"),
             ("offload=1", "offload=1", "fp32"), ("offload=0.5", "offload=0.5", "fp32")]
SCHEDULES = {"no offload": (0.0, "overlap", "forward"), "ZeRO-Offload": (1.0, "after_backward", "step"),
             "CoTrain overlap": (1.0, "overlap", "forward")}  # offload, schedule, land_at (bench/offload.py's)
VERIFY_PLANS = [("DDP", "dp_replicate=2", 2), ("FSDP2", "dp_shard=2", 2), ("TP", "tp=2", 2), ("PP", "pp=2 mb=2", 2),
                ("2-D", "dp_shard=2 tp=2", 4)]


@dataclass(frozen=True)
class Workload:
    """The sizes of the parts on one kind of device: part 3's model (``big``), part 4's, part 5's (``small``)."""

    big: dict
    offload_model: dict
    small: dict
    batch: int
    seq: int
    fit_steps: int
    offload_warmup: int
    offload_steps: int
    small_steps: int = 5
    verify_steps: int = 5
    timeout_s: float = 300.0


GPU = Workload(LLAMA_1B, {**LLAMA_1B, "num_hidden_layers": 8}, LLAMA_TINY, batch=4, seq=1024, fit_steps=4,
               offload_warmup=2, offload_steps=4)
CPU = Workload(LLAMA_TINY, LLAMA_TINY, LLAMA_TINY, batch=4, seq=32, fit_steps=3, offload_warmup=1, offload_steps=2,
               small_steps=3, verify_steps=3, timeout_s=180.0)


@dataclass
class Row:
    """One line of the table."""

    part: str
    what: str
    measured: str = ""
    predicted: str = ""
    ratio: str = ""
    status: str = "PASS"
    """PASS, ``SKIPPED: why`` or ``FAILED: what`` (an exception's first line)."""

    @property
    def ok(self) -> bool:
        return self.status == "PASS" or (self.status.startswith("SKIPPED:") and bool(self.status[8:].strip()))


@dataclass
class Setup:
    """What the parts share."""

    device: str
    work: Workload
    cluster: nbtrain.Cluster | None = None
    """Part 2's calibrated cluster; None when part 2 did not run or failed (no predictions then)."""
    started: float = field(default_factory=time.perf_counter)


class CheckFailed(Exception):
    """A check ran, but what it measured is wrong."""


def say(setup: Setup, message: str) -> None:
    print(f"[{time.perf_counter() - setup.started:6.1f} s] {message}", file=sys.stderr, flush=True)


def checked(setup: Setup, part: str, what: str, check, *args) -> list[Row]:
    """``check(*args)``'s row(s), or one FAILED row with the exception's first line (its traceback to stderr)."""
    say(setup, f"part {part}: {what} ...")
    started = time.perf_counter()
    try:
        rows = check(*args)
        rows = rows if isinstance(rows, list) else [rows]
    except Exception as error:  # one failure is one row: the other checks still run
        traceback.print_exc(file=sys.stderr)
        first = (str(error).strip().splitlines() or [""])[0]
        rows = [Row(part, what, status=f"FAILED: {type(error).__name__}: {first}"[:300])]
    gc.collect()
    if setup.device == "cuda":
        torch.cuda.empty_cache()
    say(setup, f"part {part}: {what}: {', '.join(r.status for r in rows)} ({time.perf_counter() - started:.1f} s)")
    return rows


def llama(shape: dict, seq: int):
    """A ``LlamaForCausalLM`` on the CPU, seeded, dropout off (Llama's default), no KV cache, untied head."""
    from transformers import LlamaConfig, LlamaForCausalLM  # heavy: only when a part needs a model

    torch.manual_seed(0)
    config = LlamaConfig(**shape, max_position_embeddings=seq, tie_word_embeddings=False, use_cache=False)
    return LlamaForCausalLM(config).train()


def token_batches(vocab: int, batch: int, seq: int, n: int = 2, device: str = "cpu") -> list[tuple]:
    """``n`` fixed ``(ids, next-token targets)`` batches."""
    g = torch.Generator().manual_seed(7)
    ids = [torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(n)]
    return [(x.to(device), torch.roll(x, -1, dims=1).to(device)) for x in ids]


def num_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


# -- parts 1 and 2: the machine ------------------------------------------------------------------------------------

def environment(setup: Setup) -> list[Row]:
    import accelerate
    import transformers

    cuda, not_used = setup.device == "cuda", "SKIPPED: --device cpu does not use CUDA"
    nccl = torch.cuda.nccl.version() if cuda else ""  # a tuple, (2, 21, 5); older torch gave an int
    return [Row("1", "torch", f"torch {torch.__version__} · transformers {transformers.__version__} · accelerate "
                              f"{accelerate.__version__} · python {sys.version.split()[0]}"),
            Row("1", "CUDA", str(torch.version.cuda) if cuda else "", status="PASS" if cuda else not_used),
            Row("1", "devices", f"{torch.cuda.device_count()} × {torch.cuda.get_device_name(0)}" if cuda else
                f"CPU: {len(os.sched_getaffinity(0))} cores, {torch.get_num_threads()} torch threads"),
            Row("1", "NCCL", ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
                status="PASS" if cuda else not_used),
            Row("1", "date", datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))]


def calibration(setup: Setup) -> list[Row]:
    """``Cluster.detect()`` beside the datasheet's figures; part 3 predicts with the calibrated cluster."""
    catalog, measured = nbtrain.Cluster.detect(calibrate=False), nbtrain.Cluster.detect()
    setup.cluster = measured
    rows = [Row("2", "cluster", measured.summary())]
    for what, name, unit in (("matmul, sustained", "sustained_flops", "FLOP/s"),
                             ("host ↔ device copy, slower way", "host_to_device_bandwidth", "B/s"),
                             ("CPU AdamW", "cpu_optimizer_rate", " params/s")):
        got, sheet = getattr(measured, name), getattr(catalog, name)
        note = f" (peak {format_rate(catalog.peak_flops, unit)})" if unit == "FLOP/s" else ""
        rows.append(Row("2", what, format_rate(got, unit), f"catalog {format_rate(sheet, unit)}{note}",
                        f"{got / sheet:.2f}"))
    if setup.device != "cuda":  # the CPU "device" has no memory of its own to stream: it is timed by layer
        return rows + [Row("2", "device memory, streaming copy", status="SKIPPED: --device cpu has no GPU memory")]
    got = memory_bandwidth(setup.device)  # what compute_time prices memory-bound kernels by
    sheet = catalog.memory_bandwidth * catalog.memory_efficiency
    rows.append(Row("2", "device memory, streaming copy", format_rate(got.value, "B/s"),
                    f"catalog {format_rate(sheet, 'B/s')} (datasheet {format_rate(catalog.memory_bandwidth, 'B/s')})",
                    f"{got.value / sheet:.2f}" if sheet else ""))
    return rows


# -- part 3: fit on one device -------------------------------------------------------------------------------------

def fit_row(setup: Setup, model, data, name: str, plan: str, precision: str) -> Row:
    """One plan through ``nbtrain.fit`` on one device: time, throughput, MFU, memory, beside the prediction."""
    work, cluster, params = setup.work, setup.cluster, num_params(model)
    if setup.device == "cuda":
        torch.cuda.reset_peak_memory_stats()  # an earlier fit's peak must not count
    result = nbtrain.fit(model, data, plan=plan, steps=work.fit_steps, num_processes=1, precision=precision,
                         cluster=cluster, progress=False, timeout=work.timeout_s)
    if not all(math.isfinite(x) for x in result.losses):
        raise CheckFailed(f"losses {result.losses}")
    peak = max((r.tensor_bytes for r in result.records if r.tensor_bytes is not None), default=0)
    if peak < 4 * params:
        raise CheckFailed(f"peak tensor memory {format_bytes(peak)} is below the fp32 weights' "
                          f"{format_bytes(4 * params)}: the model did not train on {setup.device}")
    step = result.measured_step_s
    tokens_s = work.batch * work.seq / step
    mfu = f" · MFU {6 * params * tokens_s / cluster.peak_flops:.1%}" if cluster is not None else ""
    row = Row("3", f"fit {name} ({plan}, {precision})",
              f"{format_seconds(step)} · {tokens_s:,.0f} tok/s{mfu} · {format_bytes(peak)}")
    if result.predicted_step_s is not None:
        row.predicted = f"{format_seconds(result.predicted_step_s)} · {format_bytes(result.predicted_memory_bytes)}"
        row.ratio = f"time {step / result.predicted_step_s:.2f} · memory {peak / result.predicted_memory_bytes:.2f}"
    return row


def fit_plans(setup: Setup) -> list[Row]:
    work = setup.work
    model = llama(work.big, work.seq)  # built once: each fit trains a deep copy and loads its weights back
    data = token_batches(model.config.vocab_size, work.batch, work.seq)
    say(setup, f"part 3: Llama of {format_count(num_params(model))} parameters, {work.batch} × {work.seq} tokens")
    return [row for name, plan, precision in FIT_PLANS
            for row in checked(setup, "3", f"fit {name}", fit_row, setup, model, data, name, plan, precision)]


# -- part 4: offload schedules on the device -----------------------------------------------------------------------

def schedule_run(setup: Setup, model, initial: dict, data, name: str) -> tuple[float, list[float]]:
    """Median step seconds after the warm-up, and every step's loss, of one offload schedule from ``initial``."""
    offload, schedule, land_at = SCHEDULES[name]
    work = setup.work
    model.load_state_dict(initial)
    times, losses = [], []
    with OffloadedAdamW.from_model(model, offload, lr=1e-4, schedule=schedule, land_at=land_at) as optimizer:
        for step in range(work.offload_warmup + work.offload_steps):
            ids, targets = data[step % len(data)]
            started = time.perf_counter()
            optimizer.zero_grad()
            loss = lm_loss(model(ids), targets)
            loss.backward()
            optimizer.step()
            if setup.device == "cuda":
                torch.cuda.synchronize()  # the step ends when the device is done (the CPU's updates may run on)
            times.append(time.perf_counter() - started)
            losses.append(loss.detach())
    return statistics.median(times[work.offload_warmup:]), [float(x) for x in losses]


def offload_schedules(setup: Setup) -> list[Row]:
    work = setup.work
    model = llama(work.offload_model, work.seq)
    initial = copy.deepcopy(model.state_dict())
    model.to(setup.device)
    data = token_batches(model.config.vocab_size, work.batch, work.seq, device=setup.device)
    say(setup, f"part 4: Llama of {format_count(num_params(model))} parameters on {setup.device}")
    runs, rows = {}, []

    def run(name: str) -> Row:
        runs[name] = schedule_run(setup, model, initial, data, name)
        base = runs.get("no offload")
        return Row("4", f"schedule {name}", f"{format_seconds(runs[name][0])} a step",
                   ratio=f"{runs[name][0] / base[0]:.2f} of no offload" if base else "")

    for name in SCHEDULES:
        rows += checked(setup, "4", f"schedule {name}", run, name)
    return rows + checked(setup, "4", "ZeRO-Offload ÷ CoTrain", compare_schedules, runs)


def compare_schedules(runs: dict) -> Row:
    missing = [name for name in SCHEDULES if name not in runs]
    if missing:
        raise CheckFailed(f"no steps of {', '.join(missing)} to compare (failed above)")
    zero, cotrain = runs["ZeRO-Offload"], runs["CoTrain overlap"]
    apart = max(relative(a, b) for _, losses in runs.values() for a, b in zip(losses, cotrain[1]))
    row = Row("4", "ZeRO-Offload ÷ CoTrain step", f"{zero[0] / cotrain[0]:.2f}×; losses within {apart:.1e}",
              f"losses within {SCHEDULE_RTOL:.0e}", f"{zero[0] / cotrain[0]:.2f}")
    if not apart <= SCHEDULE_RTOL:
        row.status = f"FAILED: the schedules' losses differ by a relative {apart:.1e}"
    return row


# -- parts 5 and 6: correctness ------------------------------------------------------------------------------------

def reference_losses(model, data, steps: int) -> list[float]:
    """Plain PyTorch on the CPU, with the optimizer ``fit`` builds by default (read from ``nbtrain.Optimizer()``)."""
    default = asdict(nbtrain.Optimizer())
    decay_1d = default["decay_norms_and_biases"]
    groups = [{"params": [p for p in model.parameters() if p.ndim >= 2 or decay_1d]},
              {"params": [p for p in model.parameters() if p.ndim < 2 and not decay_1d], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=default["lr"], betas=default["betas"],
                                  eps=default["eps"], weight_decay=default["weight_decay"])
    losses = []
    for step in range(steps):
        ids, targets = data[step % len(data)]
        loss = lm_loss(model(ids), targets)
        loss.backward()
        if default["clip_norm"] is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), default["clip_norm"])
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def fit_matches_plain_loop(setup: Setup) -> Row:
    steps = setup.work.small_steps
    model = llama(setup.work.small, 32)
    initial, reference = copy.deepcopy(model.state_dict()), copy.deepcopy(model)
    data = token_batches(model.config.vocab_size, 4, 32, n=3)
    expected = reference_losses(reference, data, steps)
    got = nbtrain.fit(model, data, plan="dp_replicate=1", steps=steps, num_processes=1, progress=False,
                      timeout=setup.work.timeout_s).losses
    loss_apart = max(relative(a, b) for a, b in zip(got, expected))
    trained, ref = model.state_dict(), reference.state_dict()
    apart = sum(float((trained[k].cpu() - ref[k]).double().square().sum()) for k in ref) ** 0.5
    moved = sum(float((ref[k] - initial[k]).double().square().sum()) for k in ref) ** 0.5
    row = Row("5", f"fit on {setup.device} vs plain loop on cpu ({steps} steps)",
              f"losses within {loss_apart:.1e}; weights {apart / moved:.1e}",
              f"losses ≤ {LOSS_RTOL:.0e}; weights ≤ {WEIGHT_RTOL:g}")
    if len(got) != len(expected) or not loss_apart <= LOSS_RTOL or not apart / moved <= WEIGHT_RTOL:
        row.status = f"FAILED: fit's losses {got} vs the plain loop's {expected}; weights {apart / moved:.1e}"
    return row


def verify_row(setup: Setup, name: str, plan: str, processes: int) -> Row:
    report = nbtrain.verify("llama-tiny", plan, processes=processes, steps=setup.work.verify_steps,
                            timeout=setup.work.timeout_s)
    row = Row("6", f"verify {name}: {plan} ({processes} processes)",
              f"losses within {max(report.loss_differences):.1e}; weights {report.weight_difference:.1e}",
              f"losses ≤ {LOSS_RTOL:.0e}; weights ≤ {WEIGHT_RTOL:g}")
    if not report.ok:
        row.status = f"FAILED: {report.verdict()}"
    return row


def multi_device_plans(setup: Setup) -> list[Row]:
    gpus = local_gpus()  # through NVML: CUDA stays uninitialised in this process, for the forked workers
    if setup.device == "cuda" and gpus < 2:
        return [Row("6", "DDP, FSDP2, TP, PP, 2-D plans", status=f"SKIPPED: {gpus} GPU present, these need 2+")]
    plans = [(name, plan, n) for name, plan, n in VERIFY_PLANS
             if (n <= gpus if setup.device == "cuda" else name in ("DDP", "FSDP2"))]
    return [row for name, plan, n in plans
            for row in checked(setup, "6", f"verify {name}", verify_row, setup, name, plan, n)]


# -- the run -------------------------------------------------------------------------------------------------------

PARTS = {"6": multi_device_plans, "1": environment, "2": calibration, "3": fit_plans, "4": offload_schedules,
         "5": fit_matches_plain_loop}  # in the order they run: 6 first, before anything initialises CUDA here


def markdown(rows: list[Row]) -> str:
    lines = ["| part | what | measured | predicted | ratio | status |", "|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(str(v).replace("|", "\\|") for v in asdict(row).values()) + " |" for row in rows]
    return "\n".join(lines)


def write_out(rows: list[Row]) -> None:
    """``$OUT/gpu_check.md`` and ``$OUT/gpu_check.json``, when OUT is set."""
    if os.environ.get("OUT"):
        out = Path(os.environ["OUT"])
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_check.md").write_text(markdown(rows) + "\n")
        (out / "gpu_check.json").write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")


@contextlib.contextmanager
def table_stream():
    """A stream to the real stdout, for the table; meanwhile fd 1 goes to stderr, so that whatever else is printed
    (nbtrain's launch lines, torch's warnings, forked workers, C++) stays out of the table; fd 1 is put back after."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with os.fdopen(os.dup(saved), "w") as stream:
            yield stream
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def true_fp32() -> None:
    """TF32 off for matmuls and convolutions (fp32 computes in fp32): part 5 compares with the CPU. The legacy flags:
    torch 2.9+ may warn about them, but once its new ``fp32_precision`` flags are set, reading ``allow_tf32`` raises
    ("a mix of the legacy and new APIs", pytorch/pytorch#179445), and a library may still read it."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def run_parts(setup: Setup, asked: set[str]) -> list[Row]:
    """The asked parts in ``PARTS``' order; after each, the rows so far go to $OUT."""
    rows: list[Row] = []
    for part, check in PARTS.items():
        if part in asked:
            rows = sorted(rows + checked(setup, part, check.__name__.replace("_", " "), check, setup),
                          key=lambda row: row.part)  # stable: each part's rows in the order they ran
            write_out(rows)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), help="cuda (the default) or cpu (tiny models, for CI)")
    parser.add_argument("--parts", default="1,2,3,4,5,6", help="comma-separated parts to run (default: all)")
    args = parser.parse_args(argv)
    asked = {p.strip() for p in args.parts.split(",")}
    if not asked <= set(PARTS):
        parser.error(f"--parts takes some of 1,2,3,4,5,6, got {args.parts!r}")
    device = args.device or "cuda"
    if device == "cuda" and not local_gpus():  # NVML: CUDA must stay uninitialised here until part 6 has forked
        print("gpu_check: no GPU is visible here; pass --device cpu to run the same check on the CPU with tiny "
              "models", file=sys.stderr)
        return 2
    if device == "cuda":
        true_fp32()  # before part 6: its forked workers inherit the setting
    setup = Setup(device, GPU if device == "cuda" else CPU)
    with table_stream() as stream:
        rows = run_parts(setup, asked)
        print(markdown(rows), file=stream, flush=True)
    failed = [row for row in rows if not row.ok]
    say(setup, f"done: {len(rows)} rows, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
