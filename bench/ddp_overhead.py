"""What DistributedDataParallel and the loss's all-reduce add to a training step here, measured several ways side by
side (issue 45's open gap).

    PYTHONPATH=. python bench/ddp_overhead.py          # ~1 min on 2 cores; 5 rounds of 2 gloo processes

The cost model prices DDP from the link benchmark's ``ddp_backward`` points (``nbtrain/profiler/link_bench.py``:
the ``linear loop`` column below); 2-process DDP steps of small models measured 1.3-1.6x their prediction when those
points were taken as ``backward apart`` (``bench/finetune_prediction.py``). Per round, in the same two workers:

- ``all_reduce``: the gradient bytes of the test model (a transformers Qwen2 of 0.14 M parameters, 560 KB) reduced
  alone after a barrier, the way the link benchmark's ``all_reduce`` points are taken;
- ``backward apart``: what DDP adds to a backward, a forward and a backward timed apart with gradients left to
  accumulate (``link_timing.added_seconds``: how the link benchmark measured ``ddp_backward`` until this bench), at
  those bytes;
- ``whole steps``: what DDP adds to a whole step of those Linear layers (forward, backward, fused AdamW, gradients
  set to None), one step of each back to back, 9 times;
- ``linear loop``: the same steps, 25 plain then 25 under DDP, the difference of the medians;
- ``gpt loop``: nbtrain's GPT of 2 blocks, width 64 (0.5 MB of gradients), 8 × 64 tokens, steps in a row as the
  ``linear loop``'s;
- ``training loop``: the Qwen2 step (forward, loss, backward, fused AdamW) of 8 × 64 tokens, 25 steps plain then 25
  under DDP (buffers not broadcast, as the executor wraps it), the difference of the medians;
- ``loss all-reduce``: what the trainer's all-reduce of the loss (one number, read on the host) adds to the plain
  step, which the cost model prices once a step (``CostModel.loss_sync``);
- ``from a hook``: the same all-reduce launched from an autograd hook inside a backward, as DDP launches its bucket.

If the columns disagree by more than the rounds do, the link benchmark is not measuring what a step pays.
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from nbtrain.profiler.link_timing import added_seconds  # noqa: E402
from nbtrain.run.launch.workers import launch  # noqa: E402
from nbtrain.table import Table  # noqa: E402

STEPS = 25
SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, use_cache=False)


def _median_ms(step, warmup: int = 3) -> float:
    times = []
    for i in range(STEPS + warmup):
        dist.barrier()
        started = time.perf_counter()
        step()
        if i >= warmup:
            times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def _qwen():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(**SMALL))


def _gpt(width: int):
    from nbtrain.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=width, tie_embeddings=False))


def _adamw_step(model, loss_of, reduce_loss: bool = False):
    """A training step of ``model`` as the trainer runs it: ``loss_of(model)``, backward, a fused AdamW step,
    gradients set to None; ``reduce_loss``: every rank's loss summed and read on the host, as the trainer does."""
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)

    def step():
        loss = loss_of(model)
        loss.backward()
        if reduce_loss:
            total = loss.detach().clone()
            dist.all_reduce(total)
            float(total)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def _next_token_loss(ids):
    return lambda model: torch.nn.functional.cross_entropy(model(input_ids=ids[:, :-1]).logits.flatten(0, 1),
                                                           ids[:, 1:].flatten())


def _linear_step(model, x):
    return _adamw_step(model, lambda m: m(x).sum())


def _alternating_steps(plain, wrapped, x, rounds: int = 9) -> float:
    """One whole step of each back to back, ``rounds`` times: the median of the differences (ms)."""
    steps = [_linear_step(plain, x), _linear_step(wrapped, x)]
    for step in steps:
        step()
    added = []
    for _ in range(rounds):
        times = []
        for step in steps:
            dist.barrier()
            started = time.perf_counter()
            step()
            times.append(time.perf_counter() - started)
        added.append(times[1] - times[0])
    return statistics.median(added) * 1e3


def _round() -> dict[str, float]:
    from torch.nn.parallel import DistributedDataParallel

    from nbtrain.run.parallel.parallelize import buffer_sync

    torch.set_num_threads(1)
    model = _qwen()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = torch.zeros(nbytes // 4)
    out = {"bytes": float(nbytes), "all_reduce": _median_ms(lambda: dist.all_reduce(grads))}
    width = int((nbytes / 16) ** 0.5)  # 4 Linear(width, width) layers of the same gradient bytes
    plain = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(4)))
    x = torch.randn(256, width)
    out["backward apart"] = added_seconds(plain, DistributedDataParallel(copy.deepcopy(plain)), x)[1] * 1e3
    out["whole steps"] = _alternating_steps(plain, DistributedDataParallel(copy.deepcopy(plain)), x)
    linear_alone = _median_ms(_linear_step(plain, x))
    out["linear loop"] = _median_ms(_linear_step(DistributedDataParallel(copy.deepcopy(plain)), x)) - linear_alone
    ids = torch.randint(0, SMALL["vocab_size"], (8, 65))
    alone = _median_ms(_adamw_step(model, _next_token_loss(ids)))
    wrapped = DistributedDataParallel(_qwen(), **buffer_sync(False))
    out["training loop"] = _median_ms(_adamw_step(wrapped, _next_token_loss(ids))) - alone
    out["plain step"] = alone
    gpt = _gpt(width=64)
    gpt_ids = torch.randint(0, 256, (8, 64))
    gpt_loss = lambda m: m(gpt_ids).float().square().mean()  # noqa: E731
    gpt_alone = _median_ms(_adamw_step(gpt, gpt_loss))
    out["gpt loop"] = _median_ms(_adamw_step(DistributedDataParallel(_gpt(width=64), **buffer_sync(False)),
                                             gpt_loss)) - gpt_alone
    out["loss all-reduce"] = _median_ms(_adamw_step(model, _next_token_loss(ids), reduce_loss=True)) - alone
    x = torch.randn(8, 64, requires_grad=True)
    w = torch.randn(64, 64, requires_grad=True)

    def from_hook():
        futures = []
        y = x @ w
        y.register_hook(lambda g: futures.append(dist.all_reduce(grads, async_op=True).get_future()) or g)
        y.sum().backward()
        futures[0].wait()
    out["from a hook"] = _median_ms(from_hook)
    return out


def main(rounds: int = 5) -> None:
    table = Table(["round", "grad bytes", "plain step", "all_reduce", "backward apart", "whole steps", "linear loop",
                   "gpt loop", "training loop", "loss all-reduce", "from a hook"], align="lrrrrrrrrrr",
                  title="What DDP adds to a step here (ms; 2 gloo processes, rank 0's medians)")
    for r in range(rounds):
        got = launch(_round, num_processes=2)
        columns = ("plain step", "all_reduce", "backward apart", "whole steps", "linear loop", "gpt loop",
                   "training loop", "loss all-reduce", "from a hook")
        table.add(str(r + 1), f"{got['bytes'] / 1e3:,.0f} KB", *(f"{got[k]:.2f}" for k in columns))
    print(table)


if __name__ == "__main__":
    main()
