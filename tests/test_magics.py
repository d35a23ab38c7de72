"""``%%autoparallel`` in an IPython shell: what a notebook user sees and keeps, and the one-line errors.

These run the magic in this process's InteractiveShell (what a kernel runs); tests/test_notebooks.py runs it in
real kernels under papermill.
"""

from __future__ import annotations

import multiprocessing
import re

import pytest
import torch

from nbtrain.planner.plan import Plan

TINY = ("import nbtrain\n"
        "model = nbtrain.GPT(nbtrain.GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64, "
        "tie_embeddings=False))\n")


@pytest.fixture(autouse=True)
def noninteractive(monkeypatch):
    monkeypatch.setenv("NBTRAIN_NONINTERACTIVE", "1")


def run(shell, line: str, body: str = TINY):
    return shell.run_cell(f"%%autoparallel {line}\n{body}")


def test_the_extension_registers_the_magic_and_its_help_lists_the_flags(shell):
    magic = shell.find_cell_magic("autoparallel")
    assert magic is not None
    for flag in ("--model", "--data", "--loss", "--gpus", "--gpus-per-node", "--gpu", "--memory", "--batch", "--seq",
                 "--strategy", "--no-offload", "--top", "-o", "-q", "--launch", "--processes", "--steps", "--export"):
        assert flag in magic.__doc__, flag


def test_importing_nbtrain_does_not_import_ipython():
    import subprocess
    import sys

    code = "import sys, nbtrain; nbtrain.Plan; print('IPython' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_plan_only_shows_the_table_the_comparison_and_the_summary_and_stores_the_plan(shell, capsys):
    result = run(shell, "--gpus 8 --gpu H100 --batch 32 -o best")
    assert result.success, result.error_in_exec
    best = shell.user_ns["best"]
    assert isinstance(best, Plan) and best.num_devices == 8 and best.global_batch == 32
    out = capsys.readouterr().out
    assert "time/µbatch" in out  # the per-stage plan table
    assert "DDP" in out and "FSDP (ZeRO-3)" in out  # the comparison with the usual strategies
    assert f"{best.summary()} · for 8 × H100 (catalog)" in out.splitlines()  # and which cluster it was


def test_without_gpus_or_gpu_the_plan_is_for_this_machine_and_says_so(shell, capsys):
    """No cluster described: this machine (here: no GPU, so the 2 CPU processes --launch would start), measured."""
    result = run(shell, "--batch 8 -q -o here")
    assert result.success, result.error_in_exec
    here = shell.user_ns["here"]
    assert here.num_devices == 2
    assert capsys.readouterr().out.strip().endswith("· for this machine: 2 × cpu (calibrated)")


def test_dollar_variables_in_the_line_expand(shell):
    shell.user_ns["n"] = 4
    assert run(shell, "--gpus $n --batch 8 -o four").success
    assert shell.user_ns["four"].num_devices == 4


def test_quiet_prints_only_the_summary(shell, capsys):
    assert run(shell, "--gpus 2 --batch 8 -q -o quiet").success
    assert capsys.readouterr().out.strip() == f"{shell.user_ns['quiet'].summary()} · for 2 × H100 (catalog)"


def test_a_typed_strategy_is_evaluated_not_searched_and_called_yours_above_the_tables(shell, capsys):
    assert run(shell, '--gpus 4 --batch 8 --strategy "dp_shard=2 tp=2 ac" -o typed').success
    typed = shell.user_ns["typed"]
    assert str(typed.layers[1]) == "dp_shard=2 tp=2 ac" and typed.predicted is not None
    out = capsys.readouterr().out
    assert out.startswith("your plan: ") and "recommended" not in out  # the summary first, then the tables
    assert out.index("your plan: ") < out.index("on 4 devices:") < out.index("× your plan's time")


def test_the_model_can_be_named_when_the_cell_makes_several(shell):
    body = TINY + "other = nbtrain.GPT(nbtrain.GPTConfig(vocab_size=256, block_size=64, n_layer=1, n_head=2, n_embd=32))\n"
    assert run(shell, "--gpus 2 --batch 4 --model other -o named", body).success
    assert shell.user_ns["named"].num_layers == 1 + 2  # embeddings, one block, head


@pytest.mark.parametrize("line,body,message", [
    ("--gpus 2", "x = 1\n", "the cell made no torch.nn.Module"),
    ("--gpus 2", TINY + "second = nbtrain.GPT(model.config)\n", "several models: model (GPT), second (GPT)"),
    ("--gpus 2 --model x", "x = 1\n", "'x' is a int, not a torch.nn.Module"),
    ("--gpus 2 --bogus 3", TINY, "unrecognized arguments: --bogus 3"),
    ("--gpus 0", TINY, "--gpus 0: must be a positive integer"),
    ("--gpus 8 --memory 1MiB", TINY, "no plan fits 1.00 MiB per device"),
    ("--gpus 2 --gpu TPU", TINY, "TPU"),
    ("--gpus 2 --launch --data nothing", TINY, "--data nothing: no variable 'nothing'"),
    ("--gpus 2 --memory 40", TINY, "--memory 40: '40' has no unit; write '40GiB'"),
    ('--gpus 8 --batch 16 --strategy "tp=8"', TINY,
     "InvalidPlanError: layer 1 (blocks.0) of model: tp=8 does not divide the 4 attention heads; use a tp that divides "
     "4: 1, 2 or 4"),
    ("--gpus 2 --launch --lr -1", TINY, "--lr -1: the learning rate must be a positive number"),
    ("--gpus 2 --launch --timeout 0", TINY, "--timeout 0: must be a positive number of seconds"),
    ("--gpus 2 --batch 4 -q --launch --processes 2 --data batches",
     TINY + "import torch\nbatches = [(torch.rand(4, 32), torch.zeros(4, 32, dtype=torch.long))]\n",
     "InvalidArgumentError: batch of step 0: ids have dtype torch.float32; token ids must be an integer tensor"),
    ("--gpus 2 --batch 4 -q --launch --processes 2 --data batches",
     TINY + "import torch\nbatches = [(torch.zeros(32, dtype=torch.long),) * 2]\n",
     "InvalidArgumentError: batch of step 0: ids have shape (32); token ids are one row per sequence"),
    ("--gpus 2 --batch 4 -q --launch --processes 2 --data batches",
     TINY + "import torch\nbatches = [(torch.zeros(4, 32, dtype=torch.long), torch.zeros(4, 31, dtype=torch.long))]\n",
     "InvalidArgumentError: batch of step 0: targets have shape (4, 31) but ids (4, 32)"),
    ("--gpus 2 --batch 4 -q --launch --processes 2 --data batches",
     TINY + "import torch\nbatches = [(torch.full((4, 32), 256), torch.zeros(4, 32, dtype=torch.long))]\n",
     "InvalidArgumentError: batch of step 0: ids range from 256 to 256 but the model takes ids 0 to 255"),
    ("--gpus 2 --batch 4 -q --launch --processes 2 --data batches",
     TINY + "import torch\nbatches = [(torch.zeros(3, 32, dtype=torch.long),) * 2]\n",
     "InvalidPlanError: --data: batches of 3 rows do not split under the plan scaled to 2 processes: global_batch=3 "
     "is not divisible by"),
    ("--gpus 2 --batch 4 -q --launch --processes 2 --data batches", TINY + "batches = []\n",
     "InvalidArgumentError: --data holds no batches"),
    ('--gpus 2 -q --launch --processes 2 --strategy "pp=2 mb=2"',
     "from tests.any_models import last_to_first_lm\nnet = last_to_first_lm()\n",
     "LastToFirstLM's forward does not run blocks.0 (layer 1) in pipeline stage 0"),
])
def test_mistakes_end_the_cell_with_one_usage_error_and_the_notebook_keeps_its_state(shell, capsys, line, body,
                                                                                     message):
    from IPython.core.error import UsageError

    shell.user_ns["kept"] = kept = object()
    result = run(shell, line, body)
    assert isinstance(result.error_in_exec, UsageError)
    assert message in str(result.error_in_exec)
    assert "Traceback" not in capsys.readouterr().out
    assert shell.user_ns["kept"] is kept
    assert shell.run_cell("after = 1 + 1").success and shell.user_ns["after"] == 2


def test_an_error_in_the_cells_own_code_shows_the_users_line_then_one_usage_error(shell, capsys):
    from IPython.core.error import UsageError

    result = run(shell, "--gpus 2", "x = 1\nmodel = undefined_name\n")
    assert isinstance(result.error_in_exec, UsageError)
    assert str(result.error_in_exec).startswith("the cell's code raised NameError")
    shown = re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().out)  # IPython colours its tracebacks
    assert "----> 2 model = undefined_name" in shown and "Could not get source" not in shown
    assert "magics.py" not in shown  # the traceback is the cell's, not the magic's


@pytest.mark.slow
def test_launch_trains_under_the_scaled_plan_and_loads_the_weights_back(shell, capsys):
    result = run(shell, "--gpus 8 --batch 16 -o job --launch --processes 2 --steps 3 --lr 3e-3")
    assert result.success, result.error_in_exec
    trained = shell.user_ns["job_result"]
    assert trained.plan.num_devices == 2 and len(trained.losses) == 3
    assert trained.losses[-1] < trained.losses[0]
    model = shell.user_ns["model"]
    assert all(torch.equal(model.state_dict()[k], v) for k, v in trained.state_dict.items())
    out = capsys.readouterr().out
    assert "measured step time" in out and "predicted" in out and "the trained weights are in model" in out


@pytest.mark.slow
def test_documents_in_data_are_bucketed_planned_for_this_machine_and_trained_as_planned(shell, capsys):
    shell.run_cell("from nbtrain.data import WIKIPEDIA, histogram_documents\n"
                   "docs = histogram_documents(WIKIPEDIA, 300, scale=64, vocab_size=256)")
    result = run(shell, "--data docs --memory 16MiB -o job --launch --processes 2 --steps 2")
    assert result.success, result.error_in_exec
    trained = shell.user_ns["job_result"]
    assert len(trained.losses) == 2 and trained.layout.bounds[-1] == 64  # rows up to the model's context
    model = shell.user_ns["model"]
    assert all(torch.equal(model.state_dict()[k], v) for k, v in trained.state_dict.items())
    out = capsys.readouterr().out
    assert "one strategy per length bucket" in out and "per bucket (rank 0" in out
    assert "the trained weights are in model" in out


def _failing_loss(output, targets):
    """Next-token loss that fails in the worker of rank 1 (planning, in the notebook's process, works)."""
    import torch.distributed as dist

    from nbtrain.profiler.model import lm_loss

    if dist.is_initialized() and dist.get_rank() == 1:
        raise ValueError("this loss fails on rank 1")
    return lm_loss(output, targets)


@pytest.mark.slow
def test_a_worker_that_raises_ends_the_cell_with_its_rank_and_error_and_no_process_is_left(shell, capsys):
    from IPython.core.error import UsageError

    shell.user_ns["bad_loss"] = _failing_loss
    before = set(multiprocessing.active_children())
    result = run(shell, "--gpus 2 --batch 4 -q --launch --processes 2 --steps 2 --loss bad_loss")
    assert isinstance(result.error_in_exec, UsageError)
    message = str(result.error_in_exec)
    assert message.startswith("WorkerError: rank 1 of 2 failed: ValueError: this loss fails on rank 1"), message
    assert "\n" not in message and "Traceback" not in message  # the traceback is shown above the line
    shown = capsys.readouterr().err
    assert 'in _failing_loss\n    raise ValueError("this loss fails on rank 1")' in shown, shown
    assert set(multiprocessing.active_children()) - before == set()


def test_export_refuses_a_cell_that_needs_values_from_earlier_cells(shell, tmp_path):
    shell.user_ns["cfg"] = shell.user_ns["model"].config if "model" in shell.user_ns else None
    result = run(shell, f"--gpus 2 --batch 4 -q --export {tmp_path / 'run.ipynb'}", "model2 = nbtrain.GPT(cfg)\n")
    assert "uses cfg from earlier cells" in str(result.error_in_exec)
    assert not (tmp_path / "run.ipynb").exists()


def test_running_the_same_cell_again_does_not_profile_again(shell, monkeypatch):
    import nbtrain.notebook.cell as cell

    calls = []
    real = cell.profile
    monkeypatch.setattr(cell, "profile", lambda *a, **k: calls.append(1) or real(*a, **k))
    body = TINY.replace("n_layer=2", "n_layer=3")  # a shape no other test planned
    assert run(shell, "--gpus 2 --batch 4 -q", body).success
    assert run(shell, "--gpus 4 --batch 8 -q", body).success  # a new model object, the same structure
    assert len(calls) == 1


@pytest.mark.parametrize("line,message", [
    ("--gpus 2 --resume ckpt", "--resume saves or resumes a training run: add --launch"),
    ("--gpus 2 --launch --checkpoint-every 2", "--checkpoint-every 2: add --checkpoint-dir DIR"),
    ("--gpus 2 --launch --resume a --checkpoint-dir b", "a resumed run saves where it resumed from"),
])
def test_checkpoint_flags_that_cannot_work_end_the_cell_before_its_code_runs(shell, line, message):
    from IPython.core.error import UsageError

    shell.user_ns.pop("untouched", None)
    result = run(shell, line, "untouched = 1\n" + TINY)
    assert isinstance(result.error_in_exec, UsageError) and message in str(result.error_in_exec)
    assert "untouched" not in shell.user_ns


@pytest.mark.slow
def test_launch_resume_goes_on_from_the_checkpoint_under_another_process_count(shell, tmp_path):
    line = f"--gpus 8 --batch 8 -q -o job --launch --lr 3e-3 --checkpoint-dir {tmp_path}"
    assert run(shell, f"{line} --processes 2 --steps 2").success
    first = shell.user_ns["job_result"]
    line = f"--gpus 8 --batch 8 -q -o job --launch --lr 3e-3 --resume {tmp_path}"
    result = run(shell, f"{line} --processes 1 --steps 4")  # the cell builds a fresh model: the checkpoint's wins
    assert result.success, result.error_in_exec
    resumed = shell.user_ns["job_result"]
    assert resumed.resumed_at == 2 and [r.step for r in resumed.records] == [1, 2, 3, 4]
    assert resumed.losses[:2] == first.losses and resumed.losses[-1] < resumed.losses[0]
    assert resumed.checkpoint.endswith("step-00000004")


@pytest.mark.slow
def test_keep_leaves_a_session_that_the_line_form_trains_on_and_a_second_keep_asks_to_close_it(shell, capsys):
    from nbtrain.run.session.session import Session

    result = run(shell, "--launch --processes 2 --steps 3 --keep s --no-calibrate -q")
    assert result.success
    session = shell.user_ns["s"]
    try:
        assert isinstance(session, Session) and session.alive and session.steps_done == 3
        before = {k: v.clone() for k, v in shell.user_ns["model"].state_dict().items()}
        assert shell.run_cell("%autoparallel s --steps 2 --lr 1e-4").success
        assert session.steps_done == 5 and session.lr == 1e-4
        out = capsys.readouterr().out
        assert f"session (open): {session.plan} on 2 processes, 5 steps" in out and "%autoparallel s --steps N" in out
        # the weights stay in the session until asked for
        assert all(torch.equal(v, before[k]) for k, v in shell.user_ns["model"].state_dict().items())
        again = run(shell, "--launch --processes 2 --steps 1 --keep s --no-calibrate -q")
        assert not again.success and "s holds an open session" in str(again.error_in_exec)
        assert not shell.run_cell("%autoparallel model --steps 1").success  # not a session: one line says so
    finally:
        session.close()
