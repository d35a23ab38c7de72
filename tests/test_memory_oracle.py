"""The planner's memory per device for FSDP plans against torch's ``FSDPMemTracker`` (issue 28, point 7).

The expected values are not nbtrain's: torch's tracker counts every tensor nbtrain's own FSDP2 step allocates on
rank 0 (``parallelize``, each micro-batch's forward, ``lm_loss`` and backward, AdamW) under ``FakeTensorMode`` with
the fake process group at the plan's world size, and the planner must land within 10% of its peak. The harness is
the benchmark's (``bench/memory_oracle.py``), which prints the same comparison as a table. ~20 s on 2 cores.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import nbtrain  # noqa: E402
from bench.memory_oracle import (counted, fake_world, frozen_llama, llama, llama_7b, lora_llama, plan_for,  # noqa: E402
                                 predicted)
from nbtrain.planner.cost import CostModel  # noqa: E402
from nbtrain.planner.plan import Plan  # noqa: E402

VOCAB, SEQ = 16384, 256  # as bench/memory_oracle.py's Llama: the loss's log-probabilities are over half the saved bytes


def _profile(dtype: str):
    with torch.device("meta"):
        model = llama()
    return nbtrain.profile(model, batch_size=1, seq_len=SEQ, dtype=dtype)


@pytest.fixture(scope="module")
def llama_profile():
    return _profile("fp32")


@pytest.fixture(scope="module")
def llama_bf16_profile():
    return _profile("bf16")


@pytest.mark.parametrize("world", [8, 64])
@pytest.mark.parametrize("plan", ["dp_shard={w}", "dp_shard={w} zero=2", "dp_shard={w} ac", "pp=1 mb=2 | dp_shard={w}",
                                  "pp=1 mb=2 | dp_shard={w} zero=2"],
                         ids=["zero3", "zero2", "checkpointed", "mb2-zero3", "mb2-zero2"])
def test_planner_memory_per_device_is_within_10_percent_of_fsdp_mem_tracker(llama_profile, plan, world):
    with fake_world(world):
        plan = plan_for(plan.format(w=world), llama_profile, world, SEQ)
        mine, parts = predicted(plan, llama_profile)
        theirs, kinds = counted(llama, plan, VOCAB)
    assert 0.9 <= mine / theirs <= 1.1, (f"{plan}: planner {mine / 2**20:.2f} MiB {parts} against the tracker's "
                                         f"{theirs / 2**20:.2f} MiB {kinds}")
    if plan.microbatches > 1:  # reduce-scattered every micro-batch (trainer.gradient_sync): only the shards are kept
        assert kinds["sharded_grad"] == pytest.approx(parts["grads"], rel=0.01)  # FSDP2 pads shards at 64
        assert "unsharded_grad" not in kinds


def test_the_loss_backward_is_the_peak_the_planner_prices_for_the_head(llama_profile):
    """The term the oracle found missing: at the step's peak torch counts two fp32 logits-sized temporaries (the
    cross-entropy's backward), and the planner's transient is exactly those."""
    world = 8
    logits_fp32 = (2 * SEQ * VOCAB) * 4  # 2 sequences a device, fp32 (lm_loss upcasts)
    with fake_world(world):
        plan = plan_for(f"dp_shard={world} ac", llama_profile, world, SEQ)
        _, parts = predicted(plan, llama_profile)
        _, kinds = counted(llama, plan, VOCAB)
    assert kinds["temp"] == 2 * logits_fp32
    assert parts["transient"] == 2 * logits_fp32


@pytest.mark.parametrize("plan", ["dp_shard=8", "dp_shard=8 zero=2"], ids=["zero3", "zero2"])
def test_bf16_planner_memory_is_within_10_percent_of_fsdp2_mixed_precision(llama_bf16_profile, plan):
    """The planner's bf16 (bf16 weights gathered and computed, fp32 master, moments and reduction) is FSDP2's
    ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, which ``fit(precision="bf16")`` gives an FSDP
    plan (``fit_worker.mixed_precision``; autocast over fp32 weights held more: bench/memory_oracle.py, 0.71-0.94)."""
    profile = llama_bf16_profile
    with fake_world(8):
        plan = plan_for(plan, profile, 8, SEQ)
        mine, parts = predicted(plan, profile)
        theirs, kinds = counted(llama, plan, VOCAB, precision="bf16")
    assert 0.9 <= mine / theirs <= 1.1, (f"{plan}: planner {mine / 2**20:.2f} MiB {parts} against the tracker's "
                                         f"{theirs / 2**20:.2f} MiB {kinds}")


@pytest.fixture(scope="module")
def fine_tuning_profiles():
    """The oracle's Llama with peft's LoRA (r=16 on q, k, v, o) and with its embedding and first block frozen."""
    profiles = {}
    for build in (lora_llama, frozen_llama):
        with torch.device("meta"):
            model = build()
        profiles[build] = nbtrain.profile(model, batch_size=1, seq_len=SEQ, dtype="fp32")
    return profiles


@pytest.mark.parametrize("build", [lora_llama, frozen_llama], ids=["lora", "frozen layers"])
@pytest.mark.parametrize("plan", ["dp_shard=8", "dp_shard=8 zero=2", "dp_shard=8 ac"], ids=["zero3", "zero2", "ac"])
def test_fine_tuning_plans_memory_is_within_10_percent_of_fsdp_mem_tracker_and_frozen_weights_hold_no_state(
        fine_tuning_profiles, build, plan):
    """Frozen weights (a LoRA base, layers frozen by hand) are held and gathered, but have no gradient and no AdamW
    state: the planner's optimizer part is what torch's AdamW allocates for the trained ones only."""
    profile = fine_tuning_profiles[build]
    with fake_world(8):
        plan = plan_for(plan, profile, 8, SEQ)
        mine, parts = predicted(plan, profile)
        theirs, kinds = counted(build, plan, VOCAB)
    assert 0.9 <= mine / theirs <= 1.1, (f"{plan}: planner {mine / 2**20:.2f} MiB {parts} against the tracker's "
                                         f"{theirs / 2**20:.2f} MiB {kinds}")
    assert parts["optimizer"] == pytest.approx(kinds["opt"], rel=0.05)
    trained = sum(layer.trained for layer in profile.layers)
    assert parts["optimizer"] == pytest.approx(trained * 8 / 8, rel=1e-6)  # two fp32 moments, sharded over 8


def test_under_zero_gradients_are_reduce_scattered_every_micro_batch_and_priced_so(llama_profile):
    """Issue 45: the trainer syncs FSDP2's gradients every micro-batch (torchtitan's accumulation), so between
    micro-batches only the fp32 shards are held (the tests above); the planner counts that sync's time once per
    micro-batch, where DDP's all-reduce stays once a step (DDP holds whole gradients anyway)."""
    from unittest import mock

    import torch.distributed as dist

    calls = {}
    with fake_world(8):
        for mb in (1, 2):
            plan = plan_for(f"pp=1 mb={mb} | dp_shard=8", llama_profile, 8, SEQ)
            with mock.patch.object(dist, "reduce_scatter_single", wraps=dist.reduce_scatter_single) as rs:
                counted(llama, plan, VOCAB)
            calls[mb] = rs.call_count
    assert calls[1] > 0 and calls[2] == 2 * calls[1]
    h100 = nbtrain.Cluster.from_catalog("H100", num_devices=8)

    def dp_comm(text: str) -> float:  # the gradients' sync: less the loss's all-reduce, once a step whatever mb
        plan = plan_for(text, llama_profile, 8, SEQ)
        loss = CostModel(llama_profile, h100, global_batch=plan.global_batch, seq_len=SEQ).loss_sync()
        return nbtrain.estimate(plan, llama_profile, h100).time.dp_comm - loss

    # twice the syncs of the same bytes, each hidden under half the backward: at least twice the exposed time
    assert dp_comm("pp=1 mb=2 | dp_shard=8") >= 2 * dp_comm("dp_shard=8") > 0
    assert dp_comm("pp=1 mb=2 | dp_replicate=8") < 1.5 * dp_comm("dp_replicate=8")  # DDP: once a step


@pytest.fixture(scope="module")
def llama_7b_profile():
    with torch.device("meta"):
        model = llama_7b()
    return nbtrain.profile(model, batch_size=1, seq_len=2048, dtype="fp32")


@pytest.mark.slow
@pytest.mark.parametrize("plan,rows", [("pp=1 mb=2 | dp_shard=8", 2), ("pp=1 mb=2 | dp_shard=8 ac", 2),
                                       ("pp=1 mb=2 | dp_shard=8 zero=2", 2), ("pp=1 mb=2 | dp_shard=8 zero=2 ac", 2)],
                         ids=["mb2-zero3", "mb2-zero3-ac", "mb2-zero2", "mb2-zero2-ac"])
def test_llama_7b_shape_at_world_8_is_within_10_percent_of_fsdp_mem_tracker(llama_7b_profile, plan, rows):
    """Issue 45's shape: a transformers Llama of Llama-2-7B's size in fp32, 1 × 2048 tokens a device per micro-batch,
    FSDP2 at world 8 (~10 s of CPU each, ~50 s for the four with the profile; bench/memory_oracle.py --7b prints
    them with mb=1 beside). Where the planner was 0.67 of the tracker (full checkpointing, ZeRO-3),
    the executor held what a GPU would hold too: every layer's whole gradient between micro-batches (now
    reduce-scattered each micro-batch), each layer's reduce output to the end of backward (FSDP2's HSDP path, which a
    2-D mesh of one replica took: now the 1-D ``dp_shard`` mesh, parallelize.fsdp_mesh), and under ZeRO-2 the fp32
    shards beside the gathered parameters (now priced). The tracker's attention is torch's CPU flash kernel (it saves
    the output and log-sum-exp, not the 2048 × 2048 scores), as a GPU's flash attention saves: nothing CPU-only."""
    with fake_world(8):
        plan = Plan.parse(plan, num_devices=8, num_layers=len(llama_7b_profile.layers), global_batch=8 * rows,
                          seq_len=2048)
        mine, parts = predicted(plan, llama_7b_profile)
        theirs, kinds = counted(llama_7b, plan, 32000)
    assert 0.9 <= mine / theirs <= 1.1, (f"{plan}: planner {mine / 2**30:.2f} GiB {parts} against the tracker's "
                                         f"{theirs / 2**30:.2f} GiB {kinds}")
