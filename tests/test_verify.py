"""`nbtrain verify` tells the truth for models with randomness, built from a reference or named as an instance.

The models are in tests/verify_models.py, named on the command line as ``tests.verify_models:NAME``: transformers'
GPT-2 and Llama from their default configs apart from the sizes (GPT-2's dropout 0.1 on), a module-level instance,
a builder in a module that draws random numbers at import, and a Llama with a random op that is not dropout.
Every multi-process run: 2 processes, at most 3 steps, batch 4, sequences of 16 tokens.
"""

from __future__ import annotations

import copy
import importlib
import sys

import pytest
import torch

import nbtrain
from nbtrain.cli import main
from nbtrain.profiler.model import lm_loss
from nbtrain.run.verify import VerifyReport

SMALL = ["--processes", "2", "--steps", "3", "--batch", "4", "--seq", "16"]


def run_verify(capsys, model: str, plan: str, *extra: str) -> tuple[int, str, str]:
    status = main(["verify", f"tests.verify_models:{model}", "--strategy", plan, *SMALL, *extra])
    out, err = capsys.readouterr()
    return status, out, err


def models():
    """tests/verify_models.py as verify imports it (``importlib``, as ``module:attr`` references are resolved)."""
    return importlib.import_module("tests.verify_models")


def dropouts(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]


# -- the same training, for default-config transformers models, under every plan the executor runs ---------------

@pytest.mark.slow
@pytest.mark.parametrize("plan", ["dp_replicate=2", "dp_shard=2"])
def test_gpt2_of_the_default_config_trains_the_same_with_its_dropout_turned_off_and_says_so(capsys, plan):
    status, out, _ = run_verify(capsys, "gpt2", plan)
    assert status == 0, out
    assert "SAME TRAINING: every step's loss within a relative 1e-04" in out
    assert "and the weights within 0.01 of the distance trained" in out
    # embeddings, then attention weights, attention output and MLP output in each of the 2 blocks
    assert "dropout turned off for the comparison" in out and "7 nn.Dropout modules (p=0.1)" in out


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["dp_replicate=2", "dp_shard=2", "tp=2", "pp=2 mb=2"])
def test_llama_of_the_default_config_trains_the_same_under_every_kind_of_plan(capsys, plan):
    status, out, _ = run_verify(capsys, "llama", plan)
    assert status == 0, out
    assert "SAME TRAINING" in out and "DIFFERENT" not in out
    assert "dropout turned off" not in out  # LlamaConfig's attention_dropout is 0 by default: nothing to turn off


@pytest.mark.parametrize("plan,refusal", [
    ("0: tp=2; 1-2: tp=2; 3: dp_replicate=2", "share their weight, so they need the same data- and tensor-parallel "
                                              "strategy"),
])
def test_a_plan_the_executor_cannot_run_on_gpt2_is_refused_in_one_line_saying_why(capsys, plan, refusal):
    status, out, err = run_verify(capsys, "gpt2", plan)
    assert status == 2 and out == ""  # no table: the executor's own refusal, one line
    assert err.strip().splitlines()[-1].startswith("nbtrain: error: ") and refusal in err


@pytest.mark.slow
def test_a_dropout_probability_kept_as_an_attribute_is_turned_off_and_named_too():
    # Llama's attention passes self.attention_dropout (a float, no nn.Dropout) to its attention kernel
    report = nbtrain.verify("tests.verify_models:llama_attention_dropout", "tp=2", processes=2, steps=3, batch=4,
                            seq=16, timeout=180)
    assert report.ok, str(report)
    assert report.turned_off == ["attention_dropout=0.1 on 2 LlamaAttention modules"]
    assert "dropout turned off for the comparison" in str(report)


# -- randomness verify cannot turn off --------------------------------------------------------------------------

def test_a_model_that_draws_random_numbers_outside_dropout_is_refused_with_what_to_do(capsys):
    status, out, err = run_verify(capsys, "noisy_llama", "dp_replicate=2")
    assert status == 2 and out == ""
    line = err.strip().splitlines()[-1]
    assert line.startswith("nbtrain: error: tests.verify_models:noisy_llama (LlamaForCausalLM) draws random "
                           "numbers in training mode outside dropout")
    assert "part at model.layers.0.mlp.act_fn (NoisySiLU)" in line  # where the two seeds' passes part
    assert "cannot be compared step by step" in line and "verify a version without the random operation" in line


def test_a_dropout_probability_read_from_the_config_at_forward_time_is_turned_off_when_nothing_else_is():
    from nbtrain.run.verify import _without_randomness

    model = models().ConfigDropoutLM()
    ids = torch.randint(0, models().VOCAB, (2, 16))
    assert _without_randomness(model, ids, "lm") == ["ConfigDropoutLM's config: hidden_dropout=0.1"]
    assert model.config.hidden_dropout == 0.0 and model.config.hidden_size == 16


# -- one build, two copies ----------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_module_level_instance_is_copied_for_both_runs_and_left_untouched(capsys):
    instance = models().gpt2_instance
    before = {k: v.clone() for k, v in instance.state_dict().items()}
    status, out, _ = run_verify(capsys, "gpt2_instance", "dp_replicate=2")
    assert status == 0, out  # once: the same object trained twice gave DIFFERENT with weights 0.00e+00 apart
    assert "SAME TRAINING" in out
    after = instance.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # not trained in place
    assert instance.training and [m.p for m in dropouts(instance)] == [0.1] * 7  # its dropout stays on


@pytest.mark.slow
def test_a_builder_whose_module_draws_random_numbers_at_import_is_built_once(capsys, monkeypatch):
    import tests

    # verify imports the module afresh, in its first build (both restored afterwards)
    monkeypatch.delitem(sys.modules, "tests.verify_models", raising=False)
    monkeypatch.delattr(tests, "verify_models", raising=False)
    status, out, _ = run_verify(capsys, "llama_built_after_import_noise", "dp_shard=2")
    assert status == 0, out
    assert "SAME TRAINING" in out


# -- fit keeps the dropout the user built ---------------------------------------------------------------------------

@pytest.mark.slow
def test_after_verify_fit_still_trains_the_model_with_its_dropout(capsys):
    status, out, _ = run_verify(capsys, "gpt2_instance", "dp_replicate=2", "--steps", "1")
    assert status == 0, out
    model = copy.deepcopy(models().gpt2_instance)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, models().VOCAB, (4, 16), generator=g)
    targets = torch.roll(ids, -1, dims=1)
    with torch.no_grad():
        without_dropout = lm_loss(copy.deepcopy(model).eval()(ids), targets).item()
        torch.manual_seed(1)
        first = model(ids).logits
        torch.manual_seed(2)
        assert not torch.allclose(first, model(ids).logits)  # in training mode, each pass draws its own masks
    result = nbtrain.fit(model, [(ids, targets)], plan="dp_replicate=2", steps=1, num_processes=2, lr=1e-2,
                         progress=False, timeout=180)
    # the masks changed the loss: by more than verify's tolerance (without them: ~1e-7)
    assert abs(result.losses[0] - without_dropout) > 1e-4 * without_dropout


# -- the verdict says what differs ----------------------------------------------------------------------------------

def test_a_different_verdict_names_the_first_step_whose_loss_differs_and_the_weights():
    report = VerifyReport("dp_replicate=2", 2, reference=[4.0, 3.0, 2.0], parallel=[4.00228, 3.0, 2.01],
                          weight_difference=3.2e-2)
    assert not report.ok
    assert report.verdict() == ("DIFFERENT: step 1's loss differs by a relative 5.7e-04 (tolerance 1e-04) "
                                "(and 1 later step); the weights differ by 3.2e-02 of the distance trained "
                                "(tolerance 0.01)")
    weights_only = VerifyReport("tp=2", 2, reference=[4.0, 3.0], parallel=[4.0, 3.0], weight_difference=0.5)
    assert weights_only.verdict() == ("DIFFERENT: the weights differ by 5.0e-01 of the distance trained "
                                      "(tolerance 0.01)")
    assert "DIFFERENT: step 2's loss differs by a relative nan" in str(
        VerifyReport("tp=2", 2, reference=[4.0, 3.0], parallel=[4.0, float("nan")], weight_difference=0.0))


def test_a_same_verdict_says_both_tolerances_held():
    report = VerifyReport("dp_shard=2", 2, reference=[4.0, 3.0], parallel=[4.0000004, 3.0], weight_difference=2e-5)
    assert report.ok
    assert report.verdict() == ("SAME TRAINING: every step's loss within a relative 1e-04 of one process's "
                                "(largest 1.0e-07) and the weights within 0.01 of the distance trained (2.0e-05)")
    assert "DIFFERENT" not in str(report)
