"""``ChunkedLMLoss``: the next-token loss of ``lm_loss`` without the fp32 copies of the whole logits, priced as it
runs.

    .venv/bin/pytest tests/test_chunked_loss.py -q          # ~20 s on 2 cores
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

import nbtrain
from nbtrain import ChunkedLMLoss
from nbtrain.errors import InvalidArgumentError
from nbtrain.planner.memory_terms import loss_bytes
from nbtrain.profiler.model import lm_loss
from nbtrain.run.verify import verify


@pytest.mark.parametrize("chunk", [1, 7, 4096])
def test_the_chunked_loss_and_its_gradient_are_lm_losss(chunk):
    torch.manual_seed(0)
    logits = torch.randn(3, 50, 97, dtype=torch.float64).float()  # a model's output: [rows, tokens, vocabulary]
    targets = torch.randint(0, 97, (3, 50))
    targets[0, :10] = -100  # padding and prompts count nothing
    mine, theirs = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    loss, reference = ChunkedLMLoss(chunk)(mine, targets), lm_loss(theirs, targets)
    loss.backward()
    reference.backward()
    assert loss.item() == pytest.approx(reference.item(), rel=1e-6)
    torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-5, atol=1e-8)


def _peak(loss_fn, dtype) -> int:
    """torch's MemTracker's peak over a head's forward, the loss and their backward (1,024 tokens, vocabulary 8,192)."""
    torch.manual_seed(0)
    head = torch.nn.Linear(64, 8192, bias=False).to(dtype)
    x = torch.randn(1, 1024, 64, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, 8192, (1, 1024))
    tracker = MemTracker()
    tracker.track_external(head, x)
    with tracker:
        loss_fn(head(x), targets).backward()
    return next(iter(tracker.get_tracker_snapshot("peak").values()))["Total"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_planner_counts_what_the_chunked_loss_saves_against_torchs_tracker(dtype):
    # lm_loss saves an fp32 copy of the logits and holds two more in backward; the chunked loss saves the logits as
    # they are and holds their gradient and two fp32 chunks (memory_terms.loss_bytes). The tracker's peaks differ by
    # what the planner says the two losses differ by.
    size = 1024 * 8192 * torch.finfo(dtype).bits // 8
    e = torch.finfo(dtype).bits // 8
    predicted = sum(loss_bytes(size, dtype_bytes=e, saved=float("inf"))) - \
        sum(loss_bytes(size, dtype_bytes=e, saved=float("inf"), chunk=128 / 1024, tokens=1024))
    measured = _peak(lm_loss, dtype) - _peak(ChunkedLMLoss(128), dtype)
    assert measured == pytest.approx(predicted, rel=0.1)  # fp32: 24.0 against 24.0 MiB; bf16: 52.0 against 56.0


def test_a_profile_with_the_chunked_loss_plans_its_head_with_less_memory():
    plain = nbtrain.profile("llama-tiny", batch_size=2, seq_len=64)
    chunked = nbtrain.profile("llama-tiny", batch_size=2, seq_len=64, loss_fn=ChunkedLMLoss(16))
    assert chunked.arch["loss_chunk_tokens"] == 16 and "loss_chunk_tokens" not in plain.arch
    cluster = nbtrain.Cluster.from_catalog("A100", num_devices=1)
    head = [nbtrain.estimate(nbtrain.Plan.parse("dp_replicate=1", num_devices=1, num_layers=len(p.layers),
                                                global_batch=2, seq_len=64), p, cluster).stages[-1].memory
            for p in (plain, chunked)]
    # the presets profile in bf16: logits of 2 × 64 tokens × 512 in bf16, and their fp32 copies
    tokens, bf16 = 2 * 64, 2 * 64 * plain.arch["vocab_size"] * 2
    fp32 = 2 * bf16
    assert head[0].transient == 2 * fp32  # lm_loss's backward: two fp32 copies of the logits
    assert head[1].transient == bf16 + 2 * 16 / tokens * fp32  # their gradient, two fp32 chunks of 16 tokens
    # saved: the fp32 log-probabilities, or the logits as they are and an fp32 log-sum-exp a token
    assert head[0].activations - head[1].activations == pytest.approx(fp32 - (bf16 + 4 * tokens), abs=8)


def test_a_notebooks_loss_flag_is_recognised_through_its_wrapper():
    # %%autoparallel --loss NAME wraps the cell's loss (errors inside it are then reported as the loss's)
    from nbtrain.notebook.cell import check_loss
    from nbtrain.profiler.model import is_next_token_loss

    wrapped = check_loss(ChunkedLMLoss(16), "loss")
    assert wrapped is not None and not isinstance(wrapped, ChunkedLMLoss)
    assert is_next_token_loss(wrapped)  # token windows given alone train on their next tokens
    assert nbtrain.profile("llama-tiny", batch_size=2, seq_len=64, loss_fn=wrapped).arch["loss_chunk_tokens"] == 16


def test_a_mixed_plan_with_the_chunked_loss_trains_like_one_process():
    # the tensor-parallel head gathers its logits for a loss that is not lm_loss; token windows train on the next
    # tokens, as with lm_loss
    report = verify("llama-tiny", "0: dp_shard=2; 1-4: tp=2 ac; 5: dp_replicate=2", processes=2, steps=3,
                    loss_fn=ChunkedLMLoss(24), timeout=180)
    assert report.ok, str(report)


@pytest.mark.parametrize("chunk", [0, -5, 2.5, True, "512"])
def test_a_chunk_that_is_not_a_number_of_tokens_is_refused_with_an_example(chunk):
    with pytest.raises(InvalidArgumentError, match=r"chunk_tokens must be a positive whole number.*ChunkedLMLoss"):
        ChunkedLMLoss(chunk)
