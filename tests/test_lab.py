"""The lab's checks: a right answer passes, a wrong one fails and says why with the numbers, no answer is "no answer
yet", and nothing a student types makes a check raise. Expectations come from the papers' formulas, worked by hand
here, not from the checks' own output."""

from __future__ import annotations

import json
import math
import pathlib
from fractions import Fraction

import pytest

from nbtrain.notebook import lab

GiB = 2**30
PSI = 6_738_415_616
"""LLaMA-2 7B's parameters, counted in the released checkpoint (Touvron et al. 2023: "7B")."""
NOTEBOOK = pathlib.Path(__file__).resolve().parents[1] / "notebooks" / "03_lab_parallelism.ipynb"


@pytest.fixture(autouse=True)
def fresh_lab():
    lab.reset()
    yield
    lab.reset()


def verdict(check, answer, capsys) -> tuple[bool, str]:
    ok = check(answer)
    return ok, capsys.readouterr().out


# -- the pipeline bubble: GPipe's (p − 1)/(m + p − 1), Huang et al. 2019 ---------------------------------------------
def test_bubble_right_answer_is_gpipe_formula_for_4_stages_and_8_micro_batches(capsys):
    ok, out = verdict(lab.check_bubble, 3 / 11, capsys)  # (4 − 1)/(8 + 4 − 1)
    assert ok is True and out.startswith("✓ right:") and "3/11" in out
    assert lab.results["bubble"] is True


@pytest.mark.parametrize("answer", ["3/11", "27.3%", Fraction(3, 11), 0.2727 * 1.009])
def test_bubble_accepts_fractions_percent_strings_and_answers_within_one_percent(answer, capsys):
    assert verdict(lab.check_bubble, answer, capsys)[0] is True


def test_bubble_wrong_answer_says_why_with_the_formula(capsys):
    ok, out = verdict(lab.check_bubble, 3 / 8, capsys)  # (p − 1)/m: relative to useful time, not the share
    assert ok is False and out.startswith("✗ not quite:")
    assert "27.3%" in out and "(p − 1)/m" in out
    assert lab.results["bubble"] is False


def test_bubble_just_outside_one_percent_fails(capsys):
    assert verdict(lab.check_bubble, 3 / 11 * 1.011, capsys)[0] is False


def test_bubble_given_as_a_percent_number_is_told_to_give_a_fraction(capsys):
    ok, out = verdict(lab.check_bubble, 27.27, capsys)
    assert ok is False and "more than 1" in out


def test_bubble_shows_the_cost_models_pipeline_beside_the_formula(capsys):
    _, out = verdict(lab.check_bubble, 0.5, capsys)
    assert "nbtrain's cost model" in out and "pp=4 mb=8" in out


# -- micro-batches for a 10% bubble: (p − 1)/(m + p − 1) ≤ 0.1 ⇔ m ≥ 9(p − 1) = 27 for p = 4 ---------------------------
def test_bubble_budget_right_answer_is_the_fewest_micro_batches(capsys):
    ok, out = verdict(lab.check_bubble_budget, 27, capsys)
    assert ok is True and "3/30" in out and "10.0%" in out


@pytest.mark.parametrize("answer, why", [(26, "more than 10.0%"), (32, "fewer micro-batches also stay under it")])
def test_bubble_budget_too_few_or_more_than_needed_fails_and_says_which(answer, why, capsys):
    ok, out = verdict(lab.check_bubble_budget, answer, capsys)
    assert ok is False and why in out


def test_bubble_budget_rejects_a_fractional_micro_batch_count(capsys):
    ok, out = verdict(lab.check_bubble_budget, 27.5, capsys)
    assert ok is False and "whole number" in out


# -- ZeRO-3: 16Ψ/N bytes of model states per device (Rajbhandari et al. 2020) -----------------------------------------
@pytest.mark.slow
def test_zero3_right_answer_is_sixteen_psi_over_n_in_gib(capsys):
    ok, out = verdict(lab.check_zero3, 16 * PSI / 8 / GiB, capsys)  # 12.55 GiB
    assert ok is True and "12.55 GiB" in out and "100.41 GiB" in out  # and 16Ψ without ZeRO


@pytest.mark.slow
@pytest.mark.parametrize("answer, why", [
    (16 * PSI / GiB, "without ZeRO"),
    (16 * PSI / 8 / 1e9, "GB"),
    ((2 * PSI + 14 * PSI / 8) / GiB, "ZeRO-2"),
    (12 * PSI / 8 / GiB, "optimizer state alone"),
])
def test_zero3_common_mistakes_fail_and_name_the_mistake(answer, why, capsys):
    ok, out = verdict(lab.check_zero3, answer, capsys)
    assert ok is False and why in out and "12.55 GiB" in out


@pytest.mark.slow
def test_zero3_tolerance_is_two_percent(capsys):
    truth = 16 * PSI / 8 / GiB
    assert verdict(lab.check_zero3, truth * 1.019, capsys)[0] is True
    assert verdict(lab.check_zero3, truth * 1.03, capsys)[0] is False
    assert verdict(lab.check_zero3, f"{truth:.2f} GiB", capsys)[0] is True


# -- activation checkpointing: each block keeps only its input, b·s·h·2 bytes (Chen et al. 2016) ----------------------
@pytest.mark.slow
def test_checkpointing_right_answer_is_blocks_times_saved_bytes_per_block(capsys):
    per_block = lab.profile().layers[1].activation_bytes  # the given: what one block keeps at batch 1, length 4096
    kept = 1 * 4096 * 4096 * 2  # the block's input, hidden size 4096, bf16
    ok, out = verdict(lab.check_checkpointing, 32 * (per_block - kept) / GiB, capsys)
    assert ok is True and "32.00 MiB" in out


@pytest.mark.slow
def test_checkpointing_forgetting_the_kept_input_or_the_block_count_fails_and_says_so(capsys):
    per_block = lab.profile().layers[1].activation_bytes
    ok, out = verdict(lab.check_checkpointing, 32 * 4096 * 4096 * 2 / GiB, capsys)  # what is kept, not saved
    assert ok is False and "keep with checkpointing" in out
    ok, out = verdict(lab.check_checkpointing, (per_block - 4096 * 4096 * 2) / GiB, capsys)
    assert ok is False and "one block" in out


# -- which plan fits 24 GiB: the cost model judges ---------------------------------------------------------------------
@pytest.mark.slow
def test_fits_a_plan_that_fits_by_hand_arithmetic_passes(capsys):
    # ZeRO-3 over 8: 16Ψ/8 = 12.55 GiB of states; 4 micro-batches of 1 sequence, every layer checkpointed keeps its
    # 32 MiB input (34 × 32 MiB ≈ 1.1 GiB), plus one block's recompute (~0.8 GiB) and gathered layer: far below 24
    ok, out = verdict(lab.check_fits_24gib, "mb=4 | dp_shard=8 ac", capsys)
    assert ok is True and out.startswith("✓ right:") and "of 24.00 GiB" in out


@pytest.mark.slow
def test_fits_plain_data_parallel_fails_with_sixteen_psi_of_model_states(capsys):
    ok, out = verdict(lab.check_fits_24gib, "dp_replicate=8", capsys)
    assert ok is False and out.startswith("✗ not quite:")
    assert f"{16 * PSI / GiB:.2f} GiB" in out and "dp_shard" in out  # 16Ψ = 100.41 GiB: shard the states


@pytest.mark.slow
@pytest.mark.parametrize("answer", ["dp_shard=banana", "tp=3", "", "pp=2 | 0-3: tp=2", "dp_shard=8 zero=7"])
def test_fits_an_unreadable_plan_is_a_verdict_not_an_exception(answer, capsys):
    ok, out = verdict(lab.check_fits_24gib, answer, capsys)
    assert ok is False and out.startswith("✗ not quite: could not read your plan:")


# -- every check: no answer, bad types, references ----------------------------------------------------------------
CHECKS = [lab.check_fits_24gib, lab.check_bubble, lab.check_bubble_budget, lab.check_zero3, lab.check_checkpointing]


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_no_answer_yet(check, capsys):
    ok, out = verdict(check, None, capsys)
    assert ok is False and out.startswith("no answer yet")
    assert lab.summary()[check.__name__.removeprefix("check_")] is None


@pytest.mark.parametrize("check", [c for c in CHECKS if c is not lab.check_fits_24gib], ids=lambda c: c.__name__)
@pytest.mark.parametrize("answer", ["twelve", [1, 2], {"a": 1}, True, math.nan, math.inf, "1/0", object()])
def test_unreadable_answers_never_raise(check, answer, capsys):
    ok, out = verdict(check, answer, capsys)
    assert ok is False and out.startswith("✗ not quite: could not read your answer")


@pytest.mark.slow
def test_fits_a_non_text_answer_never_raises(capsys):
    ok, out = verdict(lab.check_fits_24gib, 8, capsys)
    assert ok is False and out.startswith("✗ not quite: could not read your answer") and "a plan is text" in out


@pytest.mark.slow
def test_every_reference_answer_passes_and_the_summary_says_so(capsys):
    for name in lab.EXERCISES:
        assert getattr(lab, f"check_{name}")(lab.reference(name)) is True, capsys.readouterr().out
    assert lab.summary() == {name: True for name in lab.EXERCISES}
    assert f"{len(lab.EXERCISES)} of {len(lab.EXERCISES)} right" in capsys.readouterr().out


def test_reference_answers_of_the_formula_exercises_are_the_papers_numbers():
    assert lab.reference("bubble") == pytest.approx(3 / 11)
    assert lab.reference("bubble_budget") == 27
    assert lab.reference("zero3") == pytest.approx(16 * PSI / 8 / GiB)


def test_reference_of_an_unknown_exercise_names_the_exercises():
    with pytest.raises(ValueError, match="fits_24gib"):
        lab.reference("nope")


def test_reset_forgets_the_verdicts(capsys):
    lab.check_bubble(0.9)
    assert lab.results == {"bubble": False}
    lab.reset()
    assert lab.summary() == {name: None for name in lab.EXERCISES}
    assert "0 of 5 right" in capsys.readouterr().out


# -- the notebook that uses them ---------------------------------------------------------------------------------
def test_the_lab_notebook_checks_every_exercise_and_takes_the_reference_answers_as_a_parameter():
    nb = json.loads(NOTEBOOK.read_text())
    code = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    parameters = [src for c, src in zip([c for c in nb["cells"] if c["cell_type"] == "code"], code)
                  if "parameters" in c["metadata"].get("tags", [])]
    assert len(parameters) == 1 and "reference_answers = False" in parameters[0] and "smoke = False" in parameters[0]
    text = "\n".join(code)
    for name in lab.EXERCISES:
        assert f"lab.check_{name}(" in text and f'lab.reference("{name}")' in text
    assert all(c.get("outputs", []) == [] and c.get("execution_count") is None for c in nb["cells"]
               if c["cell_type"] == "code"), "commit the notebook with its outputs stripped"
