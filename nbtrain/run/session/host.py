"""The process a session's workers live under, so that the notebook's own process stays as it was.

    host = start_host(model, plan, settings, channel, num_processes=2)   # returns at once; the workers build

``launch`` (accelerate's launcher, torch elastic's agent) sets the launching process's environment, temporary folder
and signal handlers for as long as the launch runs, which for a session is hours. So the notebook forks one host
process, and the host launches the workers and waits for them in its main thread, as ``fit``'s launch does in the
notebook's: the notebook's environment, ``tempfile`` folder, stdout and signal handlers are never touched, and the
kernel runs cells meanwhile. The host has a process group of its own, so the notebook's interrupt (Jupyter signals
the kernel's process group) does not reach it or the workers: an interrupted cell asks the workers to stop through
the channel instead, and the session goes on. The host dies with the notebook's process (``PR_SET_PDEATHSIG``: the
agent's SIGTERM handler then ends the workers, which also die with it), and reports how the launch ended on its
pipe: ``("ended", None)``, or ``("failed", error)`` with the launch's own error (``WorkerError`` naming the rank).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import pickle
import signal

from torch import nn

from nbtrain.planner.plan import Plan
from nbtrain.run.fit_worker import RunSettings
from nbtrain.run.session.channel import Channel


def start_host(model: nn.Module, plan: Plan, run: RunSettings, channel: Channel, num_processes: int,
               timeout: float | None = None):
    """Fork the host and return its process; it launches ``num_processes`` workers (module docstring)."""
    process = multiprocessing.get_context("fork").Process(
        target=_host, args=(model, plan, run, channel, num_processes, timeout), daemon=False, name="nbtrain-session")
    process.start()
    return process


def _host(model, plan, run, channel: Channel, num_processes: int, timeout) -> None:
    from nbtrain.run.launch.workers import launch
    from nbtrain.run.session.worker import session_worker

    os.setpgrp()  # the notebook's interrupt is for the notebook: the session stops through its channel
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: end with the notebook's process
    except (OSError, AttributeError):
        pass
    for conn in [*channel.kernel_ends, channel.host_in]:  # the notebook's ends: only the notebook holds them
        conn.close()
    try:
        launch(session_worker, model, plan, run, channel, num_processes=num_processes, timeout=timeout)
        outcome = ("ended", None)
    except BaseException as error:  # noqa: BLE001 — whatever ended the launch is the session's end, reported
        try:
            pickle.dumps(error)
            outcome = ("failed", error)
        except Exception:
            outcome = ("failed", RuntimeError(f"{type(error).__name__}: {error}"))
    try:
        channel.host_out.send_bytes(pickle.dumps(outcome))
    finally:
        os._exit(0)  # not the notebook's atexit handlers, which this forked copy holds too
