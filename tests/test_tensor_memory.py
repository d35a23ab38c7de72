"""Memory measured the way it is predicted: the bytes of the tensors a step holds (parameters, gradients, optimizer
state, the activations autograd saves), not the resident size of a process that is mostly torch itself.

    .venv/bin/pytest tests/test_tensor_memory.py -q          # a few seconds: one 2-process fit
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import nbtrain
from nbtrain.models.gpt import GPT, GPTConfig
from nbtrain.tensor_memory import SavedActivations, state_bytes


def test_saved_activations_count_what_backward_needs_once_and_nothing_once_it_is_done():
    torch.manual_seed(0)
    linear = nn.Linear(64, 64, bias=False)
    x = torch.randn(32, 64)  # the input, saved for the weight's gradient (the weight itself is not an activation)
    saved = SavedActivations(exclude=linear.parameters())
    with saved.hooks():
        y = torch.relu(linear(x))  # relu saves its result: a second 32 × 64 fp32 tensor
        z = y * y  # saves y again: the same storage, counted once
        z.sum().backward()
    assert saved.peak == 2 * 32 * 64 * 4
    assert saved.live == 2 * 32 * 64 * 4  # backward is done with them, but x and y are still ours
    del x, y, z
    gc.collect()
    assert saved.live == 0


def test_a_graph_dropped_without_a_backward_is_freed_while_it_is_counted():
    # a pipeline's first stage infers its shapes with a forward that no backward follows (its inputs are token ids):
    # under the counting hooks that graph once stayed alive, one micro-batch of activations a schedule, for good
    linear = nn.Linear(64, 64, bias=False)
    saved = SavedActivations(exclude=linear.parameters())
    with saved.hooks():
        y = torch.sigmoid(linear(torch.randn(32, 64)))  # sigmoid saves its own output: the tensor y itself
    assert saved.live == 2 * 32 * 64 * 4
    del y  # the graph goes with its last reference, as it does without the hooks
    gc.collect()
    assert saved.live == 0


def test_the_state_of_adamw_is_two_fp32_moments_per_parameter_beside_parameters_and_gradients():
    model = nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()
    numel = 64 * 64 + 64
    assert state_bytes(model, optimizer) == 4 * numel * 4  # weights, gradients, exp_avg, exp_avg_sq
    optimizer.zero_grad(set_to_none=True)
    assert state_bytes(model, optimizer) == 3 * numel * 4


def test_a_data_parallel_step_holds_within_a_quarter_of_the_predicted_memory():
    """The cost model's memory per device (parameters, gradients, AdamW, the profiled saved activations) against
    what rank 0's tensors took at the peak of each step: the demo's promise, on a model nbtrain did not size."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=64, tie_embeddings=False))
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 256, (4, 64), generator=g) for _ in range(2)]
    batches = [(x, torch.roll(x, -1, dims=1)) for x in ids]
    result = nbtrain.fit(model, batches, plan="dp_replicate=2", steps=2, num_processes=2, progress=False,
                         cluster=nbtrain.Cluster.from_catalog("cpu", num_devices=2))
    measured = max(r.tensor_bytes for r in result.records)
    assert 0.75 <= measured / result.predicted_memory_bytes <= 1.25
    assert "tensor memory at the peak" in str(result) and "resident" in str(result)



PACKED = GPTConfig(vocab_size=2048, block_size=2048, n_layer=4, n_head=4, n_embd=128, ffn_hidden=336,
                   norm="rmsnorm", mlp="swiglu", position="rope", bias=False, tie_embeddings=False)
"""bench/switching.py's model at half its context: one row of packed documents, as a long bucket trains it."""


def _packed_row():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, PACKED.vocab_size, (1, PACKED.block_size), generator=g)
    doc_ids = torch.arange(4).repeat_interleave(PACKED.block_size // 4)[None]  # four documents of 512 tokens
    return ids, doc_ids


def _saved_by_a_packed_row(tp: int) -> int:
    """Rank 0's saved bytes of one step's forward and loss on a packed row under ``tp``, the model split by the
    executor (:func:`~nbtrain.run.parallel.parallelize.parallelize`)."""
    from nbtrain.models.description import layer_slots
    from nbtrain.planner.plan import Plan
    from nbtrain.profiler.model import lm_loss
    from nbtrain.run.parallel.mesh import PlanMeshes
    from nbtrain.run.parallel.parallelize import parallelize

    torch.manual_seed(0)
    model = GPT(PACKED)
    if tp > 1:
        plan = Plan.parse(f"tp={tp}", num_devices=tp, num_layers=len(layer_slots(model)), global_batch=1,
                          seq_len=PACKED.block_size)
        model = parallelize(model, plan, PlanMeshes(plan))
    ids, doc_ids = _packed_row()
    saved = SavedActivations(exclude=model.parameters())
    with saved.hooks():
        lm_loss(model(ids, doc_ids=doc_ids), ids)
    return saved.peak


def test_what_broadcasts_over_the_heads_is_priced_whole_on_every_tensor_parallel_rank():
    """Issue 47: each block of a packed-documents step saves its document mask, a [1, 1, T, T] float bias on the
    CPU (16 MiB at 2K tokens, 64 at 4K); it broadcasts over the heads, so a TP rank holds it whole. The planner
    divided it by tp: tp=2 was priced at 92 MiB where rank 0 holds 137 (1.49x; a pipelined bucket 3.1x). What is
    left (1.10x here) is the block's hidden-sized tensors beyond the four the cost model keeps whole."""
    from nbtrain.planner.cost import CostModel, CostOptions
    from nbtrain.planner.plan import Plan
    from nbtrain.profiler.model import lm_loss
    from nbtrain.run.switching.planned import PackedRowInputs

    torch.manual_seed(0)
    profile = nbtrain.profile(GPT(PACKED), seq_len=PACKED.block_size, dtype="fp32",
                              inputs=PackedRowInputs(PACKED.vocab_size, "idx"), loss_fn=lm_loss)

    def predicted(text: str, devices: int) -> float:
        model = CostModel(profile, nbtrain.Cluster.from_catalog("A100", num_devices=devices), global_batch=1,
                          seq_len=PACKED.block_size, options=CostOptions(headroom=0, reserve_bytes=0))
        plan = Plan.parse(text, num_devices=devices, num_layers=len(profile.layers), global_batch=1,
                          seq_len=PACKED.block_size)
        return model.estimate(plan).stages[0].memory.activations

    assert _saved_by_a_packed_row(1) == pytest.approx(predicted("dp_replicate=1", 1), rel=1e-3)
    tp2 = nbtrain.launch(_saved_by_a_packed_row, 2, num_processes=2)
    assert 0.9 <= tp2 / predicted("tp=2", 2) <= 1.12
