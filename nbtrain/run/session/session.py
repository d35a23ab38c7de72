"""A training session that lives in the notebook: the workers start once and keep the model between cells.

    >>> s = nbtrain.Session(model, plan="dp_shard=2", num_processes=2)     # workers start, the model is sharded
    >>> s.fit(batches, steps=100, lr=3e-4)          # trains on: step 1-100
    >>> s.fit(batches, steps=50, lr=1e-4)           # steps 101-150, at the new learning rate
    >>> s.evaluate(held_out)                        # the held-out loss under the plan
    >>> s.generate([[1, 2, 3]], max_new_tokens=8)   # greedy (or temperature=, top_k=)
    >>> s.replan("tp=2")                            # the live weights and AdamW state, under another plan
    >>> s.save("runs/x")                            # a checkpoint fit(..., checkpoint_dir="runs/x", resume=True) reads
    >>> s.weights()                                 # the trained weights into the notebook's model
    >>> s.close()                                   # or `with nbtrain.Session(...) as s:`

``fit`` each time forks workers, builds and fills the model, trains and gathers it back; a session does the first
once, and keeps the parallelized model, its optimizer state, the step count, the learning-rate schedule and the RNG
in its workers. Two ``fit(steps=5)`` calls give what one ``fit(steps=10)`` gives. The batches of a call are read for
the steps it takes, by the session's step: ``data`` a list is indexed from the step the session is at (the data
position counts on, as the schedule does). Data defined in a later cell reaches the workers without a relaunch: the
notebook checks it, writes the batches for the call's steps once into the session's private folder, and every rank
maps them (:mod:`nbtrain.run.session.channel`: ``/dev/shm``, so at most its size; batches as tensors, tuples, lists
and dicts). Functions (a loss, a schedule) are the session's from its start: one defined later does not exist in its
workers, forked before.

An interrupted cell (Jupyter's stop button) asks the workers to stop after the step they are in, all at the same
step; the call returns what ran and the session stays usable. A worker that dies ends the session with
:class:`~nbtrain.errors.WorkerError` naming the rank, the others stopped. The workers end with :meth:`close`, when the
session is garbage-collected, and when the notebook's process ends (kernel restart, ``exit()``). No one else gets
in: the notebook and its workers talk through pipes made before the workers were forked, and no socket but the
process group's own (on 127.0.0.1) is opened.
"""

from __future__ import annotations

import pickle
import sys
import time
import weakref
from multiprocessing.connection import wait

import torch
from torch import nn

from nbtrain.checks import positive_int
from nbtrain.errors import InvalidArgumentError, LaunchError, NbtrainError
from nbtrain.planner.plan import Plan
from nbtrain.profiler.model import lm_loss
from nbtrain.run.fit_result import FitResult
from nbtrain.run.options import Checkpointing, Documents, Evaluation, ModelFiles, Optimizer, options
from nbtrain.run.session.channel import Channel, open_channel
from nbtrain.run.session.host import start_host


class SessionError(NbtrainError):
    """A session call every worker refused (the session goes on), or a call on a closed session."""


_OPEN: "weakref.WeakSet[Session]" = weakref.WeakSet()
"""The sessions of this process: one at a time by default, as the cores are one machine's."""


class Session:
    """Workers that keep ``model`` under ``plan`` between calls (module docstring). ``plan``: a :class:`Plan` or its
    compact form; ``num_processes``: the plan's devices by default. The rest is ``fit``'s, in its groups
    (:mod:`nbtrain.run.options`): ``optimizer=Optimizer(...)`` (or ``lr=``, ``lr_schedule=``, ``clip_norm=``, ...),
    ``files=ModelFiles(weights=, init_fn=)`` (or ``weights=``: a folder, or ``[base, adapters]``), ``tp_plan``,
    ``loss_fn``, ``precision``, ``seed``; ``timeout`` bounds each call (seconds). One session is open
    at a time: a second is refused until the first is closed, unless ``alongside=True``."""

    def __init__(self, model: nn.Module, plan: Plan | str, *, num_processes: int | None = None,
                 optimizer: Optimizer | None = None, files: ModelFiles | None = None, loss_fn=lm_loss,
                 precision: str = "fp32", seed: int = 0, tp_plan: dict | None = None, timeout: float | None = None,
                 alongside: bool = False, **shorthand):
        from nbtrain.run.session.setup import session_settings

        o = options(optimizer=optimizer, files=files, **shorthand)
        if o.checkpointing != Checkpointing() or o.evaluation != Evaluation() or o.documents != Documents() or \
                o.files.save_pretrained or o.files.save_merged or o.files.save_dir or o.optimizer.factory:
            raise InvalidArgumentError("a session takes the optimizer's options and where its weights start "
                                       "(weights=, init_fn=) when it starts; evaluation goes to each call "
                                       "(s.fit(..., eval_data=) or s.evaluate), saving to s.save, "
                                       "s.save_pretrained")
        opt = o.optimizer
        weights, init_fn, lr = o.files.weights, o.files.init_fn, opt.lr
        other = next((s for s in list(_OPEN) if s.alive), None)
        if other is not None and not alongside:
            raise SessionError(f"a session is open already ({other.summary()}); close it first (its .close()), or "
                               "start this one with Session(..., alongside=True): both then share this machine")
        if not isinstance(model, nn.Module):
            raise InvalidArgumentError(f"Session takes the model to train, an nn.Module, not a "
                                       f"{type(model).__name__}: nbtrain.Session(model, plan='dp_shard=2')")
        self.model, self.timeout, self.tp_plan = model, timeout, tp_plan
        self.plan, run, self.num_processes = session_settings(
            model, plan, num_processes, weights=weights, tp_plan=tp_plan, loss_fn=loss_fn, precision=precision,
            seed=seed, lr=lr, lr_schedule=opt.schedule, clip_norm=opt.clip_norm, betas=opt.betas, eps=opt.eps,
            weight_decay=opt.weight_decay, init_fn=init_fn)
        self.loss_fn, self.lr, self.steps_done, self.records = loss_fn, lr, 0, []
        self._channel: Channel | None = open_channel(self.num_processes)
        self._host = start_host(model, self.plan, run, self._channel, self.num_processes)
        for conn in self._channel.worker_ends:  # the workers' ends are theirs (the host holds them for them)
            conn.close()
        self._finalizer = weakref.finalize(self, _end, self._channel, self._host)
        _OPEN.add(self)
        try:
            started = self._gather("start")
        except BaseException:
            self.close()
            raise
        self.materialized = [r["materialized"] for r in started if r] if started else []

    # -- calls -----------------------------------------------------------------------------------------------------
    def fit(self, data, *, steps: int, lr: float | None = None, evaluation: Evaluation | None = None,
            eval_data=None, eval_every: int | None = None, progress: bool = True) -> FitResult:
        """Train ``steps`` more steps on ``data`` (batches as ``fit`` takes them, read from the session's step on);
        ``lr`` is the learning rate from here on; ``eval_data``/``eval_every`` evaluate as ``fit`` does. Returns
        this call's steps as a :class:`FitResult`; an interrupted cell returns the steps that ran."""
        from nbtrain.run.session.setup import call_batches

        positive_int(steps, f"steps must be a positive integer (steps on from step {self.steps_done}), got "
                            f"{steps!r}")
        if lr is not None and not (isinstance(lr, (int, float)) and lr > 0):
            raise InvalidArgumentError(f"lr must be a positive number, got {lr!r}")
        held = options(evaluation=evaluation, eval_data=eval_data, eval_every=eval_every).evaluation
        self.plan, batches, evaluation, every = call_batches(self, data, steps, held.data, held.every)
        arguments = dict(batches=self._post(batches), start=self.steps_done, steps=steps, lr=lr,
                         evaluation=self._post(evaluation) if evaluation else None, every=every, progress=progress)
        answer = self._call("fit", **arguments)
        records = answer["records"]
        self.steps_done = answer["steps_done"]
        self.records += records
        if answer["error"]:
            raise SessionError(f"{answer['error']} (the session goes on at step {self.steps_done}: the step that "
                               "failed made no update)")
        if lr is not None:
            self.lr = lr
        if answer["stopped"]:
            print(f"stopped after step {self.steps_done} (the session goes on: s.fit(...) trains on from there)",
                  file=sys.stderr)
        return FitResult(self.plan, records, None, None, {}, None, None, rank_memory=answer["peaks"])

    def evaluate(self, data) -> float:
        """The mean loss of held-out batches under the session's plan, as ``fit``'s ``eval_data`` is evaluated."""
        from nbtrain.run.session.setup import held_out_set

        return self._call("evaluate", evaluation=self._post(held_out_set(self, data)))

    def generate(self, ids, *, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
                 seed: int = 0) -> torch.Tensor:
        """``ids`` (a tensor or lists of token ids, rows as long) with ``max_new_tokens`` more tokens each, generated
        by the model as the plan holds it: greedy, or sampled at ``temperature`` among the ``top_k`` likeliest
        (:mod:`nbtrain.run.generation`)."""
        from nbtrain.run.generation import generation_problem

        positive_int(max_new_tokens, f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        rows = ids.tolist() if isinstance(ids, torch.Tensor) else [list(map(int, row)) for row in ids]
        if not rows or any(len(row) != len(rows[0]) or not row for row in rows) or \
                not all(isinstance(t, int) for row in rows for t in row):
            raise InvalidArgumentError("ids must be rows of token ids, all as long (a 2-D tensor, or a list of lists "
                                       "of ints)")
        problem = generation_problem(self.plan)
        if problem:
            raise SessionError(problem)
        out = self._call("generate", prompts=rows, max_new_tokens=max_new_tokens, temperature=float(temperature),
                         top_k=top_k, seed=seed)
        return torch.tensor(out)

    def replan(self, plan: Plan | str) -> Plan:
        """Move the live model and its optimizer state to ``plan`` (the same processes), and train on from there."""
        from nbtrain.run.session.setup import checked_plan

        new = checked_plan(self, plan)
        self.materialized = [r["materialized"] for r in self._gather("replan", plan=new) if r]
        self.plan = new
        return new

    def save(self, folder) -> str:
        """A checkpoint of the live state in ``folder``, as ``fit(..., checkpoint_dir=folder, resume=True)`` reads it
        (under any plan); returns the checkpoint's path."""
        from pathlib import Path

        return self._call("save", folder=str(Path(folder).expanduser().resolve()))

    def save_pretrained(self, folder) -> str:
        """The trained model as a Hugging Face folder (``from_pretrained`` loads it), or a peft model's adapter
        folder (``PeftModel.from_pretrained`` loads it), as ``fit(save_pretrained=)`` writes them."""
        from nbtrain.models.lora import is_peft
        from nbtrain.run.state.adapter_folder import check_adapter_folder, write_adapters
        from nbtrain.run.state.hf_folder import check_folder, file_of_each_tensor

        if is_peft(self.model):
            path = check_adapter_folder(self.model, folder)
            self.weights()
            write_adapters(self.model, path)
            return path
        path = check_folder(folder)
        return self._call("save_pretrained", folder=path, files=file_of_each_tensor(self.model))

    def weights(self) -> nn.Module:
        """The session's trained weights into the notebook's model (which it returns)."""
        from nbtrain.run.state.weights import load_trained

        state = self._call("weights")
        if state is not None:
            load_trained(self.model, state)
        return self.model

    def close(self) -> None:
        """End the workers (and free their ports, memory and files); the session cannot be used after."""
        self._finalizer()
        self._channel = None

    @property
    def alive(self) -> bool:
        return self._channel is not None and self._host.is_alive()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- showing it ------------------------------------------------------------------------------------------------
    def summary(self) -> str:
        state = "open" if self.alive else "closed"
        last = f", last loss {self.records[-1].loss:.4f}" if self.records else ""
        return f"session ({state}): {self.plan} on {self.num_processes} processes, {self.steps_done} steps{last}"

    def __repr__(self) -> str:
        return self.summary()

    def _repr_html_(self) -> str:
        from nbtrain.run.session.view import session_html

        return session_html(self)

    # -- the channel -----------------------------------------------------------------------------------------------
    def _post(self, obj) -> str:
        self._check_open()
        return self._channel.post(obj)

    def _check_open(self) -> None:
        if self._channel is None:
            raise SessionError("this session is closed; start a new one: nbtrain.Session(model, plan=...)")
        if not self._host.is_alive():
            self._ended()

    def _call(self, kind: str, **arguments):
        return self._gather(kind, **arguments)[0]

    def _gather(self, kind: str, **arguments) -> list:
        """Send ``kind`` to every rank and wait for every answer; rank 0's result first in the list."""
        self._check_open()
        channel = self._channel
        if kind != "start":
            channel.stop.value = 0
            for rank in range(self.num_processes):
                channel.send(rank, (kind, arguments))
        answers: dict[int, tuple] = {}
        waiting = dict(enumerate(channel.kernel_ends))
        started = time.monotonic()
        try:
            while waiting:
                try:
                    ready = wait([*waiting.values(), channel.host_in], timeout=1.0)
                except KeyboardInterrupt:
                    channel.stop.value = 1  # the workers stop after the step they are in, all at the same step
                    print("interrupted: the session stops after the current step", file=sys.stderr)
                    continue
                if channel.host_in in ready and not any(c in ready for c in waiting.values()):
                    self._ended()
                for rank, conn in list(waiting.items()):
                    if conn in ready:
                        try:
                            answers[rank] = pickle.loads(conn.recv_bytes())
                        except (EOFError, OSError):
                            self._ended()
                        del waiting[rank]
                if self.timeout and time.monotonic() - started > self.timeout:
                    self.close()
                    raise LaunchError(f"the session's {kind} took more than {self.timeout:g} s; the session was "
                                      "closed (its workers stopped)")
        finally:
            channel.clear()
        refused = [a[1] for a in answers.values() if a[0] != "ok"]
        if refused:
            raise SessionError(f"the session's workers refused {kind}: {refused[0]} (the session goes on)")
        return [answers[rank][1] for rank in sorted(answers)]

    def _ended(self):
        """The host reported the launch's end: the session is over; raise what ended it."""
        outcome = None
        if self._channel is not None and self._channel.host_in.poll(5):
            try:
                outcome = pickle.loads(self._channel.host_in.recv_bytes())
            except (EOFError, OSError):
                outcome = None
        self.close()
        if outcome and outcome[0] == "failed":
            raise outcome[1]
        raise LaunchError("the session's workers ended (their host process is gone); start a new session")


def _end(channel: Channel, host) -> None:
    """Close a session: ask every rank to close, wait for the host, kill what is left (also at garbage collection
    and at the notebook's exit)."""
    for rank in range(len(channel.kernel_ends)):
        try:
            channel.send(rank, ("close", {}))
        except (OSError, ValueError):
            pass
    host.join(timeout=30)
    if host.is_alive():
        host.kill()
        host.join(timeout=10)
    channel.close()
