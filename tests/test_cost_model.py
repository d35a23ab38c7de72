"""The cost model against numbers derived by hand from the formulas in :mod:`nbtrain.planner.cost`'s docstring.

    .venv/bin/pytest tests/test_cost_model.py -q          # a few seconds: pure Python, but for one test that profiles a tiny GPT

Every test uses the same toy model, seq_len 100, so a micro-batch of ``b`` sequences has ``100·b`` tokens:

    layer  kind       params     saved bytes/token  output bytes/token  forward FLOPs/token (backward = 2×)
    0      embedding    800,000      16                 200                 1,000
    1      block      8,000,000   1,000                 200            10,000,000
    2      block      8,000,000   1,000                 200            10,000,000
    3      head       1,600,000     500               4,000             2,000,000

on 8 devices in one node at 1 TFLOP/s sustained, 1 GB/s for every link, 8 G params/s of CPU AdamW per node, with
no memory reserve unless a test is about it. The expected value of each test is written out from the paper formula
in a comment; the code under test is never called to produce it.
"""

from __future__ import annotations

import dataclasses
import itertools
import re

import pytest

from nbtrain.errors import InvalidPlanError
from nbtrain.planner.cost import GiB, CostModel, CostOptions, Memory, estimate
from nbtrain.planner.plan import Plan
from nbtrain.planner.strategy import Strategy, strategy_space
from nbtrain.profiler.result import Scaling

from tests.planner_fixtures import cluster, layer, per_token, profile

S = Strategy
P_EMBED, P_BLOCK, P_HEAD = 800_000, 8_000_000, 1_600_000
NO_RESERVE = CostOptions(headroom=0, reserve_bytes=0)
EXACT = 1e-9


def toy(dtype: str = "bfloat16", **changes):
    return profile([
        layer("embed", "embedding", params=P_EMBED, act=16, out=200, fwd=1_000),
        layer("blocks.0", "block", params=P_BLOCK, act=1_000, out=200, fwd=10_000_000),
        layer("blocks.1", "block", params=P_BLOCK, act=1_000, out=200, fwd=10_000_000),
        layer("head", "head", params=P_HEAD, act=500, out=4_000, fwd=2_000_000),
    ], seq_len=100, dtype=dtype, **changes)


def cost_model(global_batch: int = 16, *, prof=None, devices: int = 8, options: CostOptions = NO_RESERVE,
               **cluster_changes) -> CostModel:
    return CostModel(prof or toy(), cluster(devices, cluster_changes.pop("devices_per_node", devices),
                                            **cluster_changes),
                     global_batch=global_batch, options=options)


def plan(*layers: Strategy, devices: int = 8, **fields) -> Plan:
    """A plan of the toy model's four layers; one strategy means the same for all."""
    layers = layers * 4 if len(layers) == 1 else layers
    return Plan(num_devices=devices, layers=layers, **fields)


def same_memory(expected: Memory):
    return pytest.approx(dataclasses.asdict(expected), rel=EXACT)


# --- model states (ZeRO, Rajbhandari et al. 2020 §3; Megatron TP) -------------------------------------------------

def test_plain_data_parallel_holds_16_bytes_per_parameter_in_mixed_precision():
    cost = cost_model().layer(1, S(dp_replicate=8), microbatches=1)
    # bf16 weights 2 + bf16 grads 2 + fp32 master, momentum, variance 12 = 16 bytes/param, nothing sharded.
    # 16 sequences over dp=8 in one micro-batch: b = 2, saved bytes 1000·2·100.
    assert dataclasses.asdict(cost.memory) == same_memory(
        Memory(params=2 * P_BLOCK, grads=2 * P_BLOCK, optimizer=12 * P_BLOCK, activations=200_000))
    assert cost.transient == 0 and cost.host_bytes == 0  # no sharding: no gather, no unsharded gradient buffer


def test_fp32_training_holds_weights_grads_and_two_moments_16_bytes_per_parameter():
    cost = cost_model(prof=toy("float32")).layer(1, S(dp_replicate=8), microbatches=1)
    # fp32: the weights are the master copy: 4 + 4 + 8 (two moments) = 16 bytes/param
    assert (cost.memory.params, cost.memory.grads, cost.memory.optimizer) == pytest.approx(
        (4 * P_BLOCK, 4 * P_BLOCK, 8 * P_BLOCK), rel=EXACT)


def test_zero2_keeps_full_parameters_and_shards_gradients_and_optimizer_state():
    cost = cost_model().layer(1, S(dp_shard=8, zero=2), microbatches=1)
    # 2P full; (2P + 12P) / 8. Transient: the unsharded bf16 gradient before its reduce-scatter, 2P.
    assert dataclasses.asdict(cost.memory) == same_memory(
        Memory(params=16_000_000, grads=2_000_000, optimizer=12_000_000, activations=200_000))
    assert cost.transient == pytest.approx(16_000_000, rel=EXACT)


def test_zero3_holds_one_dp_shard_th_of_every_model_state():
    cost = cost_model().layer(1, S(dp_shard=8), microbatches=1)
    # (2P + 2P + 12P) / 8 = 2 bytes/param; transient: gathered bf16 params 2P + unsharded bf16 grads 2P.
    assert dataclasses.asdict(cost.memory) == same_memory(
        Memory(params=2_000_000, grads=2_000_000, optimizer=12_000_000, activations=200_000))
    assert cost.transient == pytest.approx(32_000_000, rel=EXACT)


def lora_toy(trained: int = 100_000):
    """The toy model fine-tuned with LoRA: each block's 8M weights frozen but ``trained`` adapter parameters (the
    embedding and head frozen whole); the profile's backward FLOPs are the blocks' input gradients only (what torch
    computes with frozen weights: ~half), as the profiler counts them."""
    prof = toy()
    layers = [dataclasses.replace(x, trained_params=trained if x.kind == "block" else 0) for x in prof.layers]
    return dataclasses.replace(prof, layers=tuple(layers))


def test_a_frozen_weight_is_held_in_the_compute_dtype_with_no_gradient_and_no_optimizer_state():
    cost = cost_model(prof=lora_toy()).layer(1, S(dp_replicate=8), microbatches=1)
    # the frozen bf16 weights: 2 bytes each, no fp32 master (nothing updates them), no gradient, no moments; the
    # 100k adapter parameters (among the block's 8M) also bf16 gradients 2 and fp32 master and moments 12:
    # weights 2·8M, gradients 2·100k, optimizer 12·100k
    assert dataclasses.asdict(cost.memory) == same_memory(
        Memory(params=2 * P_BLOCK, grads=2 * 100_000, optimizer=12 * 100_000, activations=200_000))
    zero3 = cost_model(prof=lora_toy()).layer(1, S(dp_shard=8), microbatches=1)
    # ZeRO-3 shards the frozen weights too (FSDP2 shards every parameter): 2·8M/8; gradients and moments of the
    # adapters /8; the transient: the gathered weights 2·8M and the adapters' unsharded gradient 2·100k
    assert dataclasses.asdict(zero3.memory) == same_memory(
        Memory(params=2_000_000, grads=25_000, optimizer=150_000, activations=200_000))
    assert zero3.transient == pytest.approx(2 * P_BLOCK + 2 * 100_000, rel=EXACT)
    frozen = cost_model(prof=lora_toy()).layer(0, S(dp_replicate=8), microbatches=1)
    assert (frozen.memory.grads, frozen.memory.optimizer) == (0, 0)  # the embedding, frozen whole


def test_frozen_weights_sync_and_update_nothing_and_a_frozen_layer_neither_syncs_nor_updates():
    model, lora = cost_model(), cost_model(prof=lora_toy())
    # DDP: the adapters' 100k fp32 gradients (0.4 MB) all-reduced over 8: 2 · 7/8 · 4e5 / 1e9 = 0.7 ms, × 1.3 =
    # 0.91 ms, all under the block's 4 ms backward: nothing shows; the full model's 32 MB showed 68.8 ms
    assert lora.layer(1, S(dp_replicate=8), 1).time.dp_comm == 0
    assert model.layer(1, S(dp_replicate=8), 1).time.dp_comm == pytest.approx(0.0728 - 0.004, rel=EXACT)
    # a layer with every weight frozen syncs nothing, even where its backward is short (the embedding)
    assert lora.layer(0, S(dp_shard=8, zero=2), 1).time.dp_comm == 0
    # the update: the device's own AdamW on its 100k / 8 adapters, against 8M / 8 for full training (a CPU cluster
    # prices the device's update at 8e9 params/s per node shared by its 8 devices: 1e9 each; clipping off)
    options = CostOptions(headroom=0, reserve_bytes=0, clip=False)
    full_update = cost_model(device="cpu", options=options).layer(1, S(dp_shard=8), 1).time.update
    lora_update = cost_model(prof=lora_toy(), device="cpu", options=options).layer(1, S(dp_shard=8), 1).time.update
    assert (full_update, lora_update) == pytest.approx((P_BLOCK / 8 / 1e9, 100_000 / 8 / 1e9), rel=EXACT)


def test_more_than_one_device_waits_once_a_step_for_the_all_reduce_of_the_loss():
    """The trainer sums the step's loss over every rank and reads it on the host: one collective a step that no
    gradient sync holds (a pipeline without data parallelism has only it). Measured here as a gloo scalar all-reduce
    costs about its smallest measured size (64 KiB: a line through 64 KiB-8 MiB undercuts that floor)."""
    from nbtrain.profiler.collectives import Link, Links

    reduce = Link("all_reduce", 2, 2, latency_s=1e-4, bandwidth=1.4e9,
                  points=((65536, 4.5e-4), (524288, 5.1e-4), (2097152, 1.2e-3), (8388608, 6.3e-3)))
    measured = cost_model(devices=2, device="cpu", links=Links((reduce,)), options=CostOptions(
        headroom=0, reserve_bytes=0, clip=False))
    assert measured.loss_sync() == 4.5e-4
    pipeline = Plan(num_devices=2, layers=(S(),) * 4, pp=2, microbatches=4, global_batch=16)
    assert measured.estimate(pipeline).time.dp_comm == pytest.approx(4.5e-4, rel=EXACT)  # once, whatever m
    # a catalog cluster: the collective's latency within the node, across nodes where the devices span them
    assert cost_model(devices=8, collective_latency_s=6e-6).loss_sync() == 6e-6
    assert cost_model(devices=16, devices_per_node=8, inter_node_latency_s=25e-6).loss_sync() == 25e-6
    assert cost_model(devices=1, collective_latency_s=6e-6).loss_sync() == 0.0


def test_a_lora_run_fits_where_full_training_of_the_same_model_fits_only_with_its_update_on_the_cpu():
    # one device, nothing reserved, a budget of 6 bytes a weight: LoRA holds 2 a weight (bf16), and for its trained
    # adapters 14 more (bf16 gradients 2, fp32 master and moments 12); full training holds 16 a weight, or 4 with
    # the optimizer state (12) on the CPU (offload=1)
    weights = P_EMBED + 2 * P_BLOCK + P_HEAD
    budget = 6 * weights
    one = lambda prof: cost_model(1, prof=prof, devices=1, device_memory=budget)  # noqa: E731
    lora = one(lora_toy()).estimate(plan(S(), devices=1, global_batch=1))
    full = one(toy()).estimate(plan(S(), devices=1, global_batch=1))
    offloaded = one(toy()).estimate(plan(S(offload=1.0), devices=1, global_batch=1))
    adapters = 2 * 100_000
    assert lora.memory_bytes == pytest.approx(2 * weights + 14 * adapters + lora.stages[0].memory.activations
                                              + lora.stages[0].memory.transient, rel=EXACT)
    assert lora.fits and not full.fits and offloaded.fits


def test_hsdp_shards_over_dp_shard_only_and_replicates_over_dp_replicate():
    cost = cost_model().layer(1, S(dp_replicate=2, dp_shard=4), microbatches=1)
    # dp = 8 still splits the batch (b = 2) but the states are divided by dp_shard = 4 only
    assert dataclasses.asdict(cost.memory) == same_memory(
        Memory(params=4_000_000, grads=4_000_000, optimizer=24_000_000, activations=200_000))


def test_tensor_parallel_divides_parameters_gradients_and_optimizer_state_by_tp():
    cost = cost_model().layer(1, S(dp_replicate=2, tp=4), microbatches=1)
    # Model states 16 bytes · P / 4, unsharded. Of the toy block's 1000 saved bytes/token, its norms' inputs and
    # outputs are four hidden states of 200 bytes: without sequence parallelism every TP rank holds those whole,
    # and a quarter of the other 200. dp = 2: b = 8 sequences, 800 tokens · (800 + 200 / 4).
    assert dataclasses.asdict(cost.memory) == same_memory(
        Memory(params=4_000_000, grads=4_000_000, optimizer=24_000_000, activations=850 * 800))
    assert cost.transient == 0


def test_tensor_parallel_splits_what_the_heads_and_the_mlp_compute_and_keeps_the_hidden_states_whole():
    # a block saving Korthikanti's 34·sbh bytes (h = 100, 2-byte values: 3400 bytes/token) of which its norms'
    # inputs and outputs, 8·sbh (800), are whole on every rank without sequence parallelism (Korthikanti's 10·sbh
    # adds two dropout masks); under tp = 4: (8 + 26/4)·sbh = 1450 bytes/token
    prof = profile([layer("embed", "embedding", params=P_EMBED, act=16, out=200, fwd=1_000),
                    layer("blocks.0", "block", params=P_BLOCK, act=3_400, out=200, fwd=10_000_000),
                    layer("head", "head", params=P_HEAD, act=500, out=4_000, fwd=2_000_000)],
                   seq_len=100, dtype="bfloat16")
    cost = cost_model(prof=prof).layer(1, S(dp_replicate=2, tp=4), microbatches=1)
    assert cost.memory.activations == pytest.approx(1_450 * 800, rel=EXACT)  # b = 8 sequences, 800 tokens


def test_tensor_parallel_and_zero3_divide_together():
    cost = cost_model().layer(1, S(dp_shard=2, tp=4), microbatches=1)
    # P / tp = 2M params per TP rank, / dp_shard 2: 2·1M + 2·1M + 12·1M. Transient: gathered 2·2M + grads 2·2M.
    # Activations of b = 8 sequences: the toy block's 800 B/token of hidden states whole, 200 / 4 (above).
    assert dataclasses.asdict(cost.memory) == same_memory(
        Memory(params=2_000_000, grads=2_000_000, optimizer=12_000_000, activations=850 * 800))
    assert cost.transient == pytest.approx(8_000_000, rel=EXACT)


# --- activations and checkpointing (Korthikanti et al. 2022; Chen et al. 2016) ------------------------------------

def test_checkpointing_keeps_only_the_previous_layers_output_and_recomputes_the_rest_as_a_transient():
    cost = cost_model().layer(1, S(dp_shard=8, ac=True), microbatches=1)
    # kept: the embedding's output 200 bytes/token · 200 tokens; transient: ZeRO-3's 2P + 2P plus the recomputed
    # activations of one micro-batch, 1000 · 200
    assert cost.memory.activations == pytest.approx(40_000, rel=EXACT)
    assert cost.activations == pytest.approx(40_000, rel=EXACT)
    assert cost.transient == pytest.approx(32_000_000 + 200_000, rel=EXACT)


def test_checkpointing_the_embedding_keeps_its_int64_token_ids():
    cost = cost_model().layer(0, S(dp_replicate=8, ac=True), microbatches=1)
    # 8 bytes per token id, b = 2 sequences of 100; the recomputed activations 16 · 200 are the transient
    assert cost.memory.activations == pytest.approx(8 * 200, rel=EXACT)
    assert cost.transient == pytest.approx(16 * 200, rel=EXACT)


def test_checkpointing_under_tensor_parallel_keeps_the_whole_input_on_every_rank():
    cost = cost_model().layer(2, S(dp_replicate=4, tp=2, ac=True), microbatches=1)
    # dp = 4: b = 4 (400 tokens); input = block 0's output 200 · 400, whole on each TP rank (no sequence
    # parallelism); transient: the block recomputed, its four hidden states whole, the rest halved: 900 · 400
    assert cost.memory.activations == pytest.approx(80_000, rel=EXACT)
    assert cost.transient == pytest.approx(360_000, rel=EXACT)


def test_a_batch_independent_activation_term_is_counted_once_per_micro_batch():
    # The profile's polynomials carry batch-independent terms (position ids, a causal mask: TERMS "s", "s^2",
    # "1"); "the profiled saved bytes of a micro-batch" of b sequences is the polynomial at (b, s), where such a
    # term appears once, not b times.
    block = layer("blocks.0", "block", params=P_BLOCK, act=1_000, out=200, fwd=10_000_000,
                  scaling={"activation_bytes": Scaling((1_000, 0, 0, 0, 0, 5_000))})
    prof = toy()
    prof = dataclasses.replace(prof, layers=(prof.layers[0], block) + prof.layers[2:])
    cost = cost_model(prof=prof).layer(1, S(dp_replicate=8), microbatches=1)
    # b = 2: 1000 · 2 · 100 + 5000 (not 2 · (1000 · 100 + 5000) = 210,000)
    assert cost.memory.activations == pytest.approx(205_000, rel=EXACT)


# --- a stage: Σ resident + max transient + reserve; micro-batches in flight (Narayanan et al. 2021) ---------------

def test_stage_memory_is_the_sum_of_resident_bytes_plus_the_largest_transient():
    mixed = plan(S(dp_shard=8), S(dp_replicate=8), S(dp_shard=8, zero=2), S(dp_shard=8, ac=True), global_batch=16)
    pred = cost_model().estimate(mixed)
    # b = 2 everywhere (dp = 8), 200 tokens per micro-batch:
    #   embed ZeRO-3   2·0.8M/8·(1+1+6) = 1.6M   + saved 16·200      =   1,603,200   transient 3.2M
    #   block DDP      16 · 8M          = 128M   + saved 1000·200    = 128,200,000   transient 0
    #   block ZeRO-2   16M + 2M + 12M   = 30M    + saved 1000·200    =  30,200,000   transient 16M
    #   head ZeRO-3 ac 2 · 1.6M         = 3.2M   + kept 200·200      =   3,240,000   transient 6.4M
    #                                            + the loss's 500·200 =     100,000
    # (the loss runs after the checkpointed head, so what it saves stays: here all of the head's 500 saved bytes a
    # token, fewer than the fp32 logits, 2 · 4,000, it would save; its backward's two fp32 logits, 3.2M, < 16M)
    (stage,) = pred.stages
    assert stage.memory.transient == pytest.approx(16_000_000, rel=EXACT)
    assert stage.memory.total == pytest.approx(163_343_200 + 16_000_000, rel=EXACT)
    assert pred.memory_bytes == pytest.approx(179_343_200, rel=EXACT)
    assert stage.memory.params == pytest.approx(200_000 + 16_000_000 + 16_000_000 + 400_000, rel=EXACT)


def test_the_heads_loss_backward_holds_two_fp32_logits_and_a_checkpointed_head_keeps_the_log_probabilities():
    # A head of bf16 logits 40,000 bytes a token (20,000 classes), 90,000 saved bytes a token of which the loss's
    # fp32 log-probabilities are 80,000 (what FSDPMemTracker counts for lm_loss: tests/test_memory_oracle.py).
    # b = 2 (dp 8), 200 tokens: fp32 logits 80,000 · 200 = 16M.
    prof = profile([*toy().layers[:3], layer("head", "head", params=P_HEAD, act=90_000, out=40_000, fwd=1)],
                   seq_len=100)
    model = cost_model(prof=prof)
    plain, checkpointed = (model.layer(3, S(dp_shard=8, ac=ac), microbatches=1) for ac in (False, True))
    # the loss's backward holds the gradients of the log-probabilities and of the logits at once: 2 · 16M, more
    # than the head's gathered bf16 weights and unsharded gradients (2 · 2 · 1.6M)
    assert plain.transient == pytest.approx(32_000_000, rel=EXACT)
    assert plain.activations == pytest.approx(18_000_000, rel=EXACT)
    # checkpointing the head keeps its input (200 · 200) and the log-probabilities the loss saved after it
    assert checkpointed.activations == pytest.approx(40_000 + 16_000_000, rel=EXACT)
    assert checkpointed.transient == pytest.approx(32_000_000, rel=EXACT)
    # other layers have no loss: a block's transient is its gathered weights and unsharded gradients only
    assert model.layer(1, S(dp_shard=8), microbatches=1).transient == pytest.approx(2 * 2 * P_BLOCK, rel=EXACT)


def test_the_reserve_is_added_to_every_stage_once():
    pred = cost_model(options=CostOptions(headroom=0, reserve_bytes=12_345)).estimate(plan(S(dp_shard=8), global_batch=16))
    # ZeRO-3 on all four layers, b = 2: states 2 bytes/param = 1.6M + 16M + 16M + 3.2M, saved 3,200 + 2·200,000 +
    # 100,000, largest transient the blocks' 2·2P = 32M, plus the reserve
    assert pred.memory_bytes == pytest.approx(36_800_000 + 503_200 + 32_000_000 + 12_345, rel=EXACT)
    two_stages = cost_model(options=CostOptions(headroom=0, reserve_bytes=12_345)).estimate(
        plan(S(dp_shard=4), pp=2, global_batch=16))
    assert [s.memory.reserve for s in two_stages.stages] == [12_345, 12_345]


def test_the_default_reserve_is_one_gib_and_a_tenth_of_the_budget_on_a_gpu_and_nothing_on_the_cpu():
    model = cost_model(options=CostOptions())
    gpu = model.estimate(plan(S(dp_shard=8), global_batch=16))
    cpu = cost_model(options=CostOptions(), device="cpu").estimate(plan(S(dp_shard=8), global_batch=16))
    reserve = GiB + int(0.1 * model.cluster.device_memory)  # CUDA context + NCCL buffers, and the allocator headroom
    assert gpu.stages[0].memory.reserve == reserve
    assert cpu.stages[0].memory.reserve == 0
    assert gpu.memory_bytes - cpu.memory_bytes == pytest.approx(reserve, rel=EXACT)
    halved = CostModel(model.profile, model.cluster, global_batch=16, budget_bytes=model.cluster.device_memory / 2)
    assert halved.reserve == GiB + int(0.05 * model.cluster.device_memory)  # a tenth of the budget --memory gives
    assert cost_model(options=CostOptions(headroom=0.25)).reserve == GiB + int(0.25 * model.cluster.device_memory)


@pytest.mark.parametrize("headroom", [-0.1, 1, 1.5, "10%"])
def test_a_headroom_outside_zero_to_one_is_refused_with_the_form_it_takes(headroom):
    with pytest.raises(InvalidPlanError, match="fraction of each device's memory kept free"):
        CostOptions(headroom=headroom)


def test_1f1b_stage_i_holds_min_of_pp_minus_i_and_m_micro_batches():
    model = cost_model()
    pred = model.estimate(plan(S(dp_shard=4), pp=2, microbatches=4, global_batch=16))
    # 4 devices per stage, dp 4, m 4: b = 1 (100 tokens). Stage 0 = embed + block 0 holds min(2, 4) = 2
    # micro-batches: 2 · (16 + 1000) · 100; stage 1 = block 1 + head holds min(1, 4) = 1: (1000 + 500) · 100
    assert [s.in_flight for s in pred.stages] == [2, 1]
    assert [s.memory.activations for s in pred.stages] == pytest.approx([203_200, 150_000], rel=EXACT)

    one = model.estimate(plan(S(dp_shard=4), pp=2, microbatches=1, schedule="gpipe", global_batch=16))
    # m = 1 < pp runs under GPipe only (1F1B needs m ≥ pp): every stage holds its one micro-batch of b = 4:
    # (16 + 1000) · 400
    assert [s.in_flight for s in one.stages] == [1, 1]
    assert one.stages[0].memory.activations == pytest.approx(406_400, rel=EXACT)

    four = model.estimate(plan(S(dp_shard=2), pp=4, microbatches=4, global_batch=16))
    # pp 4, m 4, b = 2: min(4 − i, 4) = 4, 3, 2, 1; one layer per stage: 4·16·200, 3·1000·200, 2·1000·200, 500·200
    assert [s.in_flight for s in four.stages] == [4, 3, 2, 1]
    assert [s.memory.activations for s in four.stages] == pytest.approx(
        [12_800, 600_000, 400_000, 100_000], rel=EXACT)


def test_gpipe_holds_all_m_micro_batches_in_every_stage():
    pred = cost_model().estimate(plan(S(dp_shard=4), pp=2, microbatches=4, schedule="gpipe", global_batch=16))
    # 4 · (16 + 1000) · 100 and 4 · (1000 + 500) · 100
    assert [s.in_flight for s in pred.stages] == [4, 4]
    assert [s.memory.activations for s in pred.stages] == pytest.approx([406_400, 600_000], rel=EXACT)


# --- CPU update offload: the optimizer state moves to host memory -------------------------------------------------

def test_offload_moves_that_fraction_of_the_optimizer_state_to_host_memory():
    model = cost_model()
    cost = model.layer(1, S(dp_shard=8, offload=0.25), microbatches=1)
    # ZeRO-3 shard of the fp32 state 12 · 8M / 8 = 12M: a quarter on the host, three quarters on the device
    assert cost.memory.optimizer == pytest.approx(9_000_000, rel=EXACT)
    assert cost.host_bytes == pytest.approx(3_000_000, rel=EXACT)
    assert (cost.memory.params, cost.memory.grads) == pytest.approx((2_000_000, 2_000_000), rel=EXACT)

    pred = model.estimate(plan(S(dp_shard=8, offload=0.25), global_batch=16))
    # all layers: 12 · (0.8M + 8M + 8M + 1.6M) / 8 = 27.6M of optimizer state per device, a quarter on the host
    assert pred.stages[0].host_bytes == pytest.approx(6_900_000, rel=EXACT)
    assert pred.stages[0].memory.optimizer == pytest.approx(20_700_000, rel=EXACT)
    full = model.estimate(plan(S(dp_shard=8), global_batch=16))
    assert full.memory_bytes - pred.memory_bytes == pytest.approx(6_900_000, rel=EXACT)


def test_a_plan_fits_when_device_memory_and_the_devices_share_of_host_memory_suffice():
    offloaded = plan(S(dp_shard=8, offload=0.25), global_batch=16)
    device = cost_model().estimate(offloaded).memory_bytes
    # host memory is per node and its 8 devices share it: 8 · 6.9M is exactly enough
    fits = estimate(offloaded, toy(), cluster(8, 8, host_memory=8 * 6_900_000), memory=device, options=NO_RESERVE)
    assert fits.host_budget_bytes == pytest.approx(6_900_000, rel=EXACT) and fits.fits
    short_host = estimate(offloaded, toy(), cluster(8, 8, host_memory=8 * 6_900_000 - 8), memory=device,
                          options=NO_RESERVE)
    assert not short_host.fits
    short_device = estimate(offloaded, toy(), cluster(8, 8), memory=device - 1, options=NO_RESERVE)
    assert short_device.budget_bytes == device - 1 and not short_device.fits


# --- time: compute, collectives, offload, re-layout, pipeline -----------------------------------------------------

def test_compute_is_forward_plus_backward_flops_over_the_sustained_rate_plus_a_forward_with_checkpointing():
    model = cost_model()
    # b = 2, 200 tokens: forward 1e7 · 200 = 2e9 FLOPs = 2 ms at 1e12 FLOP/s, backward 4 ms
    assert model.layer(1, S(dp_replicate=8), 1).time.compute == pytest.approx(6e-3, rel=EXACT)
    assert model.layer(1, S(dp_replicate=8, ac=True), 1).time.compute == pytest.approx(8e-3, rel=EXACT)
    # TP splits the FLOPs: dp 2, b = 8 (800 tokens), tp 4: (1e7 + 2e7) · 800 / 4 / 1e12 = 6 ms
    assert model.layer(1, S(dp_replicate=2, tp=4), 1).time.compute == pytest.approx(6e-3, rel=EXACT)
    half = cost_model(flops_efficiency=0.5)  # sustained = peak × efficiency = 0.5e12
    assert half.layer(1, S(dp_replicate=8), 1).time.compute == pytest.approx(12e-3, rel=EXACT)


def test_pipeline_step_is_the_sum_of_stage_times_plus_m_minus_1_times_the_slowest():
    model = cost_model(global_batch=4, devices=2)
    # two devices, one per stage, so no data or tensor parallelism; m = 4, b = 1 (100 tokens)
    # embed 3e3 FLOPs/token → 0.3 µs; each block 3e7 → 3 ms; head 6e6 → 0.6 ms
    # stage 0 sends its output forward and its gradient comes back: 2 · 200 · 100 bytes / 1e9 = 40 µs
    first_light = model.estimate(plan(S(), devices=2, pp=2, microbatches=4, stages=(1, 3), global_batch=4))
    t0, t1 = 0.3e-6 + 40e-6, 6e-3 + 0.6e-3
    assert [s.time_per_microbatch for s in first_light.stages] == pytest.approx([t0, t1], rel=EXACT)
    assert first_light.step_time_s == pytest.approx(t0 + t1 + 3 * t1, rel=EXACT)

    first_heavy = model.estimate(plan(S(), devices=2, pp=2, microbatches=4, stages=(3, 1), global_batch=4))
    t0, t1 = 0.3e-6 + 6e-3 + 40e-6, 0.6e-3
    assert first_heavy.step_time_s == pytest.approx(t0 + t1 + 3 * t0, rel=EXACT)
    # the breakdown adds up to the step, and throughput and MFU follow from it
    assert first_heavy.time.total == pytest.approx(first_heavy.step_time_s, rel=EXACT)
    assert first_heavy.tokens_per_s == pytest.approx(400 / first_heavy.step_time_s, rel=EXACT)
    flops = (3e3 + 2 * 3e7 + 6e6) * 400  # model FLOPs of the step, without recompute
    assert first_heavy.mfu == pytest.approx(flops / (first_heavy.step_time_s * 2 * 1e12), rel=EXACT)
    # the slowest stage computes its 4 micro-batches and waits for the other stage's first one: the bubble
    assert first_heavy.time.bubble == pytest.approx(t1, rel=EXACT)


def test_with_equal_stages_the_bubble_is_gpipes_p_minus_1_over_m_plus_p_minus_1():
    # Huang et al. 2019: with p equal stages and m micro-batches a device idles (p − 1) / (m + p − 1) of the step
    blocks = [layer(f"blocks.{i}", "block", params=1000, act=1e3, out=200, fwd=1e7) for i in range(4)]
    equal = profile([layer("embed", "embedding", params=0, act=0, out=200, fwd=0), *blocks,
                     layer("head", "head", params=0, act=0, out=200, fwd=0)])
    model = CostModel(equal, cluster(4, 4, intra_node_bandwidth=1e30), global_batch=8, options=NO_RESERVE)
    for m in (4, 8):
        p = model.estimate(plan(*[S()] * 6, devices=4, pp=4, microbatches=m, stages=(2, 1, 1, 2), global_batch=8))
        assert p.time.bubble / p.step_time_s == pytest.approx(3 / (m + 3), rel=EXACT)
    assert model.estimate(plan(*[S(dp_replicate=4)] * 6, devices=4, global_batch=8)).time.bubble == 0


@pytest.mark.parametrize("m", [1, 2, 4])
def test_pipeline_stages_update_once_a_step_side_by_side_after_the_pipeline_drains(m):
    # two equal stages on two CPU "devices" (where the device's own update is priced), m micro-batches of one
    # sequence (100 tokens): a stage computes 3e7 FLOPs/token · 100 / 1e12 = 3 ms a micro-batch, and updates its
    # block's 4M fp32 parameters once a step at 8e9 / 2 devices = 4e9 params/s: 1 ms, both stages at once.
    # Equal stages fill pp + m − 1 micro-batch slots (Huang et al. 2019), then update: 3 ms · (m + 1) + 1 ms
    # (the update paid once, not once per slot of its stage: (pp + m − 1) / m times)
    blocks = [layer(f"blocks.{i}", "block", params=4e6, act=1e3, out=0, fwd=1e7) for i in range(2)]
    ends = [layer("embed", "embedding", params=0, act=0, out=0, fwd=0), layer("head", "head", params=0, act=0,
                                                                               out=0, fwd=0)]
    equal = profile([ends[0], *blocks, ends[1]], dtype="float32")
    model = CostModel(equal, cluster(2, 2, device="cpu"), global_batch=m,
                      options=CostOptions(headroom=0, reserve_bytes=0, clip=False))
    pipelined = model.estimate(plan(*[S()] * 4, devices=2, pp=2, microbatches=m, stages=(2, 2), global_batch=m,
                                    schedule="1f1b" if m >= 2 else "gpipe"))  # 1F1B runs m ≥ pp only
    assert pipelined.step_time_s == pytest.approx(3e-3 * (m + 1) + 1e-3, rel=EXACT)
    # by category, as a stage's device spends the step: m micro-batches, the update once, idle for the rest
    assert pipelined.time.update == pytest.approx(1e-3, rel=EXACT)
    assert pipelined.time.compute == pytest.approx(3e-3 * m, rel=EXACT)
    assert pipelined.time.bubble == pytest.approx(3e-3, rel=EXACT)
    assert pipelined.time.total == pytest.approx(pipelined.step_time_s, rel=EXACT)


def test_a_plan_of_one_layout_pays_no_relayout_and_a_layout_change_moves_the_hidden_state_both_ways():
    model = cost_model()
    one_layout = plan(S(dp_shard=8), S(dp_replicate=8), S(dp_shard=8, zero=2), S(dp_shard=8, ac=True, offload=1.0),
                      global_batch=16)
    assert model.estimate(one_layout).time.relayout == 0
    changed = plan(S(dp_shard=8), S(dp_shard=8), S(dp_replicate=2, tp=4), S(dp_replicate=2, tp=4), global_batch=16)
    # entering layer 2: block 0's output, 200 bytes/token; (dp 8, tp 1) holds b = 2 → 40,000 bytes per device,
    # (dp 2, tp 4) holds b = 8 / tp 4 → 40,000. Forward and backward: 2 · 40,000 / 1e9, once (pp 1, m 1)
    assert model.estimate(changed).time.relayout == pytest.approx(80e-6, rel=EXACT)


def test_tensor_parallel_pays_two_all_gathers_and_two_reduce_scatters_per_block_and_pass():
    model = cost_model()
    # dp 2, b = 8: the hidden state entering block 0 is 200 · 800 = 160 KB; ring over tp 4: 3/4 · 160e3 / 1e9
    ring = 0.75 * 160_000 / 1e9
    assert model.layer(1, S(dp_replicate=2, tp=4), 1).time.tp_comm == pytest.approx(2 * 4 * ring, rel=EXACT)
    # checkpointing runs the forward, with its collectives, a second time
    assert model.layer(1, S(dp_replicate=2, tp=4, ac=True), 1).time.tp_comm == pytest.approx(3 * 4 * ring,
                                                                                             rel=EXACT)
    # embeddings (its own output) and head (block 1's output, also 160 KB): one collective each way
    assert model.layer(0, S(dp_replicate=2, tp=4), 1).time.tp_comm == pytest.approx(2 * ring, rel=EXACT)
    assert model.layer(3, S(dp_replicate=2, tp=4), 1).time.tp_comm == pytest.approx(2 * ring, rel=EXACT)
    assert model.layer(1, S(dp_replicate=8), 1).time.tp_comm == 0


def test_ddp_all_reduce_of_fp32_gradients_shows_only_its_excess_over_backward():
    model = cost_model()
    # 8M fp32 gradients = 32 MB; all-reduce over 8: 2 · 7/8 · 32e6 / 1e9 = 56 ms, × 1.3 contention = 72.8 ms;
    # the backward it overlaps: 2e7 · 200 tokens / 1e12 = 4 ms
    assert model.layer(1, S(dp_replicate=8), 1).time.dp_comm == pytest.approx(0.0728 - 0.004, rel=EXACT)
    # m = 2: the sync runs once per step, against one micro-batch's backward (2 ms), spread over the 2
    two = model.layer(1, S(dp_replicate=8), 2).time.dp_comm
    assert two == pytest.approx((0.0728 - 0.002) / 2, rel=EXACT)
    # across nodes (4 per node) the ring runs at the inter-node 0.1 GB/s
    inter = cost_model(devices_per_node=4, inter_node_bandwidth=1e8)
    assert inter.layer(1, S(dp_replicate=8), 1).time.dp_comm == pytest.approx(0.728 - 0.004, rel=EXACT)


def test_zero_gradient_sync_is_a_reduce_scatter_plus_for_zero2_a_gather_of_the_updated_shard():
    model = cost_model()
    rs = 7 / 8 * 32e6 / 1e9  # reduce-scatter of 32 MB of fp32 gradients over 8: 28 ms
    ag = 7 / 8 * 16e6 / 1e9  # all-gather of 16 MB of bf16 parameters over 8: 14 ms
    assert model.layer(1, S(dp_shard=8, zero=2), 1).time.dp_comm == pytest.approx((rs + ag) * 1.3 - 4e-3, rel=EXACT)
    zero3 = model.layer(1, S(dp_shard=8), 1).time
    assert zero3.dp_comm == pytest.approx(rs * 1.3 - 4e-3, rel=EXACT)
    # ZeRO-3 gathers the parameters in forward and again in backward; only the excess over compute (6 ms) shows
    assert zero3.zero3_comm == pytest.approx(2 * ag * 1.3 - 6e-3, rel=EXACT)
    # HSDP: reduce-scatter over dp_shard 4, all-reduce of the 8 MB shard over dp_replicate 2
    hsdp = 0.75 * 32e6 / 1e9 + 2 * 0.5 * 8e6 / 1e9
    assert model.layer(1, S(dp_replicate=2, dp_shard=4), 1).time.dp_comm == pytest.approx(hsdp * 1.3 - 4e-3,
                                                                                          rel=EXACT)
    fast = cost_model(intra_node_bandwidth=1e15)  # the collectives hide entirely under compute
    assert fast.layer(1, S(dp_shard=8), 1).time.zero3_comm == 0
    assert fast.layer(1, S(dp_shard=8), 1).time.dp_comm == 0


def test_offloaded_update_overlaps_backward_in_cotrain_and_is_serial_in_zero_offload():
    # ZeRO-3 shard of 8M / 8 = 1M params on the CPU: AdamW at 8e9 / 8 devices = 1e9 params/s → 1 ms;
    # PCIe: 1M · (2 bytes of bf16 grad down + 2 bytes of bf16 param up) / 1e9 = 4 ms (both cross in the compute
    # dtype, as Reflow sends them); backward 4 ms, which hides it all
    overlapped = cost_model().layer(1, S(dp_shard=8, offload=1.0), 1).time.offload
    serial = cost_model(options=CostOptions(headroom=0, reserve_bytes=0, offload_overlap=False)).layer(
        1, S(dp_shard=8, offload=1.0), 1).time.offload
    assert overlapped == pytest.approx(max(0.0, max(1e-3, 4e-3) - 4e-3), abs=1e-12)
    assert serial == pytest.approx(1e-3 + 4e-3, rel=EXACT)
    slow_bus = cost_model(host_to_device_bandwidth=0.5e9).layer(1, S(dp_shard=8, offload=1.0), 1).time.offload
    assert slow_bus == pytest.approx(8e-3 - 4e-3, rel=EXACT)  # only the excess over backward shows


def test_on_a_cpu_device_the_update_copies_its_weights_and_the_device_share_takes_the_same_cores():
    # One CPU "device" (the executor's emulation: forward and backward on one core, the update on another):
    # 8M params, half offloaded, fp32. The CPU: 4M at 8e9 params/s = 0.5 ms, plus copying 4M · 4 bytes of new
    # weights into the parameters at 1e9 B/s = 16 ms; no PCIe. The device's half at the same rate: 0.5 ms.
    unclipped = CostOptions(headroom=0, reserve_bytes=0, clip=False)
    model = cost_model(1, prof=toy(dtype="float32"), devices=1, device="cpu", options=unclipped)
    cost = model.layer(1, S(offload=0.5), microbatches=1)
    backward = 2e7 * 100 / 1e12  # one sequence of 100 tokens, 2e7 FLOPs per token: 2 ms, overlapping the update
    assert cost.time.offload == pytest.approx(0.5e-3 + 16e-3 - backward, rel=EXACT)
    assert cost.time.update == pytest.approx(0.5e-3, rel=EXACT)
    assert cost_model().layer(1, S(dp_shard=8, offload=0.5), 1).time.update == 0  # a GPU's step: not modelled


def test_clipping_on_a_cpu_device_reads_every_gradient_for_the_norm_then_reads_and_writes_it_to_scale():
    # 8M fp32 gradients = 32 MB; three passes at the CPU's copy rate (1e9 B/s): 96 ms more than without clipping
    clipped = cost_model(1, prof=toy(dtype="float32"), devices=1, device="cpu").layer(1, S(), 1).time.update
    unclipped = cost_model(1, prof=toy(dtype="float32"), devices=1, device="cpu",
                           options=CostOptions(headroom=0, reserve_bytes=0, clip=False)).layer(1, S(), 1).time.update
    assert clipped - unclipped == pytest.approx(3 * 8e6 * 4 / 1e9, rel=EXACT)


def test_an_offloaded_update_cannot_hide_under_backward_on_a_cpu_whose_processes_take_every_core():
    # the same layer as above, one process on one core: the CPU update has no core of its own, all of it shows
    shared = cost_model(1, prof=toy(dtype="float32"), devices=1, device="cpu", host_cores=1,
                        options=CostOptions(headroom=0, reserve_bytes=0, clip=False)).layer(1, S(offload=0.5), 1)
    assert shared.time.offload == pytest.approx(0.5e-3 + 16e-3, rel=EXACT)


def test_a_profile_measured_on_this_machine_gives_the_compute_time_scaled_by_flops():
    measured = toy()
    blocks = [dataclasses.replace(x.at(1, 100), time_fwd_s=0.010, time_bwd_s=0.030) for x in measured.layers]
    measured = dataclasses.replace(measured, layers=tuple(blocks), measured_on="cpu")  # at batch 1 × 100 tokens
    here = cluster(1, 1, device="cpu", source="detected")
    # b = 4 sequences: 4× the profiled FLOPs, so 4 × (10 + 30) ms, whatever the FLOP rate says
    on_cpu = CostModel(measured, here, global_batch=4, options=NO_RESERVE).layer(1, S(), 1)
    assert on_cpu.time.compute == pytest.approx(4 * 0.040, rel=EXACT)
    by_flops = 4 * 100 * 3e7 / 1e12
    catalog = CostModel(measured, cluster(1, 1, device="cpu"), global_batch=4, options=NO_RESERVE).layer(1, S(), 1)
    assert catalog.time.compute == pytest.approx(by_flops, rel=EXACT)  # not this machine: FLOPs over the rate
    elsewhere = CostModel(measured, cluster(1, 1, source="detected"), global_batch=4, options=NO_RESERVE)
    assert elsewhere.layer(1, S(), 1).time.compute == pytest.approx(by_flops, rel=EXACT)  # measured on the CPU
    off = CostModel(measured, here, global_batch=4, options=CostOptions(headroom=0, reserve_bytes=0, measured_compute=False))
    assert off.layer(1, S(), 1).time.compute == pytest.approx(by_flops, rel=EXACT)


def test_what_rows_do_not_scale_is_paid_whole_by_every_call_of_a_split_layer():
    """A layer timed at 4 × 100 tokens took 40 ms, 8 of which it takes whatever its rows (Python and dispatch per op:
    a width-64 transformers Qwen2 here took 17.2 ms a step at 16 rows and 9.4 at 8, not 8.6). Half the rows (two
    data-parallel ranks, or two micro-batches) pay 8 + 32 / 2; the FLOPs alone said 20."""
    measured = toy()
    blocks = [dataclasses.replace(x.at(4, 100), time_fwd_s=0.010, time_bwd_s=0.030, time_fwd_fixed_s=0.002,
                                  time_bwd_fixed_s=0.006) for x in measured.layers]
    measured = dataclasses.replace(measured, layers=tuple(blocks), batch_size=4, measured_on="cpu")
    here = cluster(1, 1, device="cpu", source="detected")
    model = CostModel(measured, here, global_batch=4, options=NO_RESERVE)
    assert model.layer(1, S(), 2).time.compute == pytest.approx(0.008 + 0.032 / 2, rel=EXACT)  # a micro-batch of 2
    assert model.layer(1, S(), 1).time.compute == pytest.approx(0.040, rel=EXACT)  # the timed rows: as measured


def test_the_zero_offload_schedule_is_never_faster_than_the_overlapped_one():
    overlapped = cost_model()
    serial = cost_model(options=CostOptions(headroom=0, reserve_bytes=0, offload_overlap=False))
    checked = 0
    for pp, m in itertools.product((1, 2), (1, 2, 4)):
        for s in strategy_space(8 // pp, devices_per_node=8, offload_levels=(0.0, 0.25, 1.0), max_dp=16 // m):
            p = plan(s, pp=pp, microbatches=m, global_batch=16, schedule="1f1b" if m >= pp else "gpipe")
            fast, slow = overlapped.estimate(p).step_time_s, serial.estimate(p).step_time_s
            assert slow >= fast * (1 - EXACT), str(p)
            if s.offload == 0:
                assert slow == pytest.approx(fast, rel=EXACT), str(p)
            checked += 1
    assert checked > 100


def test_a_pipeline_send_between_stages_on_different_nodes_runs_at_the_inter_node_bandwidth():
    # 8 devices, 4 per node, pp = 4: stage i runs on devices 2i, 2i+1 (pp is the outermost mesh axis). Stages 0→1
    # and 2→3 talk inside a node, stage 1 (devices 2, 3) sends to stage 2 (devices 4, 5) across nodes.
    model = cost_model(global_batch=2, devices_per_node=4, inter_node_bandwidth=1e8)
    p = plan(S(dp_replicate=2), pp=4, microbatches=1, schedule="gpipe", global_batch=2)
    # b = 1: each block sends 200 · 100 bytes forward and receives as much back
    times = [model.stage(p, i, i, i + 1)[1].pp_comm for i in range(3)]
    assert times == pytest.approx([2 * 20_000 / 1e9, 2 * 20_000 / 1e8, 2 * 20_000 / 1e9], rel=EXACT)


# --- estimate() rejects plans it cannot take, showing the arithmetic ----------------------------------------------

def test_a_plan_for_another_device_count_is_rejected():
    with pytest.raises(InvalidPlanError, match="the plan is for 4 devices but the cluster has 8"):
        cost_model().estimate(plan(S(dp_shard=4), devices=4, global_batch=16))


def test_a_plan_for_another_layer_count_is_rejected():
    short = Plan(num_devices=8, layers=(S(dp_shard=8),) * 3, global_batch=16)
    with pytest.raises(InvalidPlanError, match="the plan has 3 layers but toy has 4"):
        cost_model().estimate(short)


def test_tensor_parallel_degree_must_divide_the_attention_heads():
    model = cost_model(prof=toy(n_head=12, n_kv_head=6))
    with pytest.raises(InvalidPlanError, match=re.escape(
            "layer 1 (blocks.0) of toy: tp=4 does not divide the 6 key/value heads (12 query heads share them); "
            "use a tp that divides 6: 1, 2, 3 or 6")):
        model.estimate(plan(S(dp_replicate=2, tp=4), global_batch=16))
    model.estimate(plan(S(dp_replicate=4, tp=2), global_batch=16))  # 2 divides 6
    # the embedding and the head split the vocabulary, not heads: any tp
    model.estimate(plan(S(dp_replicate=2, tp=4), S(dp_replicate=4, tp=2), S(dp_replicate=4, tp=2),
                        S(dp_replicate=2, tp=4), global_batch=16))


def test_global_batch_must_be_divisible_by_microbatches_times_dp():
    with pytest.raises(InvalidPlanError, match=re.escape(
            "global batch 12 is not divisible by microbatches × dp = 2 × 8 = 16")):
        estimate(plan(S(dp_shard=8), microbatches=2), toy(), cluster(), global_batch=12, options=NO_RESERVE)
    with pytest.raises(InvalidPlanError, match="estimate needs the global batch"):
        estimate(plan(S(dp_shard=8)), toy(), cluster())


def test_the_per_token_fixture_is_what_the_numbers_above_assume():
    # guards the hand arithmetic: 1000·b·s at b = 2, s = 100
    assert per_token(1_000)(2, 100) == 200_000
    assert toy().layers[1].scaling["flops_fwd"](1, 100) == 1e9


# --- a model whose norms run fused (issue 45: the Llama 2 13B run's Triton RMSNorm) --------------------------------

def _by_kernel(block_kernels: dict[str, float]) -> dict[str, Scaling]:
    """Kernel-class counts of a layer: per-token ``*_bytes``/``*_flops``, per-call ``kernels_*``."""
    return {q: per_token(v) if not q.startswith("kernels") else Scaling((0, 0, 0, 0, 0, v))
            for q, v in block_kernels.items()}


def test_fused_norms_save_what_the_profile_declares_in_activations_memory_bound_bytes_and_kernels():
    # Each block: 1e7 matmul FLOPs a token forward (2e7 back), 5,000 memory-bound bytes a token forward and 15,000
    # back, 10 and 20 kernels a call. Its norms, declared fused, save 600 bytes a token of the 1,000 it saves,
    # 3,000 and 9,000 memory-bound bytes a token and 7 and 15 kernels (what two nn.RMSNorms of width 50 in bf16
    # would: 6·50 bytes saved each). Priced by kernel class: 1 TFLOP/s of matmul, 1 GB/s of memory bandwidth.
    counted = dict(matmul_flops_fwd=1e7, matmul_flops_bwd=2e7, matmul_bytes_fwd=0, matmul_bytes_bwd=0,
                   attention_flops_fwd=0, attention_flops_bwd=0, memory_bytes_fwd=5_000, memory_bytes_bwd=15_000,
                   kernels_fwd=10, kernels_bwd=20)
    ends = dict(counted, matmul_flops_fwd=0, matmul_flops_bwd=0, memory_bytes_fwd=0, memory_bytes_bwd=0,
                kernels_fwd=0, kernels_bwd=0)
    base = toy()
    layers = [dataclasses.replace(x, scaling={**x.scaling, **_by_kernel(counted if x.kind == "block" else ends)})
              for x in base.layers]
    unfused = dataclasses.replace(base, layers=tuple(layers))
    saving = dict(saved=600.0, memory_fwd=3_000.0, memory_bwd=9_000.0, kernels_fwd=7.0, kernels_bwd=15.0)
    none = dict.fromkeys(saving, 0.0)
    fused = dataclasses.replace(unfused, arch={**unfused.arch, "fused_norm": [none, saving, saving, none]})
    gpu = dict(memory_bandwidth=1e9, memory_efficiency=1.0)
    ddp = plan(S(dp_replicate=8), global_batch=16)  # 2 sequences of 100 tokens a device: 200 tokens
    before, after = (cost_model(prof=p, **gpu).estimate(ddp) for p in (unfused, fused))
    # activations: 2 blocks × 600 B × 200 tokens fewer
    assert before.stages[0].memory.activations - after.stages[0].memory.activations == pytest.approx(240_000)
    # compute: a block's forward 1e7·200/1e12 s of matmul + 5,000·200/1e9 s of memory traffic = 2.0 + 1.0 ms,
    # fused 2.0 + 0.4 ms; backward 4.0 + 3.0 ms, fused 4.0 + 1.2 ms: 0.6 + 1.8 ms less a block, two blocks
    assert before.time.compute - after.time.compute == pytest.approx(2 * (0.6e-3 + 1.8e-3), rel=1e-9)
    # kernels: with a 1 ms launch floor a block's forward takes its 10 kernels' 10 ms, fused its 3 kernels' 3 ms
    # (over its 2.4 ms of work); backward 20 ms, fused 5.2 ms of work over 5 kernels' 5 ms: 7 + 14.8 ms less a block
    slow_launch = dict(gpu, kernel_latency_s=1e-3)
    before, after = (cost_model(prof=p, **slow_launch).estimate(ddp) for p in (unfused, fused))
    assert before.time.compute - after.time.compute == pytest.approx(2 * (7e-3 + 14.8e-3), rel=1e-9)


def test_a_fused_rmsnorm_saves_six_bytes_a_unit_less_than_the_nn_rmsnorm_the_profile_traces_in_bf16():
    """Derived by hand: ``nn.RMSNorm`` as torch runs it on a CPU (its composite, what the profiler traces) upcasts
    the bf16 input to fp32 and saves that copy (4h bytes a token), the normalised value in fp32 (4h) and the rstd
    (4): 8h + 4. The fused kernel (torchtitan's ``TritonFusedRMSNorm``: ``save_for_backward(x, weight, rstd)``;
    torch's CUDA ``_fused_rms_norm``) saves the bf16 input (2h) and the rstd (4): 2h + 4. So 6h bytes a token less
    per norm: two in a block, one in the head (the final norm), none in the embedding. A tiny Llama-shaped GPT
    (h = 64, 2 blocks), profiled at 2 × 32 tokens in bf16 and priced with no checkpointing on one A100: the
    activations fall by (2·2 + 1) norms × 6·64 bytes × 64 tokens = 122,880 bytes, nothing else changes."""
    import torch

    from nbtrain.models.gpt import GPT, GPTConfig
    from nbtrain.profiler.hardware import Cluster
    from nbtrain.profiler.model import profile as profile_model

    config = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64, norm="rmsnorm", mlp="swiglu",
                       position="rope", bias=False, tie_embeddings=False)
    torch.manual_seed(0)
    model = GPT(config)
    traced, fused = (profile_model(model, batch_size=2, seq_len=32, dtype="bf16", fused_norm=f) for f in (False, True))
    h = 64
    assert [layer["saved"] for layer in fused.arch["fused_norm"]] == [0, 2 * 6 * h, 2 * 6 * h, 6 * h]
    assert "fused_norm" not in traced.arch
    a100 = Cluster.from_catalog("A100-80GB", num_devices=1)
    one = Plan.parse("dp_replicate=1", num_devices=1, num_layers=4, global_batch=2, seq_len=32)
    before, after = (estimate(one, p, a100) for p in (traced, fused))
    assert before.stages[0].memory.activations - after.stages[0].memory.activations == (2 * 2 + 1) * 6 * h * 64
    assert after.stages[0].memory.params == before.stages[0].memory.params
    assert after.step_time_s < before.step_time_s  # fewer bytes read and written, fewer kernels
