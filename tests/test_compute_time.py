"""Compute time by kernel on GPUs nbtrain has not timed a model on (issue 28, point 1): the roofline per kernel
class, the launch and collective floors, profiles saved before kernels were counted, and the CPU path unchanged.

    PYTHONPATH=. .venv/bin/pytest tests/test_compute_time.py -q      # ~15 s: profiles two tiny GPTs on fake tensors

Expected values come from the sources the catalog cites, not from the code under test: H100 SXM's achievable bf16
matmul rate 794.5 TFLOP/s (Bekman's MAMF table), its HBM 3.35 TB/s (datasheet) at a streaming fraction 0.9, a
5 µs launch floor, a 6 µs NCCL floor inside a node; FLOPs per token from Kaplan et al. 2020 (2 per weight) and
the attention term of Chowdhery et al. 2022 (4·s·d forward, halved by the causal mask the kernel skips).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nbtrain.errors import InvalidArgumentError
from nbtrain.models.gpt import GPT, GPTConfig
from nbtrain.planner.compute_time import Work, seconds
from nbtrain.planner.cost import estimate
from nbtrain.planner.plan import Plan
from nbtrain.planner.recommend import plan as recommend
from nbtrain.profiler.calibrate import Measurement, memory_bandwidth
from nbtrain.profiler.hardware import Cluster
from nbtrain.profiler.model import profile
from nbtrain.profiler.result import KERNEL_QUANTITIES, ModelProfile

MAMF_H100 = 794.5e12  # Bekman, "Maximum Achievable Matmul FLOPS comparison table": H100 SXM, bf16
HBM_H100 = 3.35e12 * 0.9  # datasheet HBM3 bandwidth × what a streaming copy reaches of it
LAUNCH, NCCL_NODE = 5e-6, 6e-6


@pytest.fixture(scope="module")
def tiny() -> ModelProfile:
    """gpt-tiny: 4 blocks of width 128, 4 heads, vocabulary 512 (0.9 M parameters)."""
    return profile("gpt-tiny", batch_size=2, seq_len=64)


def h100(n: int = 1) -> Cluster:
    return Cluster.from_catalog("H100", num_devices=n)


def test_a_big_matmul_runs_at_the_achievable_matmul_rate():
    n = 8192
    flops, nbytes = 2 * n**3, 3 * 2 * n * n  # two bf16 operands read, the result written
    assert seconds(Work(matmul_flops=flops, matmul_bytes=nbytes, kernels=1), h100()) == pytest.approx(
        flops / MAMF_H100, rel=1e-9)


def test_a_thin_matmul_is_bound_by_memory_bandwidth():
    m, k = 2**20, 64  # a million rows times a 64 × 64 weight: 8.6 GFLOP but 268 MB to move
    flops, nbytes = 2 * m * k * k, 2 * (2 * m * k + k * k)
    assert nbytes / HBM_H100 > flops / MAMF_H100
    assert seconds(Work(matmul_flops=flops, matmul_bytes=nbytes, kernels=1), h100()) == pytest.approx(
        nbytes / HBM_H100, rel=1e-9)


def test_a_tiny_kernel_takes_its_launch():
    n = 64
    assert seconds(Work(matmul_flops=2 * n**3, matmul_bytes=6 * n * n, kernels=1), h100()) == pytest.approx(LAUNCH)
    assert seconds(Work(memory_bytes=1024, kernels=40), h100()) == pytest.approx(40 * LAUNCH)


def test_the_profiler_counts_matmul_and_attention_flops_as_the_textbook_formulas(tiny):
    b, s, d = 2, 64, 128
    block = tiny.layers[1].scaling
    # every block weight (qkv 3d², proj d², MLP 8d²) multiplies each token once: 2 FLOPs per weight
    assert block["matmul_flops_fwd"](b, s) == 2 * b * s * 12 * d * d
    assert block["matmul_flops_bwd"](b, s) == 2 * 2 * b * s * 12 * d * d  # input and weight gradients
    assert block["attention_flops_fwd"](b, s) == 4 * b * s * s * d // 2  # QKᵀ and AV, the causal half
    assert block["kernels_fwd"](b, s) == block["kernels_fwd"](8, 512) > 0  # as many kernels at any shape
    assert block["memory_bytes_fwd"](8, 512) > block["memory_bytes_fwd"](b, s) > 0


def test_gpt2_tiny_on_8_h100_is_not_faster_than_its_kernel_launches(tiny):
    plan = Plan.parse("dp_replicate=8", num_devices=8, num_layers=len(tiny.layers), global_batch=8, seq_len=256)
    pred = estimate(plan, tiny, h100(8))
    kernels = sum(layer.scaling[f"kernels_{d}"](1, 256) for layer in tiny.layers for d in ("fwd", "bwd"))
    assert kernels > 100
    assert pred.step_time_s >= kernels * LAUNCH


@pytest.mark.parametrize("global_batch", [2, 4])
def test_a_03m_parameter_model_on_2_h100_is_not_recommended_a_pipeline(global_batch):
    # a flat 80% of peak with no floors recommended pp=2 here, at 0.4-0.7 µs a step: a pipeline stage of one
    # block then looked free, though every stage launches its kernels and sends its activations
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=1000, block_size=256, n_layer=2, n_head=4, n_embd=64, tie_embeddings=False))
    prof = profile(model, batch_size=1, seq_len=128)
    assert 0.2e6 < prof.params < 0.4e6
    assert recommend(prof, h100(2), global_batch=global_batch, seq_len=128).pp == 1


def test_tensor_parallel_collectives_take_at_least_nccls_latency(tiny):
    plan = Plan.parse("tp=4", num_devices=4, num_layers=len(tiny.layers), global_batch=1, seq_len=16)
    pred = estimate(plan, tiny, h100(4))
    collectives = 4 * (4 * 2) + 2 * 2  # 4 blocks × 4 each way; the embedding and the head one each way
    assert pred.time.tp_comm >= collectives * NCCL_NODE


def _without_kernel_counts(prof: ModelProfile) -> ModelProfile:
    """``prof`` as a profile saved before kernels were counted: through JSON, without those scalings."""
    data = prof.to_dict()
    for layer in data["layers"]:
        layer["scaling"] = {q: c for q, c in layer["scaling"].items() if q not in KERNEL_QUANTITIES}
    return ModelProfile.from_dict(data)


def test_an_old_profile_loads_and_falls_back_to_flops_over_the_sustained_rate(tiny):
    old = _without_kernel_counts(tiny)
    assert old.at(4, 32).flops_per_step == tiny.at(4, 32).flops_per_step
    plan = Plan.parse("dp_replicate=1", num_devices=1, num_layers=len(old.layers), global_batch=4, seq_len=64)
    cluster = h100()
    flops = old.at(4, 64).flops_per_step
    assert estimate(plan, old, cluster).time.compute == pytest.approx(flops / (989.4e12 * 794.5 / 989.4))
    assert estimate(plan, tiny, cluster).time.compute != pytest.approx(flops / (989.4e12 * 794.5 / 989.4))


@pytest.mark.parametrize("measured", [False, True])
def test_on_the_cpu_the_kernel_counts_change_nothing(tiny, measured):
    cpu = Cluster.from_catalog("cpu", num_devices=2, host_cores=2)
    prof = tiny
    if measured:  # as profile(measure="cpu") leaves it, on this machine
        cpu = cpu.replace(source="detected")
        layers = tuple(dataclasses.replace(layer, time_fwd_s=1e-3, time_bwd_s=2e-3) for layer in tiny.layers)
        prof = dataclasses.replace(tiny, layers=layers, measured_on="cpu")
    plan = Plan.parse("dp_replicate=2", num_devices=2, num_layers=len(prof.layers), global_batch=4, seq_len=64)
    assert estimate(plan, prof, cpu) == estimate(plan, _without_kernel_counts(prof), cpu)


def test_a_measured_gpu_memory_bandwidth_sets_the_streaming_fraction_of_the_datasheet():
    measured = Measurement("memory", 3.0e12, "B/s", 0.1, "1 GiB device → device copy")
    calibrated = h100().with_measurements([measured])
    assert calibrated.memory_bandwidth == 3.35e12  # the datasheet's stays
    assert calibrated.memory_efficiency == pytest.approx(3.0 / 3.35)


def test_the_memory_bandwidth_benchmark_is_for_gpus_only():
    with pytest.raises(InvalidArgumentError, match="a GPU's memory"):
        memory_bandwidth("cpu")
