"""The vocabulary-parallel loss: under tensor parallelism nbtrain's own loss runs on the head's logits split over the
vocabulary (each TP rank holds 1/tp of them, as torchtitan and Megatron-LM run), trains exactly like one process,
and the planner counts the head's memory as the executor then holds it. A user's own loss still gets whole logits."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import nbtrain
from tests.distributed_fixtures import (BATCH, SEQ, batches, distributed_losses, gloo_worker, hf_llama, llama,
                                  reference_losses, spawn_group)
from nbtrain.models import GPT, GPTConfig
from nbtrain.planner.cost import estimate
from nbtrain.planner.plan import Plan
from nbtrain.profiler.model import lm_loss
from nbtrain.run.parallel.vocab_parallel import takes_vocab_parallel_loss

BIG_VOCAB = GPTConfig(vocab_size=2048, block_size=32, n_layer=1, n_head=4, n_embd=32, tie_embeddings=False)


def _close(losses, reference):
    assert max(abs(a - b) / b for a, b in zip(losses, reference)) <= 1e-4, (losses, reference)


@pytest.mark.parametrize("build", [llama, hf_llama], ids=["nbtrain-llama", "transformers-llama"])
def test_split_logits_train_like_one_process_on_two_processes(build):
    reference = reference_losses(build)
    for plan, losses in distributed_losses(build, ["tp=2", "tp=2 sp ac=op"], world=2, split_logits=True).items():
        _close(losses, reference)


def test_split_logits_with_fsdp_and_in_a_pipeline_on_four_processes_train_like_one_process():
    reference = reference_losses(llama)
    plans = ["dp_shard=2 tp=2", "pp=2 tp=2 mb=2"]
    for plan, losses in distributed_losses(llama, plans, world=4, split_logits=True).items():
        _close(losses, reference)


def test_the_default_loss_is_split_and_a_users_own_loss_gets_whole_logits():
    plan = Plan.parse("tp=2", num_devices=2, num_layers=4)
    assert takes_vocab_parallel_loss(plan, None) and takes_vocab_parallel_loss(plan, lm_loss)
    assert not takes_vocab_parallel_loss(plan, lambda output, targets: lm_loss(output, targets))
    assert not takes_vocab_parallel_loss(Plan.parse("dp_shard=2", num_devices=2, num_layers=4), lm_loss)


def _memory_worker(rank, world, port, queue):
    with gloo_worker(rank, world, port, queue) as report:
        from nbtrain.models.description import layer_slots
        from nbtrain.run.parallel.mesh import PlanMeshes
        from nbtrain.run.parallel.parallelize import parallelize
        from nbtrain.run.trainer import Trainer

        seen = {}
        for split in (False, True):
            torch.manual_seed(0)
            model = GPT(BIG_VOCAB)
            plan = Plan.parse("tp=2", num_devices=world, num_layers=len(layer_slots(model)), global_batch=BATCH,
                              seq_len=SEQ)
            meshes = PlanMeshes(plan)
            model = parallelize(model, plan, meshes, split_logits=split)
            ids, targets = next(iter(batches(1)))
            logits = model(ids % BIG_VOCAB.vocab_size)
            local = getattr(logits, "_local_tensor", logits)
            trainer = Trainer(model, plan, meshes, torch.optim.AdamW(model.parameters(), lr=1e-2))
            saved = max(trainer.step(ids, targets).tensor_bytes for ids, targets in batches(2))
            seen[split] = (local.shape[-1], saved)
        report(seen)


def test_each_rank_holds_half_the_logits_and_the_planner_predicts_the_memory_that_saves():
    """Measured: the bytes autograd saves on a TP rank (saved-tensor hooks) with whole and with split logits; their
    difference is the loss's fp32 log-probabilities it no longer holds whole, which the cost model must predict."""
    seen = spawn_group(_memory_worker, 2)
    (whole_vocab, whole_bytes), (split_vocab, split_bytes) = seen[False], seen[True]
    assert (whole_vocab, split_vocab) == (2048, 1024)
    measured = whole_bytes - split_bytes
    assert measured > 0
    profile = nbtrain.profile(GPT(BIG_VOCAB), batch_size=BATCH, seq_len=SEQ)
    cluster = nbtrain.Cluster.from_catalog("H100", num_devices=2)
    plan = Plan.parse("tp=2", num_devices=2, num_layers=len(profile.layers), global_batch=BATCH, seq_len=SEQ)
    predicted = {}
    for split in (False, True):
        arch = {**profile.arch, "vocab_parallel_loss": split}
        prediction = estimate(plan, dataclasses.replace(profile, arch=arch), cluster)
        predicted[split] = sum(stage.memory.activations for stage in prediction.stages)
    assert predicted[False] - predicted[True] == pytest.approx(measured, rel=0.10)
