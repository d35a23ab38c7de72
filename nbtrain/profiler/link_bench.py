"""The micro-benchmarks behind :mod:`nbtrain.profiler.collectives`, run inside spawned gloo workers.

    $ python -m nbtrain.profiler.link_bench 2 links.json     # measure_links(2), ~15 s on 2 cores, kept as JSON

Sizes are small enough for a 2-core machine to finish in seconds and large enough to show bandwidth (8 MiB) and
latency (64 KiB). Every timing is the median of a few repeats started together after a barrier, and the slowest
rank's median is kept: a collective ends when its slowest member does.
"""

from __future__ import annotations

import copy
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from nbtrain.errors import InvalidArgumentError
from nbtrain.profiler.calibrate import run_spawned
from nbtrain.profiler.collectives import Links, links_from
from nbtrain.profiler.link_bench_experts import expert_dispatch
from nbtrain.profiler.link_timing import (REPEATS, added_seconds, group_sizes, median_seconds, once_seconds,
                                          slowest_rank)

COLLECTIVE_SIZES = (64 * 2**10, 512 * 2**10, 2 * 2**20, 8 * 2**20)
LAYER_WIDTHS = (128, 256, 512)  # Linear(h, h) layers of 64 KiB, 256 KiB, 1 MiB in fp32 for the FSDP2 overhead
TP_SHAPES = ((256, 128), (512, 192), (1024, 256))  # (tokens, hidden) for the TP pair: 128 KiB to 1 MiB of state
TP_BLOCKS = ((4, 64, 128), (8, 128, 128), (8, 128, 256))  # (batch, seq, hidden): 128 KiB to 1 MiB of state
FSDP_BLOCKS = ((8, 64, 64), (4, 64, 128), (8, 128, 256))  # blocks of 0.2, 0.8 and 3 MiB of fp32 parameters
DDP_WIDTHS = (32, 64, 128, 256)  # nbtrain's GPT of 2 blocks, 512 tokens: 0.23, 0.65, 2.0 and 7.1 MiB of gradients
PP_WIDTHS = (64, 256, 1024)  # a micro-batch of 4 × 32 tokens of width h: 32 KiB to 512 KiB sent between stages
PP_DEPTHS = (16, 8, 1)  # Linear(h, h) layers a stage: 1-6 ms of compute a micro-batch on one core, as a real stage has
PP_MICROBATCHES = (2, 8)
TP_LOSS_TOKENS = (256, 1024, 4096)  # tokens at a language model's head, over a vocabulary of TP_LOSS_VOCAB
TP_LOSS_VOCAB = 512


def _collectives(world: int) -> list[tuple[str, int, int, float]]:
    """Inside a spawned worker: (op, group, bytes, seconds) for each plain collective."""
    rank, found = dist.get_rank(), []
    for k in group_sizes(world):
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world // k, k), mesh_dim_names=("outer", "g"))
        group, local = mesh.get_group("g"), mesh.get_local_rank("g")
        ranks = dist.get_process_group_ranks(group)
        for nbytes in COLLECTIVE_SIZES:
            whole = torch.ones(nbytes // 4)
            part = torch.ones(nbytes // 4 // k)
            sent = torch.empty_like(whole)
            pair = ranks[local ^ 1] if (local ^ 1) < k else None
            steps = {
                "all_reduce": lambda: dist.all_reduce(whole, group=group),
                "all_gather": lambda: dist.all_gather_into_tensor(whole, part, group=group),
                "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, whole, group=group),
                # expert parallelism's dispatch: each rank sends 1/k of its bytes to each rank (gloo has it on the CPU)
                "all_to_all": lambda: dist.all_to_all_single(sent, whole, group=group),
                "p2p": (lambda: dist.send(whole, pair, group=None)) if local % 2 == 0 else
                       (lambda: dist.recv(whole, pair, group=None)),
            }
            for op, step in steps.items():
                found.append((op, k, nbytes, slowest_rank(median_seconds(step, dist.barrier))))
    del rank
    return found


def _fsdp_layers(world: int) -> list[tuple[str, int, int, float]]:
    """Inside a spawned worker: what FSDP2 adds per Linear layer, forward and backward, by parameter bytes."""
    from torch.distributed.fsdp import fully_shard

    found, layers = [], 4
    for k in group_sizes(world):
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world // k, k), mesh_dim_names=("outer", "g"))
        for h in LAYER_WIDTHS:
            torch.manual_seed(0)
            plain = nn.Sequential(*(nn.Linear(h, h, bias=False) for _ in range(layers)))
            x = torch.randn(32, h)
            for zero in (3, 2):
                sharded = copy.deepcopy(plain)
                for layer in sharded:
                    fully_shard(layer, mesh=mesh["g"], reshard_after_forward=zero == 3)
                fully_shard(sharded, mesh=mesh["g"], reshard_after_forward=zero == 3)
                fwd, bwd = added_seconds(plain, sharded, x)
                nbytes = h * h * 4
                if zero == 3:
                    found.append(("fsdp_forward", k, nbytes, slowest_rank(fwd / layers)))
                    found.append(("fsdp_backward", k, nbytes, slowest_rank(bwd / layers)))
                else:
                    found.append(("fsdp_backward_2", k, nbytes, slowest_rank(bwd / layers)))
    return found


def _tp_pairs(world: int) -> list[tuple[str, int, int, float]]:
    """Inside a spawned worker: what DTensor TP adds to a colwise → rowwise pair beyond its split compute."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    found = []
    for k in group_sizes(world):
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world // k, k), mesh_dim_names=("outer", "g"))
        for tokens, h in TP_SHAPES:
            torch.manual_seed(0)
            plain = nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h))
            x = torch.randn(tokens, h)
            split = parallelize_module(copy.deepcopy(plain), mesh["g"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
            fwd, bwd = added_seconds(plain, split, x, compute_share=1 / k)
            nbytes = tokens * h * 4
            found.append(("tp_forward", k, nbytes, slowest_rank(fwd)))
            found.append(("tp_backward", k, nbytes, slowest_rank(bwd)))
    return found


def _tp_blocks(world: int) -> list[tuple[str, int, int, float]]:
    """Inside a spawned worker: what tensor parallelism adds to a whole transformer block (nbtrain's GPT block:
    q, k, v colwise, o rowwise, the MLP's pair; its norms and attention on the local heads), by hidden-state bytes,
    beyond its split compute. The block is split as the executor splits it, the attention's input handed over once
    (:class:`~nbtrain.models.tensor_parallel.ShareInput`)."""
    from torch.distributed.tensor.parallel import parallelize_module

    from nbtrain.models.description import describe
    from nbtrain.models.tensor_parallel import ShareInput, shared_input_modules, style_for

    found = []
    for k in [k for k in group_sizes(world) if k <= 4]:  # 4 heads: split at most 4 ways
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world // k, k), mesh_dim_names=("outer", "g"))
        for batch, seq, h in TP_BLOCKS:
            model = _gpt_block_model(seq, h)
            split = copy.deepcopy(model)
            description = describe(split)
            shared = shared_input_modules(split.blocks[0], description.names[1][0], description.tensor_parallel[1])
            for name, style in description.tensor_parallel[1]:
                module = split.get_submodule(name)
                parallelize_module(module, mesh["g"], style_for(module, style))
            for name, first in shared:
                parallelize_module(split.get_submodule(name), mesh["g"], ShareInput(first))
            x = torch.randn(batch, seq, h)
            fwd, bwd = added_seconds(model.blocks[0], split.blocks[0], x, compute_share=1 / k)
            nbytes = batch * seq * h * 4
            found.append(("tp_block_forward", k, nbytes, slowest_rank(fwd)))
            found.append(("tp_block_backward", k, nbytes, slowest_rank(bwd)))
            found.append(("tp_clip", k, _param_bytes(model.blocks[0]), _clip(split.blocks[0], x)))
    return found


def _tp_loss(world: int) -> list[tuple[str, int, int, float]]:
    """Inside a spawned worker: what the vocabulary-parallel loss adds to a step beyond the cross-entropy of this
    rank's share of the logits, by the bytes of one fp32 number a token (what each of its all-reduces carries):
    nbtrain's own loss on logits split over the vocabulary, forward and backward under torch's ``loss_parallel``,
    as the trainer takes it (:mod:`nbtrain.run.parallel.vocab_parallel`): three all-reduces, and DTensor's work
    on every op of the loss. On 2 gloo processes here it added 4.8 ms to the forward of a transformers Qwen2's
    ``tp=2`` step of 1,024 tokens, which nothing priced (``bench/RESULTS.md``, "The loss under tensor
    parallelism")."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    from nbtrain.profiler.model import lm_loss

    found = []
    for k in [k for k in group_sizes(world) if k <= 4]:
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world // k, k), mesh_dim_names=("outer", "g"))
        share = TP_LOSS_VOCAB // k
        start = mesh.get_local_rank("g") * share
        for tokens in TP_LOSS_TOKENS:
            torch.manual_seed(0)
            whole = torch.randn(tokens // 64, 64, TP_LOSS_VOCAB, requires_grad=True)
            local = whole.detach()[..., start:start + share].clone().requires_grad_()
            targets = torch.randint(0, TP_LOSS_VOCAB, (tokens // 64, 64))

            def plain():
                lm_loss(whole, targets).backward()
                whole.grad = None

            def split():
                with loss_parallel():
                    lm_loss(DTensor.from_local(local, mesh["g"], [Shard(-1)]), targets).backward()
                local.grad = None
            plain(), split()  # warm-up
            rounds = [once_seconds(split) - once_seconds(plain) / k for _ in range(REPEATS)]
            found.append(("tp_loss", k, tokens * 4, slowest_rank(max(0.0, statistics.median(rounds)))))
    return found


def _gpt_block_model(seq: int, h: int):
    from nbtrain.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, block_size=seq, n_layer=1, n_head=4, n_embd=h, tie_embeddings=False))


def _param_bytes(module) -> int:
    return sum(p.numel() for p in module.parameters()) * 4


def _clip(block, x) -> float:
    """The slowest rank's median seconds to clip ``block``'s gradients (DTensors) by their global norm, as the
    trainer does every step (:func:`nbtrain.gradients.clip_grad_norm`: a norm per group of like DTensors, their
    reduction, the scaling)."""
    from nbtrain.gradients import clip_grad_norm

    block(x).sum().backward()
    params = list(block.parameters())
    return slowest_rank(median_seconds(lambda: clip_grad_norm(params, 1e-3), dist.barrier))


def _fsdp_blocks(world: int) -> list[tuple[str, int, int, float]]:
    """Inside a spawned worker: what FSDP2 adds to a whole transformer block (nbtrain's GPT block, its ~10
    parameter tensors one FSDP unit), forward and backward, by the block's parameter bytes."""
    from torch.distributed.fsdp import fully_shard

    found = []
    for k in group_sizes(world):
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world // k, k), mesh_dim_names=("outer", "g"))
        for batch, seq, h in FSDP_BLOCKS:
            plain = _gpt_block_model(seq, h).blocks[0]
            nbytes = _param_bytes(plain)
            x = torch.randn(max(1, batch // k), seq, h)  # data parallel: each rank its share of the batch
            for zero in (3, 2):
                sharded = copy.deepcopy(plain)
                fully_shard(sharded, mesh=mesh["g"], reshard_after_forward=zero == 3)
                fwd, bwd = added_seconds(plain, sharded, x)
                if zero == 3:
                    found.append(("fsdp_block_forward", k, nbytes, slowest_rank(fwd)))
                    found.append(("fsdp_clip", k, nbytes, _clip(sharded, x)))
                found.append(("fsdp_block_backward" if zero == 3 else "fsdp_block_backward_2", k, nbytes,
                              slowest_rank(bwd)))
    return found


def _block_step(x, block) -> None:
    block(x).sum().backward()


def _compute_slowdown() -> float:
    """Inside a spawned worker: how much slower a training step's compute (a transformer block's forward and
    backward over 4 × 128 tokens: matmuls, and the norms, softmax and activations that stream memory) runs when
    every process computes at once than when rank 0 computes alone, the others waiting in a barrier: the cores,
    caches and memory bandwidth the processes share."""
    net = _gpt_block_model(128, 192).blocks[0]
    x = torch.randn(4, 128, 192)
    _block_step(x, net)
    ratios = []
    # alone and together back to back, so that the machine's drift cancels in each ratio; 27 rounds (~1.5 s): with 9,
    # 2 processes here read 1.00-1.07 in 7 measurements and 1.23-1.25 in 2 of 9, and every compute time is priced by it
    for _ in range(3 * REPEATS):
        dist.barrier()
        alone = torch.tensor([0.0], dtype=torch.float64)
        if dist.get_rank() == 0:
            started = time.perf_counter()
            _block_step(x, net)
            alone[0] = time.perf_counter() - started
        dist.broadcast(alone, 0)
        together = slowest_rank(once_seconds(lambda: _block_step(x, net)))
        ratios.append(together / float(alone))
    return max(1.0, statistics.median(ratios))


def _training_step(model, x):
    """One training step of ``model`` on ``x`` as the trainer runs it (forward, backward, a fused AdamW step,
    gradients set to None), as a function."""
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)

    def step():
        model(x).float().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def _ddp_backward(world: int) -> list[tuple[str, int, int, float]]:
    """Inside a spawned worker: what DistributedDataParallel adds to training steps of a small transformer (nbtrain's
    GPT of 2 blocks over 8 × 64 tokens a process), by gradient bytes: its bucketed all-reduces, its hooks, and what
    it costs beside the compute that runs with it.

    Whole training steps, not a forward and a backward timed apart: those read about half of what DDP adds to a
    training loop here (``bench/ddp_overhead.py``). A plain and a wrapped step back to back in each round, and the
    median of the rounds' differences, as the pipeline's micro-batch is measured below. And the compute beside DDP
    matters, not only the bytes: on 2 gloo processes here DDP added 2.0 ms to 4 Linear layers of 576 KiB (a 2.9 ms
    step), 4.8 to this GPT of 663 KiB (10.6 ms) and 4.5 to a transformers Qwen2 of 546 KiB (10.9 ms); this GPT over
    half the tokens read about half (``bench/RESULTS.md``, "FSDP2, TP and DDP priced as a fine-tuned model's step
    pays them"). A model of transformer blocks with a fine-tuning step's compute is what the planner's DDP steps
    are like on a CPU; a step of much more compute beside DDP pays more than this."""
    from torch.nn.parallel import DistributedDataParallel

    from nbtrain.models.gpt import GPT, GPTConfig

    found = []
    for k in group_sizes(world):
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world // k, k), mesh_dim_names=("outer", "g"))
        for h in DDP_WIDTHS:
            torch.manual_seed(0)
            plain = GPT(GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=4, n_embd=h, tie_embeddings=False))
            x = torch.randint(0, 512, (8, 64))
            wrapped = DistributedDataParallel(copy.deepcopy(plain), process_group=mesh.get_group("g"))  # no buffers
            steps = _training_step(plain, x), _training_step(wrapped, x)
            for step in steps:
                step()  # warm-up: allocation, the optimizer's state, gloo's connections, DDP's buckets
            rounds = [once_seconds(steps[1]) - once_seconds(steps[0]) for _ in range(REPEATS)]
            found.append(("ddp_backward", k, _param_bytes(plain), slowest_rank(max(0.0, statistics.median(rounds)))))
    return found


def _pipeline_microbatch(world: int) -> list[tuple[str, int, int, float]]:
    """Inside a spawned worker: what one more micro-batch costs a 2-stage pipeline of
    ``torch.distributed.pipelining`` (1F1B, as the executor runs it) beyond its compute, by the bytes of the hidden
    state the stages exchange: the schedule's own work per micro-batch (its actions, shape checks, the loss call, a
    backward call per micro-batch) and the send and receive each way. Each stage is a few Linear layers
    (:data:`PP_DEPTHS`), so the difference between 8 and 2 micro-batches of the same shape, less those micro-batches'
    compute timed alone, is the schedule's. The stages compute for milliseconds between transfers, as real stages
    do: with one Linear layer a stage (0.2 ms) this read 0.3-1.2 ms a micro-batch here, with 1-5 ms of compute
    1.3-1.9 ms, and a 2-stage pipeline of a transformers Llama measured 1.4-2.2x its prediction.

    The three timings are taken in rounds, one of each back to back, and the round's difference is kept: a
    difference of two medians taken a few seconds apart read 1.35, 0.35 and 3.5 ms at 32, 128 and 512 KiB in one
    measurement and 1.25, 2.34 and 0 (negative) in the next, the machine's drift between the medians larger than
    the micro-batches' cost."""
    from torch.distributed.pipelining import PipelineStage

    found = []
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("outer", "pp"))
    group, stage = mesh.get_group("pp"), mesh.get_local_rank("pp")
    for h, depth in zip(PP_WIDTHS, PP_DEPTHS):
        torch.manual_seed(0)
        layer = nn.Sequential(*(nn.Linear(h, h) for _ in range(depth)))
        x = torch.randn(4, 32, h)
        steps = {m: _schedule_step(PipelineStage(layer, stage, 2, torch.device("cpu"), group=group), stage, m,
                                   torch.randn(4 * m, 32, h)) for m in PP_MICROBATCHES}
        for step in steps.values():
            step()  # warm-up: the stage infers its shapes, gloo connects
        low, high = PP_MICROBATCHES
        rounds = []
        for _ in range(REPEATS):
            alone = once_seconds(lambda: layer(x).sum().backward())  # one micro-batch's compute, one stage
            seconds = {m: once_seconds(steps[m]) for m in PP_MICROBATCHES}
            rounds.append((seconds[high] - seconds[low]) / (high - low) - alone)
        found.append(("pp_microbatch", 2, 4 * 32 * h * 4, max(0.0, slowest_rank(statistics.median(rounds)))))
    return found


def _schedule_step(pipe, stage: int, microbatches: int, batch: torch.Tensor):
    """One training step of a 1F1B schedule over ``pipe`` (this rank's stage of 2), as a function."""
    from torch.distributed.pipelining import Schedule1F1B

    schedule = Schedule1F1B(pipe, n_microbatches=microbatches, loss_fn=lambda out, target: out.sum())

    def step():
        if stage == 0:
            schedule.step(batch)
        else:
            schedule.step(target=batch, losses=[])
    return step


def measure_in_worker(world: int) -> tuple[list, float]:
    """Everything :func:`measure_links` measures, run inside each of ``world`` initialised gloo processes."""
    torch.set_num_threads(1)
    return (_collectives(world) + _fsdp_layers(world) + _tp_pairs(world) + _tp_blocks(world) + _tp_loss(world)
            + _fsdp_blocks(world) + _ddp_backward(world) + _pipeline_microbatch(world)
            + expert_dispatch(world)), _compute_slowdown()


def measure_links(world_size: int = 2, *, timeout: float = 300.0) -> Links:
    """Measure every operation of the table above among ``world_size`` spawned gloo processes (~15 s for 2 on
    2 cores): ``measure_links(4)`` also measures the groups of 2 inside 4, both pairs at once."""
    if world_size < 2:
        raise InvalidArgumentError(f"communication needs world_size ≥ 2 processes, got {world_size}")
    results = run_spawned(measure_in_worker, world_size, world_size, timeout=timeout, what="communication benchmark")
    points, slowdown = results[0]  # every rank agreed on the slowest time of each point (slowest_rank)
    return links_from(points, world_size, slowdown)


def main(argv=None) -> None:
    """``python -m nbtrain.profiler.link_bench WORLD FILE``: measure among WORLD processes, write the links to FILE
    as JSON. :func:`nbtrain.profiler.collectives.cached_links` runs it so, in a fresh interpreter: spawned workers
    re-import the parent's main module, which in a user's script (or notebook) may be anything."""
    import json
    import sys
    from pathlib import Path

    world, path = (argv if argv is not None else sys.argv[1:])[:2]
    Path(path).write_text(json.dumps(measure_links(int(world)).to_list()) + "\n")


if __name__ == "__main__":
    main()
