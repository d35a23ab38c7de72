"""The CPU update offload with tensor and pipeline parallelism: each rank offloads the update of its own
DTensor shard of a TP layer, beside FSDP2's shards and device-updated layers, and each pipeline stage the updates of
its own layers during its last micro-batch's backward; the run trains exactly like one process, with the global norm's clipping (``verify``'s default, ``clip_norm=1``: every step clips here) and without.

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


PIPELINE_PLANS = [
    "pp=2 mb=2 offload=1",                                         # 1F1B, every layer's update on the CPU
    "pp=2 mb=4 schedule=gpipe | 0-1: offload=1; 2-3: offload=0",  # GPipe, a stage offloaded beside one that is not
    "pp=2 mb=2 | 0: offload=0.5; 1-3: offload=1",                  # half of the tied embedding's update on the CPU
]


@pytest.mark.parametrize("plan, clip_norm", [(PIPELINE_PLANS[0], 1.0), (PIPELINE_PLANS[0], None),
                                             (PIPELINE_PLANS[1], 1.0), (PIPELINE_PLANS[2], 1.0)],
                         ids=["1f1b-clipped", "1f1b-unclipped", "gpipe-mixed-clipped", "tied-half-clipped"])
def test_offload_in_a_pipeline_trains_like_one_process(plan, clip_norm):
    # Hugging Face GPT-2 (dropout on in fit; verify turns it off in both runs): its head is tied to the embedding in
    # the other stage, so each end stage offloads its copy's update, after the two have summed their gradients
    report = verify("tests.verify_models:gpt2", plan, processes=2, steps=5, batch=4, seq=32, clip_norm=clip_norm,
                    timeout=300)
    assert report.ok, str(report)


@pytest.mark.parametrize("clip_norm", [1.0, None], ids=["clipped", "unclipped"])
def test_offload_in_a_pipeline_of_fsdp_stages_on_four_processes_trains_like_one_process(clip_norm):
    # each stage's FSDP2 reduce-scatters during its last micro-batch backward, handing the shards to the CPU update
    plan = "pp=2 mb=2 schedule=gpipe | 0-1: dp_shard=2 offload=1; 2-3: dp_shard=2 offload=0.5"
    report = verify("tests.verify_models:gpt2", plan, processes=4, steps=5, batch=4, seq=32, clip_norm=clip_norm,
                    timeout=300)
    assert report.ok, str(report)


def test_offload_in_a_traced_pipeline_trains_like_one_process():
    # BERT's stages are traced graphs; their updates land in step() (the graph's modules are not the model's)
    import tests.any_models as zoo

    report = verify("tests.any_models:bert_mlm", "pp=2 mb=2 offload=1", processes=2, steps=5, batch=4, seq=16,
                    timeout=240, data=zoo.mlm_batches(steps=2), loss_fn=zoo.mlm_loss)
    assert report.ok, str(report)


@pytest.mark.parametrize("plan", ["tp=2 offload=1", "pp=2 mb=2 offload=1"])
def test_offload_in_bf16_trains_like_the_same_bf16_run_without_offload(plan):
    # bf16 compute, fp32 weights and update; the offloaded gradients cross to the CPU in bf16, so the two runs part
    # by bf16's rounding of those gradients and no more
    import torch

    import nbtrain

    g = torch.Generator().manual_seed(3)
    data = [(ids, torch.roll(ids, -1, dims=1)) for ids in (torch.randint(0, 512, (4, 32), generator=g)
                                                           for _ in range(5))]
    runs = []
    for text in (plan, plan.replace(" offload=1", "")):
        torch.manual_seed(0)
        model = nbtrain.build_preset("llama-tiny", device="cpu")
        runs.append(nbtrain.fit(model, data, plan=text, steps=5, num_processes=2, lr=1e-2, clip_norm=1.0,
                                precision="bf16", progress=False, timeout=180))
    offloaded, on_device = runs
    assert offloaded.trace is not None and on_device.trace is None  # the first did offload
    assert offloaded.losses == pytest.approx(on_device.losses, rel=2 ** -8)  # bf16's relative precision
