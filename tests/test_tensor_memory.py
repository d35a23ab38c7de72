"""Memory measured the way it is predicted: the bytes of the tensors a step holds (parameters, gradients, optimizer
state, the activations autograd saves), not the resident size of a process that is mostly torch itself.

    .venv/bin/pytest tests/test_tensor_memory.py -q          # a few seconds: one 2-process fit
"""

from __future__ import annotations

import gc

import torch
from torch import nn

import nbtrain
from nbtrain.models.gpt import GPT, GPTConfig
from nbtrain.run.tensor_memory import SavedActivations, state_bytes


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

