"""``fit`` on documents of any length: bucketed, each bucket under its own strategy in real gloo processes, trains
as one process does on the same packed batches; a switching run checkpoints and resumes under another home layout.

The documents follow the Wikipedia length mix (every length ÷ 64, so most are a few tokens and a few are cut at
the longest row), the models are a LLaMA-shaped nbtrain GPT (it keeps attention inside each packed document) and a
transformers Llama from its own config class (it attends across the documents of a row: the reference does too).
The reference is one process, one model, plain ``torch.optim.AdamW`` with fit's defaults (weight decay 0.01,
gradients clipped to norm 1), the token-level mean cross-entropy over every bucket of a step.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import nbtrain
from nbtrain.data import WIKIPEDIA, histogram_documents, length_batches
from nbtrain.errors import InvalidArgumentError
from nbtrain.models import GPT, GPTConfig
from tests.distributed_fixtures import VOCAB

CONFIG = GPTConfig(vocab_size=VOCAB, block_size=128, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden=48,
                   norm="rmsnorm", mlp="swiglu", position="rope", bias=False, tie_embeddings=False)
DOCS = histogram_documents(WIKIPEDIA, 400, scale=64, vocab_size=VOCAB, seed=3)
TOKENS, LR, STEPS = 640, 1e-2, 4
SWITCHING = {32: "dp_replicate=2", 128: "dp_shard=2"}


def llama():
    return GPT(CONFIG)


def hf_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                        tie_word_embeddings=False, use_cache=False))


def reference(model, bounds, steps=STEPS):
    """Losses of one process over the batches fit takes (length_batches, seed 0), and its final weights."""
    model = copy.deepcopy(model).train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    doc_ids = isinstance(model, GPT)
    losses = []
    for buckets in length_batches(DOCS, tokens_per_step=TOKENS, bounds=bounds, steps=steps):
        tokens = sum(int((b.targets != -100).sum()) for b in buckets)
        loss = 0.0
        for b in buckets:
            out = model(b.ids, doc_ids=b.doc_ids) if doc_ids else model(b.ids).logits
            loss = loss + F.cross_entropy(out.reshape(-1, VOCAB), b.targets.reshape(-1), reduction="sum")
        loss = loss / tokens
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def test_documents_are_told_apart_from_batches():
    from nbtrain.run.fit_documents import is_documents

    ids = torch.zeros(2, 8, dtype=torch.long)
    assert is_documents(DOCS) and is_documents([[1, 2, 3], [4]]) and is_documents([{"input_ids": [1, 2]}])
    assert not is_documents([(ids, ids)]) and not is_documents(lambda step: (ids, ids))


@pytest.mark.slow
@pytest.mark.parametrize("build", [llama, hf_llama], ids=["nbtrain-llama", "transformers-llama"])
def test_fit_on_documents_switching_between_ddp_and_fsdp_trains_as_one_process(build):
    torch.manual_seed(0)
    model = build()
    want_losses, want_state = reference(model, sorted(SWITCHING))
    result = nbtrain.fit(model, DOCS, plan=SWITCHING, steps=STEPS, num_processes=2, tokens_per_step=TOKENS, lr=LR,
                         progress=False)
    assert result.losses == pytest.approx(want_losses, rel=1e-4)
    for name, want in want_state.items():
        got = model.state_dict()[name]
        assert (got - want).norm() <= 1e-4 * want.norm() + 1e-6, name
    last = result.details[-1]
    assert [s.what for s in last.switches] == ["weights", "gradients"]  # to DDP for the short bucket and back
    assert set(last.bucket_seconds) <= set(SWITCHING)
    text = str(result)
    assert "per bucket" in text and "switch weights to 'dp_replicate=2'" in text


@pytest.mark.slow
def test_a_switching_run_resumes_under_another_home_layout_with_the_next_loss_it_would_have_had(tmp_path):
    torch.manual_seed(0)
    model = llama()
    whole = nbtrain.fit(copy.deepcopy(model), DOCS, plan=SWITCHING, steps=STEPS, num_processes=2,
                        tokens_per_step=TOKENS, lr=LR, progress=False)
    nbtrain.fit(copy.deepcopy(model), DOCS, plan=SWITCHING, steps=2, num_processes=2, tokens_per_step=TOKENS,
                lr=LR, progress=False, checkpoint_dir=tmp_path / "run", checkpoint_every=2)
    # the same buckets, the home now tensor parallel and the short bucket sharded: the checkpoint is re-laid out
    resumed = nbtrain.fit(copy.deepcopy(model), DOCS, plan={32: "dp_shard=2", 128: "tp=2"}, steps=STEPS,
                          num_processes=2, tokens_per_step=TOKENS, lr=LR, progress=False,
                          checkpoint_dir=tmp_path / "run", resume=True)
    assert resumed.resumed_at == 2
    assert resumed.losses == pytest.approx(whole.losses, rel=1e-4)


@pytest.mark.slow
def test_a_switching_run_resumes_into_a_pipelined_home_with_the_losses_of_one_process(tmp_path):
    """Saved under a sharded home, resumed with the home pipelined ((dp, tp, pp) = (1, 1, 2), each stage loading its
    layers of the checkpoint) and the short bucket under DDP: the losses one process has over the same batches."""
    torch.manual_seed(0)
    model = llama()
    nbtrain.fit(copy.deepcopy(model), DOCS, plan=SWITCHING, steps=2, num_processes=2, tokens_per_step=TOKENS,
                lr=LR, progress=False, checkpoint_dir=tmp_path / "run", checkpoint_every=2)
    resumed = nbtrain.fit(copy.deepcopy(model), DOCS, plan={32: "dp_replicate=2", 128: "pp=2"}, steps=STEPS,
                          num_processes=2, tokens_per_step=TOKENS, lr=LR, progress=False,
                          checkpoint_dir=tmp_path / "run", resume=True)
    assert resumed.resumed_at == 2 and resumed.plan.pp == 2  # trained in the pipelined home
    assert resumed.losses == pytest.approx(reference(model, [32, 128])[0], rel=1e-4)


@pytest.mark.slow
def test_the_planner_chooses_the_buckets_and_the_run_trains_under_its_choice():
    """No plan: the buckets, strategies and micro-batches are the planner's, for 2 processes of this machine's
    catalog CPU, under a budget; whatever it chose trains as one process does."""
    torch.manual_seed(0)
    model = llama()
    start = copy.deepcopy(model)
    cluster = nbtrain.Cluster.from_catalog("cpu", num_devices=2)
    result = nbtrain.fit(model, DOCS, steps=2, num_processes=2, tokens_per_step=TOKENS, bounds=[32, 64, 128],
                         lr=LR, memory="8MiB", cluster=cluster, progress=False)
    layout = result.layout
    assert layout.predicted is not None and result.predicted_step_s > 0
    assert set(layout.bounds) <= {32, 64, 128} and layout.bounds[-1] == 128  # merged or not, the longest stays
    want_losses, _ = reference(start, layout.bounds, steps=2)
    assert result.losses == pytest.approx(want_losses, rel=1e-4)
    assert "predicted" in str(result)


def test_documents_refuse_what_they_cannot_take_before_anything_starts():
    model = llama()
    with pytest.raises(InvalidArgumentError, match="num_processes"):
        nbtrain.fit(model, DOCS, plan=SWITCHING, steps=1)
    with pytest.raises(InvalidArgumentError, match="precision= is not taken with documents"):
        nbtrain.fit(model, DOCS, plan=SWITCHING, steps=1, num_processes=2, precision="bf16")
    with pytest.raises(InvalidArgumentError, match="vocabulary has 128 ids"):
        nbtrain.fit(model, [[5, 700, 3]], plan=SWITCHING, steps=1, num_processes=2)
    ids = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(InvalidArgumentError, match="give plan= for"):
        nbtrain.fit(model, [(ids, ids)], steps=1, num_processes=2)


def test_a_run_over_documents_is_measured_by_its_mean_step_which_is_what_the_planner_prices():
    # steps over documents are not alike: the planner prices the mean step (each bucket at its mean rows), so the
    # step a run reports beside it is the mean of its steps, and a bucket's time its mean over them, 0 where a
    # step had none of its rows (the median of these four steps, 4.0 s, is one step without a long row)
    from nbtrain.planner.strategy import Strategy
    from nbtrain.run.fit_documents import DocumentsFitResult
    from nbtrain.run.switching.hot import SwitchStepRecord
    from nbtrain.run.switching.planned import DocumentPlan
    from nbtrain.run.trainer import StepRecord

    seconds = [9.0, 10.0, 4.0, 4.0, 3.0]  # the first is warm-up, left out
    long_rows = [1.0, 8.0, 0.0, 2.0, 0.0]  # seconds of the 4096 bucket in each
    records = [StepRecord(i + 1, 5.0, s, 1000 / s, 2**20) for i, s in enumerate(seconds)]
    details = [SwitchStepRecord(i + 1, 5.0, 1000, s, {512: s - long, **({4096: long} if long else {})})
               for i, (s, long) in enumerate(zip(seconds, long_rows))]
    layout = DocumentPlan(strategies={512: Strategy(dp_replicate=2), 4096: Strategy(tp=2)},
                          micro_rows={512: 1, 4096: 1}, tokens_per_step=1000, num_processes=2)
    result = DocumentsFitResult(plan=None, records=records, predicted_step_s=5.0, layout=layout, details=details)
    assert result.measured_step_s == pytest.approx(5.25)
    assert "measured step time (mean after the first): 5.25 s · predicted: 5.00 s (measured / predicted 1.05)" \
        in str(result.table())
    long_bucket = next(row for row in str(result.bucket_table()).splitlines() if row.strip().startswith("4096"))
    assert "2.50 s" in long_bucket  # (8 + 0 + 2 + 0) / 4
