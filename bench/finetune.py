"""nbtrain's planner beside published fine-tuning runs: torchtune's README table (issue 42, point 5).

    PYTHONPATH=. python bench/finetune.py        # 2.5-3.5 min on 2 cores: profiling two 70B shapes and an 8B on meta

The sibling of ``bench/published.py`` (pre-training runs). Each published row is built as the run was configured:
the model's shape with transformers on the meta device (Llama 3.1 8B and 70B: Meta's published sizes), peft's LoRA
on exactly the projections torchtune's config names, ``nbtrain.profile`` at the run's per-GPU batch, then

* (a) the published configuration written as an nbtrain plan, priced by ``nbtrain.estimate``: fits, predicted
  memory and tokens/s beside the published ones; and
* (b) nbtrain's own recommendation for the same model, devices and batch (``nbtrain.plan``).

Rows nbtrain cannot model are printed with the reason, never left out. The target (issue 42): every modelled row
within 0.8-1.25 of the published tokens/s, every published run predicted to fit. Nothing here is tuned to it: the
device figures are the catalog's (``nbtrain/profiler/catalog.py``), with their sources.

Source: github.com/pytorch/torchtune, README.md "Memory and training speed" (added in 30b8519e8, Sep 2024; read
at 0031bfb08): "all the below numbers are provided for batch size 2 (without gradient accumulation), a dataset
packed to sequence length 2048, and torch compile enabled"; "Tokens/sec: Measured over one full training epoch";
the 70B full fine-tune "Uses CPU offload with fused optimizer". The configurations, from
``recipes/configs/llama3_1/`` at 0031bfb08:

* ``70B_lora.yaml``: LoRA rank 16, alpha 32, on ``q_proj``, ``k_proj``, ``v_proj`` (not the output projection,
  not the MLP, not the head); FSDP2 over 8 (``lora_finetune_distributed``: every layer ``fully_shard``-ed,
  ``reshard_after_forward`` True: ZeRO-3), activation checkpointing, AdamW(fused=True), bf16, no clipping.
* ``70B_full.yaml``: FSDP2 over 8 with ``fsdp_cpu_offload: True`` (FSDP2's ``CPUOffloadPolicy``: parameters,
  gradients and optimizer state on the CPU, the step after backward), activation checkpointing, AdamW(fused=True)
  on the CPU with every core (``training.set_torch_num_threads``), bf16, no clipping.
* ``8B_lora_single_device.yaml``: LoRA rank 8, alpha 16, on ``q_proj`` and ``v_proj``; activation checkpointing,
  AdamW(fused=True), bf16 (its ``gradient_accumulation_steps: 64`` is overridden: the README says none).
* ``8B_full_single_device.yaml``: bitsandbytes ``PagedAdamW8bit`` with ``optimizer_in_bwd: True``.
* torchtune trains in bf16 throughout: "When ``dtype=bf16``, all activations, gradients and optimizer states are
  in bfloat16" (``full_finetune_distributed.py``'s docstring): 8 bytes of model state a trained parameter where
  nbtrain (mixed precision, an fp32 master) holds 16, and a CPU update that moves 14 bytes a parameter, not 28.

Per GPU, or the whole job's? torchtune logs ``tokens_per_second_per_gpu`` (one rank's tokens over the step), but
the README's 70B numbers cannot be per GPU. A LoRA step on a frozen base computes the forward (2N FLOPs a token),
the input gradients (2N; no weight gradients) and, checkpointed, the forward again (2N): 6 × 70.6e9 = 4.2e11
FLOPs a token. At 3,497 tokens/s per GPU that is 1.48 PFLOP/s on each A100, 4.7 times its 312 TFLOP/s bf16 peak.
As the job's, 437 tokens/s a GPU, 185 TFLOP/s, 59% of peak: possible. Likewise the full fine-tune (8N with
checkpointing): 1,568 per GPU would need 886 TFLOP/s; as the job's, 111 (35%). So the 70B figures are the job's
(8 GPUs); the 8B rows run on one GPU, where the two agree. The table prints the job's tokens/s.

Which A100: the README says "8x A100"; the table it replaced (same commit) had a 70B full fine-tune peaking at
70.4 GB per GPU on 8 × A100, so torchtune's A100s are the 80 GB part.

Published memory is torchtune's logged peak (the allocator's, its ``get_memory_stats``); nbtrain's prediction is
printed as the model's bytes (parameters, gradients, optimizer state, activations, the largest transient) and, in
brackets, what nbtrain reserves besides on a GPU (CUDA context, NCCL buffers, 10% allocator headroom), which
"fits" counts.

Every row is profiled with torchtune's loss as nbtrain runs it: ``ChunkedLMLoss`` in 8 chunks (torchtune's
``CEWithChunkedOutputLoss``), which never holds the whole logits in fp32.

What nbtrain does not model and these runs had (``bench/RESULTS.md`` has the arithmetic for each row):
torch.compile, which fuses the memory-bound ops nbtrain prices one eager kernel each (the "memory-bound" column is
the most it could remove); FSDP2's CPU offload of parameters and
gradients (nbtrain's offload moves the optimizer update only); bf16 optimizer state (nbtrain keeps an fp32 master:
its host update moves 28 bytes a parameter where torchtune's moves 14). The host's AdamW rate on a DGX A100 is the
catalog's (``DGX_A100_ADAMW``, issue 45: its memory bandwidth over 28 bytes a parameter, 10.6 G params/s a node;
2.8 before, one thread a socket), derived from the host's datasheets and a STREAM measurement, not from this table.
"""

from __future__ import annotations

import sys
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import nbtrain  # noqa: E402
from nbtrain.errors import NbtrainError  # noqa: E402
from nbtrain.planner.compute_time import layer_work  # noqa: E402
from nbtrain.planner.cost import CostOptions, estimate  # noqa: E402
from nbtrain.planner.plan import Plan  # noqa: E402
from nbtrain.table import Table  # noqa: E402

GiB = 2**30
SEQ = 2048
PER_GPU_BATCH = 2
# Meta's Llama 3.1 model cards / params.json: 8B dim 4096, 32 layers, 32 heads, 8 KV heads, FFN 14336; 70B 8192,
# 80, 64/8, 28672; vocabulary 128256, RoPE theta 500000, RMSNorm eps 1e-5, untied head.
SHAPES = {"8B": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, intermediate_size=14336),
          "70B": dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, intermediate_size=28672)}
# torchtune's LoRA targets (its names: q_proj, k_proj, v_proj, output_proj; MLP w1/w2/w3) in transformers' names
LORA = {"70B": dict(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj"]),     # 70B_lora.yaml
        "8B": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])}                 # 8B_lora_single_device
# How torchtune ran them (module docstring): bf16 gradients reduced as they are, no clipping, FSDP2's CPU offload
# steps after backward (ZeRO-Offload's schedule, not CoTrain's overlap)
TORCHTUNE = CostOptions(clip=False, grad_reduce_bytes=2, offload_overlap=False)
# torchtune's loss, CEWithChunkedOutputLoss (every config here): the logits in 8 chunks along the sequence, each upcast
# and taken on its own, as nbtrain's ChunkedLMLoss does: 2 rows × 2048 / 8 = 512 tokens a chunk
CHUNKED = nbtrain.ChunkedLMLoss(chunk_tokens=PER_GPU_BATCH * SEQ // 8)


@dataclass(frozen=True)
class Run:
    model: str
    method: str
    gpu: str
    """the catalog's name for the README's device"""
    gpus: int
    memory: str
    """published peak memory per GPU, as the README writes it"""
    tokens_per_s: float
    """published, the job's (module docstring)"""
    plan: str
    """the published configuration in nbtrain's grammar, or "not modelled: ..." """
    why: str = ""
    """why it is not modelled, or how its plan was read"""

    @property
    def global_batch(self) -> int:
        return PER_GPU_BATCH * self.gpus


EIGHT_BIT = ("bitsandbytes PagedAdamW8bit (1-byte moments, paged to the host when the GPU runs short) stepped "
             "inside backward (optimizer_in_bwd), 8B_full_single_device.yaml; nbtrain prices AdamW in fp32 after "
             "backward")
FOUR_BIT = "QLoRA's base weights in 4-bit NF4; nbtrain holds every weight in the compute dtype"
RUNS = [
    Run("Llama 3.1 8B", "full", "RTX4090", 1, "18.9 GiB", 1650, "not modelled: 8-bit optimizer in backward",
        EIGHT_BIT),
    Run("Llama 3.1 8B", "full", "A6000", 1, "37.4 GiB", 2579, "not modelled: 8-bit optimizer in backward",
        EIGHT_BIT),
    Run("Llama 3.1 8B", "LoRA", "RTX4090", 1, "16.2 GiB", 3083, "ac"),
    Run("Llama 3.1 8B", "LoRA", "A6000", 1, "30.3 GiB", 4699, "ac"),
    Run("Llama 3.1 8B", "LoRA", "A6000", 1, "30.3 GiB", 4699, "dp_replicate=1",
        "the same run without checkpointing: its 30.3 GiB against the 4090's 16.2 with the same config says it "
        "was off"),
    Run("Llama 3.1 8B", "QLoRA", "RTX4090", 1, "7.4 GiB", 2413, "not modelled: 4-bit base", FOUR_BIT),
    Run("Llama 3.1 70B", "full, CPU offload", "A100-80GB", 8, "13.9 GiB", 1568, "dp_shard=8 ac offload=1",
        "FSDP2's CPU offload keeps parameters and gradients on the host too (copied up for every gather); "
        "nbtrain's offload moves the optimizer update only, so nbtrain's run holds them on the GPU"),
    Run("Llama 3.1 70B", "LoRA", "A100-80GB", 8, "27.6 GiB", 3497, "dp_shard=8 ac"),
    Run("Llama 3.1 405B", "QLoRA", "A100-80GB", 8, "44.8 GB", 653, "not modelled: 4-bit base", FOUR_BIT),
]


def build(size: str, lora: bool):
    """The model's shape on the meta device, with torchtune's LoRA applied as peft applies it."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128256, num_key_value_heads=8, max_position_embeddings=131072,
                         rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, use_cache=False,
                         **SHAPES[size])
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    return get_peft_model(model, LoraConfig(lora_dropout=0.0, **LORA[size])) if lora else model


_profiles: dict = {}


def profile_of(run: Run):
    """Each (model, method) profiled once a run of this script: a 70B shape takes ~40-100 s here."""
    size, lora = run.model.split()[-1], "LoRA" in run.method
    key = (size, lora)
    if key not in _profiles:
        _profiles[key] = nbtrain.profile(build(size, lora), batch_size=PER_GPU_BATCH, seq_len=SEQ, dtype="bf16",
                                         name=f"Llama 3.1 {size}" + (" LoRA" if lora else ""), loss_fn=CHUNKED)
    return _profiles[key]


def by_kernel_class(prof, plan: Plan, cluster) -> dict[str, float]:
    """One GPU's step under ``plan`` as the cost model's kernel classes see it (:mod:`nbtrain.planner.compute_time`):
    the FLOPs its matmuls and fused attention compute (forward, backward — input gradients only for a frozen
    weight — and the forward again where a layer is checkpointed; causal attention halved), and the seconds of
    each class at the catalog's rates. The memory-bound ops (norms, activations, RoPE, residual adds, casts, the
    loss) are what torch.compile fuses; matmuls and attention it leaves to cuBLAS and the flash kernel."""
    m = plan.microbatches
    out = dict(flops=0.0, matmul_s=0.0, attention_s=0.0, memory_s=0.0)
    bandwidth = cluster.memory_bandwidth * cluster.memory_efficiency
    for layer, s in zip(prof.layers, plan.layers):
        fwd, bwd = layer_work(layer, plan.global_batch / (m * s.dp), SEQ)
        for work in (fwd, bwd) + ((fwd,) if s.ac else ()):
            out["flops"] += m * (work.matmul_flops + work.attention_flops)
            out["matmul_s"] += m * max(work.matmul_flops / cluster.sustained_flops, work.matmul_bytes / bandwidth)
            out["attention_s"] += m * work.attention_flops / (cluster.peak_flops * (
                cluster.attention_efficiency or cluster.flops_efficiency))
            out["memory_s"] += m * work.memory_bytes / bandwidth
    return out


def plan_text(best) -> str:
    """A recommended plan as its grammar writes it, or its one-line summary where that is long (a per-layer mix)."""
    text = str(best)
    return text if len(text) <= 40 else best.summary().split(": ", 1)[1].rsplit(" · fits", 1)[0]


def gib(pred) -> str:
    reserve = max(stage.memory.reserve for stage in pred.stages)
    return f"{(pred.memory_bytes - reserve) / GiB:.1f} (+{reserve / GiB:.1f})"


def main() -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' deprecation notes while profiling
    started = time.perf_counter()
    table = Table(["model", "method", "devices", "published", "pub tok/s", "of peak", "plan", "fits",
                   "pred GiB (+reserve)", "pred tok/s", "pred/pub"],
                  title="nbtrain beside torchtune's published fine-tuning runs (batch 2 × 2048 a GPU; tok/s: the "
                        "job's; of peak: the FLOPs the published rate implies, over the GPUs' bf16 peak)")
    parts = Table(["model", "method", "devices", "plan", "published", "predicted", "matmuls", "attention",
                   "memory-bound", "FSDP gathers", "CPU update", "exposed"],
                  title="One step, published and predicted (s): the predicted compute by kernel class, FSDP's "
                        "gathers not hidden, the host's AdamW and what of it the step waits for")
    own = Table(["model", "method", "devices", "nbtrain's recommendation", "fits", "pred GiB (+reserve)",
                 "pred tok/s", "/ published"], title="nbtrain's own recommendation for the same model, devices "
                                                    "and batch (nbtrain.plan)")
    notes, recommended = [], set()
    for run in RUNS:
        devices = f"{run.gpus} × {run.gpu}"
        if run.plan.startswith("not modelled"):
            table.add(run.model, run.method, devices, run.memory, f"{run.tokens_per_s:,.0f}", "", run.plan, "",
                      "", "", "")
            notes.append(f"{run.model} {run.method} on {devices}, not modelled: {run.why}")
            continue
        prof = profile_of(run)
        cluster = nbtrain.Cluster.from_catalog(run.gpu, num_devices=run.gpus)
        plan = Plan.parse(run.plan, num_devices=run.gpus, num_layers=len(prof.layers),
                          global_batch=run.global_batch, seq_len=SEQ)
        pred = estimate(plan, prof, cluster, options=TORCHTUNE)
        tokens, work = run.global_batch * SEQ, by_kernel_class(prof, plan, cluster)
        published_step = tokens / run.tokens_per_s
        table.add(run.model, run.method, devices, run.memory, f"{run.tokens_per_s:,.0f}",
                  f"{work['flops'] / published_step / cluster.peak_flops:.0%}", str(plan),
                  "yes" if pred.fits else f"NO ({pred.budget_bytes / GiB:.0f} GiB)", gib(pred),
                  f"{pred.tokens_per_s:,.0f}", f"{pred.tokens_per_s / run.tokens_per_s:.2f}")
        t, offload = pred.time, plan.layers[0].offload
        trained = sum(layer.trained * s.offload for layer, s in zip(prof.layers, plan.layers))
        parts.add(run.model, run.method, devices, str(plan), f"{published_step:.2f}", f"{pred.step_time_s:.2f}",
                  f"{work['matmul_s']:.2f}", f"{work['attention_s']:.2f}", f"{work['memory_s']:.2f}",
                  f"{t.zero3_comm:.2f}", f"{trained / cluster.cpu_optimizer_rate:.2f}" if offload else "-",
                  f"{t.offload:.2f}" if offload else "-")
        if run.why:
            notes.append(f"{run.model} {run.method} on {devices}, {plan}: {run.why}")
        if "LoRA" in run.method:  # as the planner priced LoRA before 7885ae9: every weight trained
            full = estimate(plan, replace(prof, layers=[replace(layer, trained_params=-1) for layer in prof.layers]),
                            cluster, options=TORCHTUNE)
            notes.append(f"{run.model} {run.method} on {devices}, {plan}, priced as before frozen weights were "
                         f"(7885ae9; every weight trained): {'fits' if full.fits else 'does NOT fit'}, "
                         f"{gib(full)} GiB, {full.tokens_per_s:,.0f} tok/s")
        if offload:
            gpu_part = pred.step_time_s - t.offload
            left = published_step - gpu_part
            notes.append(f"{run.model} {run.method}: the catalog's host AdamW rate, "
                         f"{cluster.cpu_optimizer_rate / 1e9:.1f} G params/s a node, updates {trained / 1e9:.1f} B "
                         f"in {trained / cluster.cpu_optimizer_rate:.1f} s; the published step "
                         f"({published_step:.1f} s) less nbtrain's GPU part ({gpu_part:.1f} s) leaves "
                         f"{left:.1f} s for it: {trained / left / 1e9:.1f} G params/s; torchtune's update, in bf16, "
                         f"moves 14 bytes a parameter to nbtrain's 28: bound by the same memory, "
                         f"{trained / cluster.cpu_optimizer_rate / 2:.1f} s")
        if (run.model, run.method, run.gpu) in recommended:
            continue
        recommended.add((run.model, run.method, run.gpu))
        try:
            best = nbtrain.plan(prof, cluster, global_batch=run.global_batch, seq_len=SEQ)
        except NbtrainError as error:
            own.add(run.model, run.method, devices, f"none: {str(error).splitlines()[0]}", "", "", "", "")
            continue
        p = best.predicted
        own.add(run.model, run.method, devices, plan_text(best), "yes" if p.fits else "NO", gib(p),
                f"{p.tokens_per_s:,.0f}", f"{p.tokens_per_s / run.tokens_per_s:.2f}")
    print(table, end="\n\n")
    for note in notes:
        print("-", note)
    print()
    print(parts, end="\n\n")
    print(own)
    print(f"\n({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
