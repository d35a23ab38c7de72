"""Run a few plans in real gloo worker processes and in one process, on the same seed and data.

Workers are forked, as nbtrain's own launch forks its workers: each sets one intra-op thread before any torch work,
so the parent's thread pool is never waited on, and nothing is imported again (a spawned group of 4 paid ~6 s of
``import torch, transformers`` on 2 cores, half of these tests' time). Each runs several plans in one process group.
"""

from __future__ import annotations

import contextlib
import io
import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nbtrain.models import GPT, GPTConfig
from nbtrain.planner.plan import Plan
from nbtrain.profiler.model import lm_loss

GPT_TINY = GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=32, tie_embeddings=False)
LLAMA_TINY = GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden=48,
                       norm="rmsnorm", mlp="swiglu", position="rope", bias=False, tie_embeddings=False)
BATCH, SEQ, STEPS = 4, 16, 5
VOCAB = 128


def gpt():
    return GPT(GPT_TINY)


def llama():
    return GPT(LLAMA_TINY)


def hf_llama():
    """A transformers Llama of the same shape as LLAMA_TINY (transformers is a test dependency)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         tie_word_embeddings=False, use_cache=False)
    return LlamaForCausalLM(config)


def hf_gpt2(**overrides):
    """A transformers GPT-2 (tied embeddings, fused Conv1D attention) of a tiny config, dropout off."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, **overrides)
    return GPT2LMHeadModel(config)


def batches(steps: int = STEPS):
    """Two fixed batches in turn: the model can learn them, so the losses move and a wrong gradient shows."""
    g = torch.Generator().manual_seed(1234)
    fixed = [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(2)]
    for step in range(steps):
        ids = fixed[step % 2]
        yield ids, torch.roll(ids, -1, dims=1)


def reference_losses(build, clip_norm: float | None = None) -> list[float]:
    """One process, the whole batch, plain PyTorch."""
    torch.manual_seed(0)
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for ids, targets in batches():
        loss = lm_loss(model(ids), targets)
        loss.backward()
        if clip_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@contextlib.contextmanager
def gloo_worker(rank: int, world: int, port: int, queue):
    """The life of a worker: one intra-op thread, the gloo group formed, and ``report(payload)`` to answer
    (``(rank, "ok", payload)`` on the queue, then a barrier so no rank leaves while a peer still talks); an
    exception in the body goes on the queue as ``(rank, "error", traceback)`` instead; the group is destroyed."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))

    def report(payload) -> None:
        # by value: a tensor put on the queue as it is travels as a shared-memory handle that the parent can open
        # only while this process lives, and the workers may exit before the parent has read every answer
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        queue.put((rank, "ok", buffer.getvalue()))
        dist.barrier()

    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        yield report
    except Exception:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _worker(rank, world, port, build, plans, clip_norm, split_logits, queue):
    with gloo_worker(rank, world, port, queue) as report:
        from nbtrain.run.parallel.mesh import PlanMeshes
        from nbtrain.models.description import layer_slots
        from nbtrain.run.parallel.parallelize import parallelize
        from nbtrain.run.trainer import Trainer

        results = {}
        for text in plans:
            torch.manual_seed(0)
            model = build()
            plan = Plan.parse(text, num_devices=world, num_layers=len(layer_slots(model)), global_batch=BATCH,
                              seq_len=SEQ)
            meshes = PlanMeshes(plan)
            model = parallelize(model, plan, meshes, split_logits=split_logits)
            trainer = Trainer(model, plan, meshes, torch.optim.AdamW(model.parameters(), lr=1e-2),
                              clip_norm=clip_norm)
            results[text] = [trainer.step(ids, targets).loss for ids, targets in batches()]
        report(results)


def spawn_group(worker, world: int, *args, timeout: float = 300):
    """Start ``world`` gloo workers (forked) ``worker(rank, world, port, *args, queue)``, each putting ``(rank, "ok",
    payload)`` or ``(rank, "error", traceback)`` on the queue; returns rank 0's payload, or fails with the first
    worker's traceback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # forked, as nbtrain's own workers are (one intra-op thread each, set first in gloo_worker): a spawned worker
    # imports torch and transformers again, ~6 s for a group of 4 on 2 cores, which was half of these tests' time
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, port, *args, queue), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    try:
        answers = [queue.get(timeout=timeout) for _ in range(world)]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    errors = [payload for _, status, payload in answers if status == "error"]
    if errors:
        raise AssertionError("a worker failed:\n" + errors[0])
    payload = next(payload for rank, _, payload in answers if rank == 0)
    return torch.load(io.BytesIO(payload), weights_only=False) if isinstance(payload, bytes) else payload


def distributed_losses(build, plans: list[str], world: int, clip_norm: float | None = None,
                       timeout: float = 300, split_logits: bool = False) -> dict:
    """``{plan: [loss per step]}`` from rank 0 of ``world`` gloo processes (``split_logits``: a
    tensor-parallel head keeps its logits split for the vocabulary-parallel loss, as ``fit`` runs nbtrain's own)."""
    return spawn_group(_worker, world, build, plans, clip_norm, split_logits, timeout=timeout)


def assert_trains_like_one_process(build, plans: list[str], world: int) -> list[float]:
    """Each of ``plans`` on ``world`` gloo processes gives one process's losses step by step (relative
    1e-4); returns the one process's losses."""
    import pytest

    reference = reference_losses(build)
    got = distributed_losses(build, plans, world=world)
    for plan in plans:
        assert got[plan] == pytest.approx(reference, rel=1e-4), plan
    return reference


def losses_by_world(build, plans: dict[int, list[str]]) -> dict:
    """``{"reference": [loss per step] of one process, world: {plan: [loss per step]}}`` for each world size's
    plans, run in that many gloo processes."""
    return {"reference": reference_losses(build),
            **{world: distributed_losses(build, listed, world=world) for world, listed in plans.items()}}


@contextlib.contextmanager
def single_process_group():
    """A gloo process group of this process alone (an in-memory store), destroyed on exit."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
