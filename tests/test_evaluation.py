"""Evaluation during training (``fit(..., eval_data=, eval_every=)``, ``%%autoparallel --eval-data``): the held-out
loss under every plan kind is one process's, evaluating leaves the training as it was, and the loss shows in the
step table, ``FitResult`` and the plot.

    timeout 1800 .venv/bin/python -m pytest -q tests/test_evaluation.py          # ~1 min on 2 cores

The reference is written out here, as ``nbtrain verify`` makes it: the same initial weights and batches trained in
one process with torch's AdamW, and after each step that evaluates, the model in eval mode and the loss summed over
every counted target of the held-out set, divided by their count (a set with ``-100`` targets, unevenly spread
over batches, rows and micro-batches).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import nbtrain
from nbtrain.errors import InvalidArgumentError
from nbtrain.profiler.model import lm_loss
from nbtrain.run.fit_result import FitResult
from nbtrain.run.trainer import StepRecord

STEPS, EVERY, LR = 3, 2, 1e-2


def windows(vocab: int, count: int, seed: int, rows: int = 4, seq: int = 16) -> list:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(0, vocab, (rows, seq + 1), generator=g)
        out.append((ids[:, :-1], ids[:, 1:].clone()))
    return out


def held_out(vocab: int) -> list:
    """Three held-out batches whose targets count unevenly: -100 on part of a row, on a whole row, and nowhere."""
    batches = windows(vocab, 3, seed=99)
    batches[0][1][0, :11] = -100
    batches[1][1][3, :] = -100
    batches[1][1][2, 5:9] = -100
    return batches


def one_process(model, train: list, held: list, steps: int, every: int) -> dict[int, float]:
    """The reference: ``model`` (a copy) trained in one process, evaluated after every ``every``-th step and the
    last, over the whole held-out set at once."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = {}
    for step in range(1, steps + 1):
        ids, targets = train[(step - 1) % len(train)]
        lm_loss(model(ids), targets).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if step % every == 0 or step == steps:
            model.eval()
            with torch.no_grad():
                summed = sum(F.cross_entropy(_logits(model(x)).float().flatten(0, 1), y.flatten(), reduction="sum")
                             for x, y in held)
            model.train()
            losses[step] = float(summed) / sum(int((y != -100).sum()) for _, y in held)
    return losses


def _logits(output):
    return getattr(output, "logits", output)


def llama():
    torch.manual_seed(0)
    return nbtrain.build_preset("llama-tiny", device="cpu")


def qwen2():
    from tests.any_models import qwen2 as build

    return build()


def mixtral():
    from tests.any_models import mixtral as build

    return build()


@pytest.mark.slow
@pytest.mark.parametrize("build, plan", [
    (llama, "dp_replicate=2"),
    (llama, "dp_shard=2"),
    (llama, "tp=2"),
    (llama, "pp=2 mb=2"),
    (llama, "0: dp_shard=2; 1-4: tp=2 ac; 5: dp_replicate=2"),
    (llama, "dp_replicate=2 offload=1"),
    (qwen2, "pp=2 mb=2 schedule=gpipe"),
    (qwen2, "tp=2"),
    (mixtral, "dp_shard=2 ep=2"),  # the experts spread over the ranks, tokens sent to them by all-to-all
])
def test_the_validation_loss_under_each_plan_kind_is_one_processs_at_each_evaluation(build, plan):
    model = build()
    vocab = model.config.vocab_size
    train, held = windows(vocab, STEPS, seed=1), held_out(vocab)
    expected = one_process(model, train, held, STEPS, EVERY)
    result = nbtrain.fit(model, train, plan=plan, steps=STEPS, num_processes=2, lr=LR, progress=False, timeout=300,
                         eval_data=held, eval_every=EVERY)
    assert sorted(result.eval_losses) == [2, 3]
    for step, loss in expected.items():
        assert result.eval_losses[step] == pytest.approx(loss, rel=1e-4), (step, result.eval_losses, expected)
    assert result.eval_loss == result.eval_losses[3]
    assert [r.eval_loss is None for r in result.records] == [True, False, False]


def gpt2_with_dropout():
    """A transformers GPT-2 of its default config (dropout 0.1 in the embedding, attention and residuals)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=32))


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["dp_replicate=2", "pp=2 mb=2"])
def test_evaluating_leaves_the_training_of_a_model_with_dropout_as_it_was(plan):
    train, held = windows(64, 4, seed=1), windows(64, 2, seed=2)
    runs = {}
    for evaluating in (False, True):
        model = gpt2_with_dropout()
        assert model.config.resid_pdrop == 0.1
        runs[evaluating] = nbtrain.fit(model, train, plan=plan, steps=4, num_processes=2, lr=LR, progress=False,
                                       timeout=300, **(dict(eval_data=held, eval_every=1) if evaluating else {}))
    # the same dropout masks in every step: evaluation drew no random numbers from the training's stream
    assert runs[True].losses == runs[False].losses
    assert sorted(runs[True].eval_losses) == [1, 2, 3, 4] and not runs[False].eval_losses


def test_the_validation_loss_is_the_models_in_eval_mode_with_its_dropout_off():
    model = gpt2_with_dropout()
    train, held = windows(64, 2, seed=1), windows(64, 2, seed=2)
    result = nbtrain.fit(model, train, plan="dp_replicate=1", steps=2, num_processes=1, lr=LR, progress=False,
                         eval_data=held)  # by default once, after the last step
    assert list(result.eval_losses) == [2]
    model.eval()  # the trained weights came back into the model
    with torch.no_grad():
        expected = sum(lm_loss(model(x), y).item() for x, y in held) / len(held)
    assert result.eval_loss == pytest.approx(expected, rel=1e-5)
    model.train()
    with torch.no_grad():  # with its dropout on, the same model gives another number
        dropped = sum(lm_loss(model(x), y).item() for x, y in held) / len(held)
    assert dropped != pytest.approx(expected, rel=1e-4)


def test_with_accumulation_the_held_out_batches_are_stacked_as_a_steps_and_the_loss_is_the_sets():
    model = llama()
    train, held = windows(512, 4, seed=1), held_out(512)[:2]
    result = nbtrain.fit(model, train, plan="mb=2 | dp_replicate=1", steps=2, num_processes=1, lr=LR, progress=False,
                         accumulate=2, eval_data=held)
    model.eval()
    with torch.no_grad():  # every counted target of the set, as one process sums them
        summed = sum(F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum") for x, y in held)
    assert result.eval_loss == pytest.approx(float(summed) / sum(int((y != -100).sum()) for _, y in held), rel=1e-5)


def test_the_step_table_and_the_result_show_the_validation_loss():
    records = [StepRecord(step=i, loss=5.0 - i / 10, seconds=0.1, tokens_per_s=100.0, peak_memory_bytes=2**20,
                          eval_loss=4.5 - i / 10 if i % 2 == 0 else None, eval_s=0.05 if i % 2 == 0 else None)
               for i in (1, 2, 3, 4)]
    result = FitResult(plan=nbtrain.Plan.parse("dp_shard=2", num_devices=2, num_layers=6), records=records)
    assert result.eval_losses == {2: pytest.approx(4.3), 4: pytest.approx(4.1)}
    assert result.eval_loss == pytest.approx(4.1)
    text = str(result)
    header, _, first, second, *_ = text.splitlines()[1:]
    assert header.split()[:4] == ["step", "loss", "val", "loss"]
    assert first.split()[:3] == ["1", "4.9000", "—"] and second.split()[:3] == ["2", "4.8000", "4.3000"]
    assert "last 4.1000" in text and "2 evaluations here" in text
    assert "<th" in result._repr_html_() and "val loss" in result._repr_html_()
    plain = FitResult(plan=result.plan, records=[StepRecord(1, 5.0, 0.1, 100.0, 2**20)])
    assert "val loss" not in str(plain) and plain.eval_loss is None and plain.eval_losses == {}


def test_the_loss_plot_draws_the_training_and_the_validation_curve():
    from nbtrain.notebook.plots import loss_plot

    records = [StepRecord(step=i, loss=5.0 - i / 10, seconds=0.1, tokens_per_s=100.0, peak_memory_bytes=2**20,
                          eval_loss=4.5 - i / 10 if i % 2 == 0 else None) for i in (1, 2, 3, 4)]
    result = FitResult(plan=nbtrain.Plan.parse("dp_shard=2", num_devices=2, num_layers=6), records=records)
    ax = loss_plot(result).axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert list(lines) == ["training", "validation"]
    assert list(lines["training"].get_xdata()) == [1, 2, 3, 4]
    assert list(lines["training"].get_ydata()) == pytest.approx([4.9, 4.8, 4.7, 4.6])
    assert list(lines["validation"].get_xdata()) == [2, 4]
    assert list(lines["validation"].get_ydata()) == pytest.approx([4.3, 4.1])
    assert ax.get_xlabel() == "step" and ax.get_ylabel() == "loss"
    two = loss_plot({"a": result, "b": result}).axes[0]
    assert [line.get_label() for line in two.get_lines()] == ["a: training", "a: validation", "b: training",
                                                              "b: validation"]


@pytest.mark.parametrize("kwargs, message", [
    (dict(eval_every=2), "eval_every=2 without eval_data: give the held-out batches to evaluate on"),
    (dict(eval_data="held.pt"), "eval_data is a str; give a list of (inputs, targets) global batches"),
    (dict(eval_data=lambda step: None), "eval_data is a function; give a list of (inputs, targets) global batches"),
    (dict(eval_data=[]), "eval_data holds no batches"),
    (dict(eval_data=windows(512, 1, seed=3), eval_every=0), "eval_every must be a positive integer"),
    (dict(eval_data=windows(512, 1, seed=3, rows=2)),
     "eval_data batch 0 has 2 rows, but the training batches have 4 (the plan's global batch); hold out batches "
     "of 4 rows"),
    (dict(eval_data=[(torch.zeros(4, 16), torch.zeros(4, 16, dtype=torch.long))]),
     "eval_data batch 0: ids have dtype torch.float32; token ids must be an integer tensor"),
    (dict(eval_data=[(torch.zeros(4, 16, dtype=torch.long), torch.full((4, 16), -100))]),
     "every target of eval_data is -100"),
    (dict(eval_data=windows(512, 3, seed=3), accumulate=2), "eval_data holds 3 batches, but accumulate=2 stacks"),
])
def test_eval_data_it_cannot_use_is_refused_before_anything_is_launched(kwargs, message):
    model = llama()
    with pytest.raises(InvalidArgumentError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        nbtrain.fit(model, windows(512, 2, seed=1), plan="dp_shard=2", steps=1, num_processes=2, progress=False,
                    **kwargs)


def test_held_out_rows_of_another_length_are_refused_for_a_pipeline_whose_stages_take_the_training_length():
    with pytest.raises(InvalidArgumentError, match="^eval_data batch 1 has 8 tokens per row, but a pipeline's stages "
                                                   "take the training batches' 16; hold out rows of 16 tokens"):
        nbtrain.fit(llama(), windows(512, 2, seed=1), plan="pp=2 mb=2", steps=1, num_processes=2, progress=False,
                    eval_data=windows(512, 1, seed=3) + windows(512, 1, seed=4, seq=8))


def test_eval_data_is_refused_with_documents():
    docs = [torch.randint(0, 512, (n,)) for n in (40, 70, 90, 120)]
    with pytest.raises(InvalidArgumentError, match="eval_data= is not taken with documents"):
        nbtrain.fit(llama(), docs, steps=1, num_processes=2, eval_data=windows(512, 1, seed=3))


def test_token_windows_held_out_are_split_into_inputs_and_next_tokens_as_the_training_ones():
    model = llama()
    train = [torch.randint(0, 512, (4, 17), generator=torch.Generator().manual_seed(1))]
    held = [torch.randint(0, 512, (4, 17), generator=torch.Generator().manual_seed(2))]
    result = nbtrain.fit(model, train, plan="dp_replicate=1", steps=1, num_processes=1, progress=False,
                         eval_data=held)
    model.eval()
    with torch.no_grad():
        expected = lm_loss(model(held[0][:, :-1]), held[0][:, 1:]).item()
    assert result.eval_loss == pytest.approx(expected, rel=1e-5)
