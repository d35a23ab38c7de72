"""Data as people hold it: a causal-LM corpus is tensors of token ids (nanoGPT's ``get_batch``, a tokenised
``datasets`` column), not (ids, targets) pairs; and the command line's ``--data``, ``--loss`` and ``--tp-plan`` name
functions as often as values. Each is taken where it means one thing, and refused in one line where it does not."""

from __future__ import annotations

import pytest
import torch

import nbtrain
from nbtrain.cli import main

VOCAB = 512


def token_tensors(steps: int = 3, rows: int = 8, length: int = 33) -> list[torch.Tensor]:
    """A list of 2-D token-id tensors, as a user holds a tokenised corpus."""
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (rows, length), generator=g) for _ in range(steps)]


def make_batches() -> list[torch.Tensor]:
    """A zero-argument function returning the list (``--data tests.test_data_as_people_hold_it:make_batches``)."""
    return token_tensors(rows=4)


NOT_A_LOSS = 3.0


def a_tp_plan_builder():
    return {"blocks.*.mlp.up": "colwise"}


def test_fit_takes_tensors_of_token_ids_as_next_token_batches_and_says_so_once(capsys):
    data = token_tensors()
    runs = []
    for batches in (data, [(ids[:, :-1], ids[:, 1:]) for ids in data]):
        torch.manual_seed(0)
        model = nbtrain.build_preset("gpt-tiny", device="cpu")
        runs.append(nbtrain.fit(model, batches, plan="dp_replicate=1", steps=3, num_processes=1, lr=1e-2,
                                progress=False))
    said = capsys.readouterr().out
    assert runs[0].losses == pytest.approx(runs[1].losses, rel=1e-6)  # the pairs a user would have made
    assert runs[0].plan.seq_len == 32
    assert said.count("note: each batch is a tensor of token ids (8 × 33): trained as inputs ids[:, :-1] with the "
                      "next tokens ids[:, 1:] as targets (32 per row)") == 1


def test_token_tensors_for_a_model_that_is_not_a_language_model_keep_the_refusal_with_the_advice():
    from tests.any_models import one_layer, regression_loss

    with pytest.raises(nbtrain.errors.InvalidArgumentError,
                       match=r"batch of step 0 is a Tensor; a batch is a pair \(ids, targets\) .*\(a 2-D tensor of "
                             r"token ids alone is taken as ids\[:, :-1\] → ids\[:, 1:\] for a language model"):
        nbtrain.fit(one_layer(), [torch.zeros(4, 16, dtype=torch.long)], plan="dp_replicate=1", steps=1,
                    num_processes=1, loss_fn=regression_loss, progress=False)


def test_the_notebook_launch_takes_a_list_of_token_tensors_as_data(shell, capsys):
    shell.run_cell("import torch\ndata = [torch.randint(0, 256, (4, 17)) for _ in range(3)]\n")
    body = ("import torch, nbtrain\ntorch.manual_seed(0)\nmodel = nbtrain.GPT(nbtrain.GPTConfig(vocab_size=256, "
            "block_size=64, n_layer=2, n_head=4, n_embd=64, tie_embeddings=False))\n")
    result = shell.run_cell(f"%%autoparallel --gpus 2 --batch 4 --seq 16 -q --launch --processes 2 --steps 1 "
                            f"--data data -o run\n{body}")
    assert result.success, result.error_in_exec
    run = shell.user_ns["run_result"]
    assert len(run.losses) == 1 and run.plan.seq_len == 16
    assert "trained as inputs ids[:, :-1] with the next tokens ids[:, 1:] as targets" in capsys.readouterr().out


def test_verify_data_may_name_a_function_that_returns_token_tensors(capsys):
    status = main(["verify", "llama-tiny", "--strategy", "dp_shard=2", "--processes", "2", "--steps", "2",
                   "--data", "tests.test_data_as_people_hold_it:make_batches"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "trained as inputs ids[:, :-1]" in out and "SAME TRAINING" in out


@pytest.mark.parametrize("argv, message", [
    (["--data", "tests.test_data_as_people_hold_it:VOCAB"],
     "nbtrain: error: --data tests.test_data_as_people_hold_it:VOCAB is a int; --data takes a list of (inputs, "
     "targets) batches or of 2-D token-id tensors, or a function with no arguments that returns one"),
    (["--data", "tests.any_models:regression_loss"],
     "nbtrain: error: --data tests.any_models:regression_loss is a function of output, targets; --data takes"),
    (["--loss", "tests.test_data_as_people_hold_it:NOT_A_LOSS"],
     "nbtrain: error: --loss tests.test_data_as_people_hold_it:NOT_A_LOSS is a float; --loss takes a function "
     "loss_fn(output, targets) that returns the loss"),
    (["--tp-plan", "tests.test_data_as_people_hold_it:a_tp_plan_builder"],
     "nbtrain: error: --tp-plan tests.test_data_as_people_hold_it:a_tp_plan_builder is a function; --tp-plan "
     "takes a dict of module patterns to styles"),
])
def test_verify_flags_given_what_they_do_not_take_say_what_they_take_in_one_line(capsys, argv, message):
    status = main(["verify", "llama-tiny", "--strategy", "dp_shard=2", "--processes", "2", "--steps", "1", *argv])
    captured = capsys.readouterr()
    assert status == 2 and "Traceback" not in captured.err
    assert captured.err.strip().splitlines() == [captured.err.strip()] and captured.err.startswith(message), \
        captured.err
