"""The CPU update offload with tensor parallelism (issue 30, point 1): each rank offloads the update of its own
DTensor shard of a TP layer, beside FSDP2's shards and device-updated layers, and the run trains exactly like one
process, with the global norm's clipping (``verify``'s default, ``clip_norm=1``: every step clips here) and without.

The reference is ``nbtrain.verify``'s: the same model, batches and AdamW in one process (``clip_grad_norm_`` when
clipping), compared step by step (losses within 1e-4) and in the trained weights."""

from __future__ import annotations

import pytest

from nbtrain.run.verify import verify


@pytest.mark.parametrize("clip_norm", [1.0, None], ids=["clipped", "unclipped"])
@pytest.mark.parametrize("plan", [
    "tp=2 offload=1",                                  # every layer split and offloaded, the embedding row-wise
    "tp=2 sp offload=0.5",                             # sequence parallel norms, half of each update on the CPU
    "0-2: tp=2 offload=1; 3-5: tp=2",                  # offloaded layers beside device-updated ones
    "0: dp_shard=2 offload=1; 1-4: tp=2 offload=0.5; 5: dp_shard=2",   # FSDP2's shards and TP's, mixed
])
def test_offload_under_tensor_parallelism_trains_like_one_process(plan, clip_norm):
    report = verify("llama-tiny", plan, processes=2, steps=5, batch=4, seq=32, clip_norm=clip_norm, timeout=300)
    assert report.ok, str(report)


@pytest.mark.parametrize("clip_norm", [1.0, None], ids=["clipped", "unclipped"])
def test_offload_under_fsdp_and_tensor_parallelism_on_four_processes_trains_like_one_process(clip_norm):
    report = verify("llama-tiny", "dp_shard=2 tp=2 offload=1", processes=4, steps=5, batch=4, seq=32,
                    clip_norm=clip_norm, timeout=300)
    assert report.ok, str(report)
