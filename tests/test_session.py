"""A session keeps the workers and the model between calls, and trains exactly as one ``fit`` of as many steps does;
every way it can end leaves no process behind, and no one but the notebook reaches its workers.

The model is transformers' Qwen2 of its default config (tests/any_models.py); the reference is ``nbtrain.fit`` in
one process (and, for the continuation, one ``fit`` of all the steps), never the session's own output.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

import nbtrain
import tests.any_models as zoo
from nbtrain.errors import InvalidArgumentError, InvalidPlanError, WorkerError
from nbtrain.run.session.session import SessionError

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def _batches(count: int = 10, rows: int = 4, seq: int = 16):
    g = torch.Generator().manual_seed(0)
    return [(ids, torch.roll(ids, -1, 1)) for ids in (torch.randint(0, zoo.VOCAB, (rows, seq), generator=g)
                                                      for _ in range(count))]


def _ours() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-4, atol=1e-6)


def test_two_fits_of_five_steps_are_one_fit_of_ten_and_one_process():
    batches = _batches()
    with nbtrain.Session(zoo.qwen2(), plan="dp_shard=2", num_processes=2) as session:
        losses = session.fit(batches, steps=5, progress=False).losses + \
            session.fit(batches, steps=5, progress=False).losses
        trained = session.weights()
        assert session.steps_done == 10
    whole = nbtrain.fit(zoo.qwen2(), batches, plan="dp_shard=2", steps=10, num_processes=2, progress=False)
    one = zoo.qwen2()
    alone = nbtrain.fit(one, batches, plan="dp_replicate=1", steps=10, num_processes=1, progress=False)
    assert losses == whole.losses
    assert losses == pytest.approx(alone.losses, rel=1e-4)
    assert all(_close(a, b) for a, b in zip(trained.state_dict().values(), one.state_dict().values()))


def test_replan_moves_the_live_state_through_ddp_fsdp_tp_pp_and_offload_and_trains_on_as_before():
    batches = _batches()
    losses = []
    with nbtrain.Session(zoo.qwen2(), plan="dp_replicate=2", num_processes=2) as session:
        for plan in ["dp_shard=2", "tp=2", "pp=2 mb=2", "dp_replicate=2 offload=1"]:
            losses += session.fit(batches, steps=2, progress=False).losses
            assert str(session.replan(plan)).startswith(plan.split(" offload")[0].split(" mb")[0][:2])
        losses += session.fit(batches, steps=2, progress=False).losses
    whole = nbtrain.fit(zoo.qwen2(), batches, plan="dp_replicate=2", steps=10, num_processes=2, progress=False)
    assert losses == pytest.approx(whole.losses, rel=1e-6)


def _greedy(model: torch.nn.Module, prompt: list[list[int]], new: int) -> list[list[int]]:
    """One process's greedy tokens: the whole prefix through the model, the largest logit, again."""
    x = torch.tensor(prompt)
    model.eval()
    with torch.no_grad():
        for _ in range(new):
            x = torch.cat([x, model(x, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return x.tolist()


@pytest.mark.parametrize("plan", ["dp_shard=2", "tp=2"])
def test_generate_under_the_plan_gives_the_one_process_models_tokens(plan):
    prompt = [[5, 9, 2, 7], [1, 3, 3, 8]]
    with nbtrain.Session(zoo.qwen2(), plan=plan, num_processes=2) as session:
        session.fit(_batches(), steps=3, lr=1e-2, progress=False)
        tokens = session.generate(prompt, max_new_tokens=6).tolist()
        model = session.weights()
        with pytest.raises(SessionError, match="pipeline stages"):
            session.replan("pp=2 mb=2")
            session.generate(prompt, max_new_tokens=2)
    assert tokens == _greedy(model, prompt, 6)
    assert tokens[0][:4] == prompt[0]


@pytest.fixture
def ctrl_c_interrupts():
    """Python's own SIGINT handler, as a kernel has it: a shell that starts pytest in the background (``cmd &``)
    starts it with SIGINT ignored, and the stop button's signal would then never arrive."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_an_interrupted_call_stops_after_a_step_and_the_session_trains_on(ctrl_c_interrupts):
    batches = _batches(4)
    with nbtrain.Session(zoo.qwen2(), plan="dp_shard=2", num_processes=2) as session:
        running = _ours()
        threading.Timer(2.0, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
        stopped = session.fit(batches, steps=100_000, progress=False)  # what the stop button sends the kernel
        assert 0 < len(stopped.records) < 100_000 and session.alive
        assert session.steps_done == len(stopped.records)
        session.fit(batches, steps=2, progress=False)
        assert session.steps_done == len(stopped.records) + 2 and _ours() == running


def test_a_worker_that_dies_ends_the_session_naming_the_rank_and_leaves_no_process():
    before = _ours()
    session = nbtrain.Session(zoo.qwen2(), plan="dp_shard=2", num_processes=2)
    workers = sorted(_ours() - before)
    threading.Timer(1.0, lambda: psutil.Process(workers[-1]).kill()).start()
    with pytest.raises(WorkerError, match=r"rank \d of 2 died with signal SIGKILL"):
        session.fit(_batches(4), steps=100_000, progress=False)
    assert not session.alive
    with pytest.raises(SessionError, match="this session is closed"):
        session.fit(_batches(4), steps=1)
    time.sleep(1)
    assert _ours() == before


def test_garbage_collection_the_notebooks_exit_and_its_death_end_every_worker():
    import gc

    before = _ours()
    session = nbtrain.Session(zoo.qwen2(), plan="dp_shard=2", num_processes=2)
    assert len(_ours() - before) == 3  # the host and two workers
    del session
    gc.collect()
    time.sleep(2)
    assert _ours() == before
    script = ("import os, signal, sys, psutil, nbtrain, tests.any_models as zoo\n"
              "s = nbtrain.Session(zoo.qwen2(), plan='dp_shard=2', num_processes=2)\n"
              "print(' '.join(str(p.pid) for p in psutil.Process().children(recursive=True)), flush=True)\n"
              "if sys.argv[1] == 'kill': os.kill(os.getpid(), signal.SIGKILL)\n")
    for how in ("exit", "kill"):  # exit() without close(); a kernel killed outright (a restart)
        out = subprocess.run([sys.executable, "-c", script, how], capture_output=True, text=True, cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120).stdout
        pids = [int(p) for p in out.split()[-3:]]
        time.sleep(3)
        assert len(pids) == 3 and not [p for p in pids if psutil.pid_exists(p) and
                                       psutil.Process(p).status() != psutil.STATUS_ZOMBIE], how


def test_no_one_else_gets_in_every_socket_is_on_loopback_and_nothing_unpickles_a_strangers_bytes():
    batches = _batches(4)
    marker = Path(tempfile.mkdtemp()) / "unpickled"

    class Payload:
        def __reduce__(self):  # unpickling it would create the marker file
            return (open, (str(marker), "w"))

    with nbtrain.Session(zoo.qwen2(), plan="dp_shard=2", num_processes=2) as session:
        session.fit(batches, steps=1, progress=False)
        pids = {os.getpid()} | _ours()
        listening = [c for c in psutil.net_connections(kind="all") if c.pid in pids and c.status == psutil.CONN_LISTEN]
        assert listening and all(c.laddr.ip == "127.0.0.1" for c in listening), listening
        assert not [c for c in psutil.net_connections(kind="unix") if c.pid in pids and c.laddr and not c.raddr
                    and c.status == psutil.CONN_LISTEN]  # the notebook and its workers talk through pipes
        payload = pickle.dumps(Payload())
        for c in listening:  # a stranger on this machine, on every port it can find
            with socket.create_connection((c.laddr.ip, c.laddr.port), timeout=2) as sock:
                sock.sendall(len(payload).to_bytes(8, "little") + payload)
        time.sleep(0.5)
        assert not marker.exists()
        assert len(session.fit(batches, steps=2, progress=False).losses) == 2  # and the session is unharmed


def test_save_gives_a_checkpoint_fit_resumes_as_the_session_goes_on(tmp_path):
    batches = _batches()
    with nbtrain.Session(zoo.qwen2(), plan="dp_shard=2", num_processes=2) as session:
        session.fit(batches, steps=4, progress=False)
        session.save(tmp_path / "ckpt")
        on = session.fit(batches, steps=3, progress=False).losses
        session.save_pretrained(tmp_path / "hf")
        model = session.weights()
    resumed = nbtrain.fit(zoo.qwen2(), batches, plan="tp=2", steps=7, num_processes=2, progress=False,
                          checkpoint_dir=tmp_path / "ckpt", resume=True)
    assert resumed.losses[-3:] == pytest.approx(on, rel=1e-5)
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))


def test_what_a_session_refuses_it_refuses_in_the_notebook_and_goes_on():
    with nbtrain.Session(zoo.qwen2(), plan="dp_shard=2", num_processes=2) as session:
        with pytest.raises(InvalidArgumentError, match="a session takes batches as a list"):
            session.fit(lambda step: _batches(1)[0], steps=1)
        with pytest.raises(InvalidPlanError, match="does not divide the 2 devices"):
            session.replan("dp_shard=4")
        with pytest.raises(InvalidPlanError, match="a session keeps its processes"):
            session.replan(nbtrain.Plan.parse("dp_shard=4", num_devices=4, num_layers=4))
        with pytest.raises(InvalidArgumentError, match="steps must be a positive integer"):
            session.fit(_batches(), steps=0)
        with pytest.raises(SessionError, match="NonFiniteLossError"):  # every rank stops before that step's update
            session.fit(_batches(), steps=2, lr=1e12, progress=False)
        assert session.alive
