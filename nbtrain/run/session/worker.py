"""What each worker of a session does: build its part of the model once, then answer the notebook's calls.

    launch(session_worker, model, plan, settings, channel, num_processes=2)   # in the session's host process

A worker parallelizes its twin of the model and makes its optimizer and trainer as ``fit``'s workers do
(:func:`~nbtrain.run.fit_worker.prepare`), then waits on its pipe. Every call reaches every rank, and every rank runs
it (they are collective); rank 0 answers with the result, the others with an acknowledgement. A call every rank
refuses alike before any collective (a command that will not unpickle, a ``NonFiniteLossError`` all ranks raise at
the same step, a plan that cannot generate) is answered as an error and the session goes on; any other exception
ends this worker, and the launch then reports the rank (the session ends with ``WorkerError``). End-of-file on the
pipe (the notebook's process is gone) ends the worker quietly.

The commands: ``fit`` (steps on from where the session is, step ``k`` on item ``k mod len`` of the batches the
notebook posted, as ``fit`` goes through a list, a new learning rate applied first, stopping early when the notebook
asks), ``evaluate``, ``generate``, ``replan``
(the live weights, AdamW state, step count, schedule and RNG saved to the session's private folder as a checkpoint
and read back under the new plan: :mod:`nbtrain.run.state.checkpoint`'s resume under another plan), ``save`` (a
checkpoint ``fit(resume=True)`` reads), ``save_pretrained``, ``weights`` (gathered to rank 0) and ``close``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import os
import pickle
import shutil
import signal
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from nbtrain.errors import InvalidPlanError, NonFiniteLossError
from nbtrain.planner.plan import Plan
from nbtrain.run.evaluation import EvalSet
from nbtrain.run.fit_worker import Prepared, RunSettings, gathered, prepare, rank_peaks, train_steps
from nbtrain.run.generation import generate
from nbtrain.run.session.channel import Channel, fetch, receive
from nbtrain.run.state.checkpoint import CheckpointFolder, Progress
from nbtrain.run.state.training_state import TrainingState


@dataclass
class Live:
    """One worker's session: the notebook's model as it was when the workers were forked (what a replan fills the
    new plan's twin from, before the checkpoint overwrites it), the run's settings, and its part of the model."""

    source: nn.Module
    run: RunSettings
    ready: Prepared
    records: list

    @property
    def state(self) -> TrainingState:
        return TrainingState(self.ready.model, self.ready.optimizer, self.ready.mine)

    def settle(self) -> None:
        """An offloaded optimizer's last CPU updates landed in the weights (before they are read or saved)."""
        if hasattr(self.ready.optimizer, "synchronize"):
            self.ready.optimizer.synchronize()


class Refused(Exception):
    """A call every rank refuses alike, before any collective: answered as an error, the session goes on."""


def session_worker(model: nn.Module, plan: Plan, run: RunSettings, channel: Channel) -> None:
    """Every rank: build, then answer calls until ``close`` or end-of-file (module docstring)."""
    rank = dist.get_rank()
    conn = channel.worker_end(rank)
    _die_with_parent()
    live = Live(model, run, prepare(model, plan, run), [])
    conn.send_bytes(pickle.dumps(("ok", {"materialized": live.ready.materialized})))
    while True:
        blob = receive(conn)
        if blob is None:  # the notebook is gone
            return
        try:
            kind, arguments = pickle.loads(blob)
            command = COMMANDS[kind]
        except Exception as error:  # every rank got the same bytes and fails alike
            conn.send_bytes(pickle.dumps(("refused", f"{type(error).__name__}: {error}")))
            continue
        if kind == "close":
            if hasattr(live.ready.optimizer, "close"):
                live.ready.optimizer.close()
            conn.send_bytes(pickle.dumps(("ok", None)))
            return
        try:
            result = command(live, channel, **arguments)
        except (Refused, NonFiniteLossError, InvalidPlanError) as error:
            conn.send_bytes(pickle.dumps(("refused", f"{type(error).__name__}: {error}")))
            continue
        except BaseException:
            conn.send_bytes(pickle.dumps(("failed", traceback.format_exc())))
            raise
        conn.send_bytes(pickle.dumps(("ok", result if rank == 0 else None)))


def _die_with_parent() -> None:
    """Linux: this worker gets SIGKILL when its parent (the session's host) dies, whatever killed it."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


# -- the commands ------------------------------------------------------------------------------------------------

def _fit(live: Live, channel: Channel, *, batches: str, start: int, steps: int, lr: float | None,
         evaluation: str | None, every: int | None, progress: bool) -> dict:
    if live.ready.trainer.steps_done != start:  # the notebook's count and the workers' agree, or nothing runs
        raise Refused(f"the session's workers are at step {live.ready.trainer.steps_done}, not {start}")
    data = fetch(batches)
    held = fetch(evaluation) if evaluation else None
    if lr is not None and lr != live.run.lr:
        _set_lr(live, lr)
    run = dataclasses.replace(live.run, steps=start + steps, progress=progress, resume_from=None,
                              checkpoint_dir=None, checkpoint_every=None,
                              evaluation=EvalSet(held["batches"], held["weights"], every) if held else None)
    try:
        records = train_steps(live.ready.trainer, live.state, live.ready.plan, lambda step: data[step % len(data)],
                              run, dist.get_rank() == 0, stop=channel.stopping)
        error = None
    except NonFiniteLossError as stopped:  # every rank, at the same step, before its update: the session goes on
        records, error = [], f"{type(stopped).__name__}: {stopped}"
    live.settle()
    live.records += records
    return {"records": records, "peaks": rank_peaks(live.ready, records), "stopped": channel.stopping(),
            "steps_done": live.ready.trainer.steps_done, "error": error}


def _set_lr(live: Live, lr: float) -> None:
    """A new learning rate from here on: the optimizer's, and the base the schedule multiplies."""
    optimizer, scheduler = live.ready.optimizer, live.ready.trainer.scheduler
    groups = getattr(optimizer, "param_groups", None) or []
    for group in groups:
        group["lr"] = lr * (scheduler.lr_lambdas[0](scheduler.last_epoch) if scheduler is not None else 1.0)
    if scheduler is not None:
        scheduler.base_lrs = [lr] * len(scheduler.base_lrs)
    if hasattr(optimizer, "set_lr"):  # the offloaded AdamW holds its own
        optimizer.set_lr(lr)
    live.run = dataclasses.replace(live.run, lr=lr)


def _evaluate(live: Live, channel: Channel, *, evaluation: str) -> float:
    held = fetch(evaluation)
    return live.ready.trainer.evaluate(held["batches"], held["weights"])


def _generate(live: Live, channel: Channel, **arguments) -> list | None:
    return generate(live.ready.trainer, **arguments)


def _replan(live: Live, channel: Channel, *, plan: Plan) -> dict:
    """The live state moved to ``plan``: saved as a checkpoint in the session's folder, read back under it."""
    live.settle()
    trainer = live.ready.trainer
    folder = CheckpointFolder(Path(channel.folder) / f"replan-{trainer.steps_done}", keep=1)
    progress = Progress(trainer.steps_done, trainer.schedule_epoch, plan=str(live.ready.plan),
                        num_processes=dist.get_world_size(), **Progress.random_states())
    saved = folder.save(live.state, progress)
    if hasattr(live.ready.optimizer, "close"):
        live.ready.optimizer.close()
    live.ready = None  # the old plan's model and optimizer go before the new one is allocated
    gc.collect()
    live.ready = prepare(live.source, plan, live.run)
    progress = saved.load(live.state)
    live.ready.trainer.restore_progress(progress.step, progress.schedule_epoch)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(folder.path, ignore_errors=True)
    return {"materialized": live.ready.materialized}


def _save(live: Live, channel: Channel, *, folder: str) -> str:
    live.settle()
    trainer = live.ready.trainer
    progress = Progress(trainer.steps_done, trainer.schedule_epoch, records=live.records,
                        plan=str(live.ready.plan), num_processes=dist.get_world_size(), **Progress.random_states())
    return str(CheckpointFolder(folder).save(live.state, progress).path)


def _save_pretrained(live: Live, channel: Channel, *, folder: str, files: dict) -> str:
    from nbtrain.run.state.hf_folder import save_hf_folder

    live.settle()
    save_hf_folder(live.ready.model, live.ready.mine, folder, files)
    return folder


def _weights(live: Live, channel: Channel) -> dict | None:
    live.settle()
    return gathered(live.ready)


COMMANDS = {"fit": _fit, "evaluate": _evaluate, "generate": _generate, "replan": _replan, "save": _save,
            "save_pretrained": _save_pretrained, "weights": _weights, "close": None}
