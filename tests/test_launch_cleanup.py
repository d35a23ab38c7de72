"""A launch leaves nothing on disk, however it ends; and it refuses to fork from a process that initialised CUDA.

Each cleanup test gives the launch a fresh, empty temporary directory (``tempfile.tempdir`` and ``TMPDIR``, which the
forked workers inherit) and checks that it is empty again afterwards: torch elastic makes its log folder
(``torchelastic_*``) there on every launch, and a failing worker's ``pytorch-errorfile-*.pickle``, and removes
neither. Forking after CUDA was initialised is simulated on a machine without a GPU (``torch.cuda.is_initialized``
made to say True, tensors on "cuda:0" made by ``FakeTensorMode``); the real thing runs where there is a GPU.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

import nbtrain.run.launch.workers as launch_module
from nbtrain.errors import CudaInitializedError, LaunchError, LaunchTimeoutError, WorkerError
from nbtrain.run.launch.workers import launch

CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU (gloo) path; GPUs take nccl")
LIMIT = 60  # seconds any launch here may take


@pytest.fixture(autouse=True)
def hang_guard():
    faulthandler.dump_traceback_later(2 * LIMIT, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture
def no_process_left():
    before_mp = set(multiprocessing.active_children())
    before_os = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    assert set(multiprocessing.active_children()) - before_mp == set()
    assert {p.pid for p in psutil.Process().children(recursive=True)} - before_os == set()


@pytest.fixture
def fresh_tmp(tmp_path, monkeypatch):
    """An empty temporary directory for this test's launches (the workers inherit it)."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    monkeypatch.setenv("TMPDIR", str(folder))
    return folder


def entries(folder: Path) -> list[str]:
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*"))


def noop():
    return None


def boom_on_rank_1():
    if dist.get_rank() == 1:
        raise ValueError("boom")
    time.sleep(LIMIT)


def sleep_forever():
    time.sleep(10 * LIMIT)


def where_temporary_files_go():
    fd, path = tempfile.mkstemp(prefix=f"user-rank{dist.get_rank()}-")  # the user's own, in a worker
    os.close(fd)
    paths = [None] * dist.get_world_size()
    dist.all_gather_object(paths, path)
    return tempfile.gettempdir(), paths


def on_fake_gpu(module: torch.nn.Module) -> torch.nn.Module:
    """``module.cuda()`` on a machine without CUDA: its parameters become fake tensors that say cuda:0."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        return module.to_empty(device="cuda")


# -- nothing left on disk -------------------------------------------------------------------------------------------

@CPU_ONLY
def test_a_launch_that_succeeds_leaves_nothing_in_the_temporary_directory(fresh_tmp, no_process_left):
    assert launch(noop, num_processes=2, timeout=LIMIT) is None
    assert entries(fresh_tmp) == []
    assert tempfile.tempdir == str(fresh_tmp)  # this process's setting put back


@CPU_ONLY
def test_a_launch_whose_worker_raises_leaves_nothing_not_even_the_error_files(fresh_tmp, no_process_left):
    with pytest.raises(WorkerError, match="rank 1 of 2 failed: ValueError: boom"):
        launch(boom_on_rank_1, num_processes=2, timeout=LIMIT)
    assert entries(fresh_tmp) == []  # elastic's torchelastic_*/…/error.json, pytorch-errorfile-*.pickle


@CPU_ONLY
def test_a_launch_past_its_timeout_leaves_nothing(fresh_tmp, no_process_left):
    with pytest.raises(LaunchTimeoutError):
        launch(sleep_forever, num_processes=2, timeout=2)
    assert entries(fresh_tmp) == []


@CPU_ONLY
def test_an_interrupted_launch_leaves_nothing(tmp_path):
    # Ctrl-C, from the first worker once both run (elastic's folder is there then), to a fresh interpreter: a SIGINT
    # must never reach pytest.
    folder = tmp_path / "tmp"
    folder.mkdir()
    script = textwrap.dedent("""
        import glob, os, signal, tempfile, time
        import torch.distributed as dist
        from nbtrain.run.launch.workers import launch

        def interrupted():
            if dist.get_rank() == 0:
                print("elastic's folder", len(glob.glob(os.path.join(os.environ["TMPDIR"], "nbtrain-launch-*",
                                                                      "tmp", "torchelastic_*"))), flush=True)
                os.kill(os.getppid(), signal.SIGINT)
            time.sleep(60)

        try:
            launch(interrupted, num_processes=2)
        except KeyboardInterrupt:
            print("interrupted")
        print("left", sorted(os.listdir(tempfile.gettempdir())))
    """)
    proc = subprocess.run(["timeout", "-k", "5", str(LIMIT), sys.executable, "-c", script], capture_output=True,
                          text=True, timeout=LIMIT + 10, env={**os.environ, "TMPDIR": str(folder)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert "elastic's folder 1" in lines and "interrupted" in lines, proc.stdout
    assert "left []" in lines, proc.stdout
    assert entries(folder) == []


@CPU_ONLY
def test_the_users_code_in_the_workers_writes_its_temporary_files_where_it_always_does_and_they_stay(
        fresh_tmp, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", None)  # not looked up yet, as in most processes: from TMPDIR
    where, paths = launch(where_temporary_files_go, num_processes=2, timeout=LIMIT)
    assert where == str(fresh_tmp)
    assert entries(fresh_tmp) == sorted(Path(path).name for path in paths)  # both kept, and nothing else
    assert tempfile.tempdir is None


# -- CUDA initialised before forking --------------------------------------------------------------------------------

@pytest.fixture
def cuda_initialised(monkeypatch):
    """This process as after ``model.cuda()`` or a ``torch.cuda`` call (simulated: no CUDA is touched)."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)


def test_a_forked_launch_after_cuda_was_initialised_is_refused_before_any_worker_starts(
        cuda_initialised, monkeypatch, no_process_left):
    forked = []
    monkeypatch.setattr(launch_module, "_fork_and_run", lambda *args: forked.append(args))
    with pytest.raises(CudaInitializedError) as caught:
        launch(noop, num_processes=2, timeout=LIMIT)
    assert isinstance(caught.value, LaunchError) and forked == []
    assert str(caught.value).startswith("CUDA is already initialised in this process: torch.cuda was initialised by "
                                        "something no longer in sight (a .cuda() or .to('cuda') whose tensors are "
                                        "gone, or a torch.cuda call such as torch.cuda.current_device()). Workers "
                                        "forked from it cannot use CUDA")
    assert "Restart the kernel, keep the model on the CPU or the meta device until the launch" in str(caught.value)


@CPU_ONLY
def test_once_cuda_is_no_longer_initialised_the_same_process_launches(monkeypatch, no_process_left):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(CudaInitializedError):
        launch(noop, num_processes=2, timeout=LIMIT)
    monkeypatch.undo()
    assert launch(os.getpid, num_processes=2, timeout=LIMIT) != os.getpid()


def test_the_message_names_what_holds_tensors_on_a_gpu(monkeypatch):
    model = on_fake_gpu(torch.nn.Linear(2, 2))  # before: a fake tensor asks CUDA for its device once it is "there"
    batches = [(on_fake_gpu(torch.nn.Linear(2, 2)).weight, None)]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(launch_module, "_fork_and_run", lambda *args: pytest.fail("forked"))
    with pytest.raises(CudaInitializedError, match=r": the Linear given to the launch has parameters on cuda:0\. "):
        launch(lambda m: None, model, num_processes=2)
    with pytest.raises(CudaInitializedError, match=r": a tensor given to the launch is on cuda:0\. "):
        launch(lambda data: None, data=batches[0], num_processes=2)

    def train():
        return model(torch.ones(2))

    with pytest.raises(CudaInitializedError, match=r": model \(a Linear used by train\) has parameters on cuda:0\. "):
        launch(train, num_processes=2)


def test_one_process_runs_as_usual_with_cuda_initialised(cuda_initialised):
    assert launch(lambda: 7, num_processes=1) == 7  # no fork: nothing to refuse


def test_a_torchrun_rank_runs_as_usual_with_cuda_initialised(cuda_initialised, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(launch_module.free_port()))
    assert launch(lambda: 8) == 8
    assert not dist.is_initialized()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="initialises CUDA for real: needs a GPU")
def test_on_a_gpu_a_model_moved_to_it_before_the_launch_is_named():
    script = textwrap.dedent("""
        import torch
        from nbtrain.errors import CudaInitializedError
        from nbtrain.run.launch.workers import launch

        model = torch.nn.Linear(2, 2).cuda()
        try:
            launch(lambda m: None, model, num_processes=2)
        except CudaInitializedError as error:
            print(f"{type(error).__name__}: {error}")
    """)
    proc = subprocess.run(["timeout", "-k", "5", str(LIMIT), sys.executable, "-c", script], capture_output=True,
                          text=True, timeout=LIMIT + 10)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("CudaInitializedError: CUDA is already initialised in this process: the Linear "
                                  "given to the launch has parameters on cuda:0. "), proc.stdout
