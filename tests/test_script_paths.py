"""The ways a user starts a script from a shell, as they type them: ``nbtrain run``, ``torchrun`` (one node, and two
"nodes" on this machine), ``accelerate launch``; a ``module:attr`` model beside them; resuming a finished run.

Every command runs in a fresh process under ``timeout -k``, so a hang fails the test instead of stalling CI. The
scripts they run are in ``tests/scripts/``. A torchrun here talks over 127.0.0.1 only, on a free port.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import nbtrain

SCRIPTS = Path(__file__).resolve().parent / "scripts"
BIN = Path(sys.executable).parent  # the environment's console scripts: nbtrain, accelerate
LIMIT = 240  # seconds any command here may take (timeout -k 10)

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU (gloo) paths; GPUs take nccl")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def environment(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", NBTRAIN_NONINTERACTIVE="1", **extra)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):  # this test's own launch, if any
        env.pop(key, None)
    return env


def command(*args, cwd=None, env=None, limit: int = LIMIT) -> subprocess.CompletedProcess:
    return subprocess.run(["timeout", "-k", "10", str(limit), *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=env or environment())


def started(*args, env=None) -> subprocess.Popen:
    return subprocess.Popen(["timeout", "-k", "10", str(LIMIT), *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env or environment())


def torchrun(*args) -> list:
    return [sys.executable, "-m", "torch.distributed.run", *args]


# -- nbtrain run: sys.exit ---------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("form", ["0", "None", "bare"])
def test_a_script_ending_in_sys_exit_main_finishes_on_every_rank(form):
    done = command(BIN / "nbtrain", "run", SCRIPTS / "sys_exit_main.py", "--processes", "2", "--", form)
    assert done.returncode == 0, done.stdout + done.stderr  # 124: it hung
    assert "rank 0 of 2 done" in done.stdout and "rank 1 of 2 done" in done.stdout
    assert "error" not in done.stderr, done.stderr


@pytest.mark.slow
def test_sys_exit_with_a_nonzero_status_on_one_rank_is_its_failure_named_with_the_status():
    script = SCRIPTS / "exit_3_on_rank_1.py"
    done = command(BIN / "nbtrain", "run", script, "--processes", "2")
    assert done.returncode == 2, done.stdout + done.stderr  # 124: rank 0 was left waiting in its barrier
    last = done.stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"nbtrain: error: rank 1 of 2 exited with status 3 \(sys\.exit\(3\) at "
                        rf"{re.escape(str(script))}, line 8\)( \(then rank 0 failed too\))?; the other workers were "
                        "stopped", last), last
    assert "Traceback" not in done.stderr  # an exit is not an exception: one line says it all


@pytest.mark.slow
def test_a_rank_that_ends_early_while_another_waits_in_a_collective_is_named_at_the_timeout():
    code = ("from nbtrain.run.launch.script import run_script\nfrom nbtrain.run.launch.workers import launch\n"
            f"try:\n    launch(run_script, {str(SCRIPTS / 'rank_1_ends_early.py')!r}, [], num_processes=2, timeout=8)\n"
            "except Exception as error:\n    print(f'{type(error).__name__}: {error}')\n")
    done = command(sys.executable, "-c", code)
    assert done.returncode == 0, done.stdout + done.stderr
    said = done.stdout.strip().splitlines()[-1]
    assert said == ("LaunchTimeoutError: the 2 workers ran past timeout=8 s and were killed. Every rank waited in a "
                    "collective, but not in the same one: rank 0 waited in all_reduce (called at "
                    "rank_1_ends_early.py:13 in <module>); rank 1 waited in barrier, called by nbtrain's launch after "
                    "the function returned. Make every rank call the same collectives in the same order."), said


@pytest.mark.slow
def test_a_rank_that_ends_early_is_named_when_the_collectives_time_out_without_a_launch_timeout():
    # nbtrain run passes no timeout: the collectives' own (30 min; 6 s here) ends the wait, first on the rank that
    # ended (it waited longest), which says why
    code = ("import datetime\n"
            "import nbtrain.run.launch.workers as launch_module\nfrom nbtrain.run.launch.script import run_script\n"
            "launch_module._PG_TIMEOUT = datetime.timedelta(seconds=6)\n"
            "try:\n"
            f"    launch_module.launch(run_script, {str(SCRIPTS / 'rank_1_ends_early.py')!r}, [], "
            "num_processes=2)\n"
            "except Exception as error:\n    print(error.summary)\n")
    done = command(sys.executable, "-c", code)
    assert done.returncode == 0, done.stdout + done.stderr
    said = done.stdout.strip().splitlines()[-1]
    assert said.startswith("rank 1 of 2 failed: LaunchError: rank 1 finished, but the other ranks did "
                           "not reach the end within the collectives' timeout (6 s): one still waits in a collective "
                           "this rank never called (did it return, or sys.exit(0), before a collective the others "
                           "call?)"), said


# -- nbtrain.fit in a script under torchrun ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def forked_run(tmp_path_factory) -> dict:
    """What the script ends with run by plain ``python``: fit forks its workers (the reference)."""
    out = tmp_path_factory.mktemp("forked") / "run"
    done = command(sys.executable, SCRIPTS / "fit_tiny_gpt.py", out)
    assert done.returncode == 0, done.stdout + done.stderr
    return torch.load(f"{out}.main.pt")


def assert_ends_like_the_forked_run(saved: dict, forked: dict) -> None:
    assert saved["model_class"] == "GPT"  # the caller's model, not the parallelized one
    assert saved["steps"] == forked["steps"] == [1, 2] and saved["plan"] == forked["plan"] == "dp_shard=2"
    assert saved["losses"] == pytest.approx(forked["losses"], rel=0, abs=1e-6)
    assert saved["state"].keys() == forked["state"].keys() == saved["result_state"].keys()
    assert not all(torch.equal(forked["state"][k], forked["initial"][k]) for k in forked["state"])  # it trained
    for name, tensor in forked["state"].items():
        torch.testing.assert_close(saved["state"][name], tensor, rtol=0, atol=1e-6, msg=name)
        torch.testing.assert_close(saved["result_state"][name], tensor, rtol=0, atol=1e-6, msg=name)


@pytest.mark.slow
def test_fit_under_torchrun_on_one_node_of_two_processes_ends_with_the_forked_runs_weights_on_every_rank(
        tmp_path, forked_run):
    out = tmp_path / "run"
    done = command(*torchrun("--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", free_port(),
                             SCRIPTS / "fit_tiny_gpt.py", out))
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in (0, 1):
        assert_ends_like_the_forked_run(torch.load(f"{out}.{rank}.pt"), forked_run)


@pytest.mark.slow
def test_fit_under_torchrun_on_two_nodes_of_one_process_ends_with_the_forked_runs_weights_on_every_rank(
        tmp_path, forked_run):
    out, port = tmp_path / "run", free_port()
    nodes = [started(*torchrun("--nnodes", "2", "--node-rank", str(k), "--nproc-per-node", "1",
                               "--master-addr", "127.0.0.1", "--master-port", str(port),
                               SCRIPTS / "fit_tiny_gpt.py", out)) for k in (0, 1)]
    outputs = [node.communicate()[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(outputs)
    for rank in (0, 1):
        assert_ends_like_the_forked_run(torch.load(f"{out}.{rank}.pt"), forked_run)


def test_under_torchrun_a_plan_for_another_world_says_so_in_the_launchers_terms(monkeypatch):
    monkeypatch.setenv("RANK", "0")  # what torchrun --nproc-per-node 2 sets in each process
    monkeypatch.setenv("WORLD_SIZE", "2")
    model = nbtrain.GPT(nbtrain.GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
    window = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(1))
    batches = [(window[:, :-1], window[:, 1:])]
    with pytest.raises(nbtrain.errors.InvalidPlanError,
                       match=r"does not divide the 2 devices.*\(this process is one of the 2 ranks torchrun or "
                             r"accelerate launch started, WORLD_SIZE=2: the plan is for that many devices\)"):
        nbtrain.fit(model, batches, plan="dp_shard=4", steps=1, progress=False)
    with pytest.raises(nbtrain.errors.InvalidArgumentError,
                       match=r"num_processes=4, but this process is one of the 2 ranks torchrun or accelerate launch "
                             r"started \(WORLD_SIZE=2\); leave num_processes out"):
        nbtrain.fit(model, batches, plan="dp_shard=2", steps=1, num_processes=4, progress=False)


@pytest.mark.slow
def test_fit_in_a_script_under_nbtrain_run_ends_with_the_forked_runs_weights_on_every_rank(tmp_path, forked_run):
    out = tmp_path / "run"  # each forked rank of nbtrain run has RANK set: fit runs in it, as under torchrun
    done = command(BIN / "nbtrain", "run", SCRIPTS / "fit_tiny_gpt.py", "--processes", "2", "--", out)
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in (0, 1):
        assert_ends_like_the_forked_run(torch.load(f"{out}.{rank}.pt"), forked_run)


# -- accelerate launch on CPU ------------------------------------------------------------------------------------

@pytest.mark.slow
def test_accelerate_launch_multi_gpu_with_accelerate_use_cpu_runs_two_cpu_ranks_of_one_group(tmp_path):
    # docs/running.md's incantation; a port of our own, and no accelerate config of this machine's user (HF_HOME)
    out = tmp_path / "seen"
    done = command(BIN / "accelerate", "launch", "--multi_gpu", "--num_processes", "2",
                   "--main_process_port", free_port(), SCRIPTS / "report_ranks.py", out,
                   env=environment(ACCELERATE_USE_CPU="1", HF_HOME=str(tmp_path / "hf")))
    assert done.returncode == 0, done.stdout + done.stderr
    seen = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in (0, 1)]
    assert [(s["rank"], s["world_size"], s["ranks_reduced"]) for s in seen] == [(0, 2, 2), (1, 2, 2)]
    assert seen[0]["pid"] != seen[1]["pid"]


# -- module:attr from the current folder -------------------------------------------------------------------------

MODS = ("import nbtrain\n\n\n"
        "def tiny():\n"
        "    return nbtrain.GPT(nbtrain.GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))\n")


def test_the_nbtrain_command_finds_a_module_in_the_current_folder(tmp_path):
    (tmp_path / "mods.py").write_text(MODS)
    done = command(BIN / "nbtrain", "profile", "mods:tiny", "--seq", "16", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["model"] == "mods:tiny"


def test_a_module_found_nowhere_says_where_it_was_looked_for(tmp_path):
    done = command(BIN / "nbtrain", "profile", "nomods:tiny", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip() == (
        f"nbtrain: error: cannot import 'nomods' (from 'nomods:tiny'): there is no module 'nomods' in the current "
        f"folder ({tmp_path}/) or anywhere else on Python's path (sys.path); run from the folder that holds "
        "nomods.py (or the package nomods/), set PYTHONPATH to that folder, or install the package (pip install -e .)")


def test_a_module_that_imports_something_missing_is_named_without_the_search_hint(tmp_path, monkeypatch):
    from nbtrain.errors import ModelLoadError
    from nbtrain.models.resolve import load_reference

    (tmp_path / "needs_missing.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # load_reference puts the folder first: not for later tests
    with pytest.raises(ModelLoadError) as caught:
        load_reference("needs_missing:model")
    assert str(caught.value) == ("cannot import 'needs_missing' (from 'needs_missing:model'): ModuleNotFoundError: "
                                 "No module named 'no_such_dependency_xyz'")
    sys.modules.pop("needs_missing", None)


# -- resuming a run that is already done -------------------------------------------------------------------------

@pytest.mark.parametrize("steps", [1, 2])
def test_resuming_a_run_already_at_its_steps_says_there_is_nothing_to_train(tmp_path, capsys, steps):
    torch.manual_seed(0)
    model = nbtrain.GPT(nbtrain.GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
    window = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(1))
    batches = [(window[:, :-1], window[:, 1:])]
    done = nbtrain.fit(model, batches, plan="ac", steps=2, num_processes=1, progress=False, checkpoint_dir=tmp_path)
    capsys.readouterr()
    again = nbtrain.fit(model, batches, plan="ac", steps=steps, num_processes=1, progress=False,
                        checkpoint_dir=tmp_path, resume=True)
    printed = capsys.readouterr().out
    assert (f"note: the run in {tmp_path} is already at step 2 of steps={steps}: nothing to train; pass a larger "
            "steps to go on") in printed
    assert again.resumed_at == 2 and again.losses == done.losses  # the FitResult as before: the saved run's steps
    assert all(torch.equal(v, done.state_dict[k]) for k, v in model.state_dict().items())


def test_resuming_a_run_short_of_its_steps_trains_on_without_the_note(tmp_path, capsys):
    torch.manual_seed(0)
    model = nbtrain.GPT(nbtrain.GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
    window = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(1))
    batches = [(window[:, :-1], window[:, 1:])]
    nbtrain.fit(model, batches, plan="ac", steps=1, num_processes=1, progress=False, checkpoint_dir=tmp_path)
    again = nbtrain.fit(model, batches, plan="ac", steps=2, num_processes=1, progress=False, checkpoint_dir=tmp_path,
                        resume=True)
    assert [r.step for r in again.records] == [1, 2] and "nothing to train" not in capsys.readouterr().out
