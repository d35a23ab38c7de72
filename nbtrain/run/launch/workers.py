"""Run a function in worker processes that share one ``torch.distributed`` process group; get rank 0's result.

    >>> from nbtrain.run.launch.workers import launch, rank_print
    >>> def sum_of_ranks():
    ...     import torch, torch.distributed as dist
    ...     t = torch.tensor([dist.get_rank()])
    ...     dist.all_reduce(t)                   # gloo on CPU, nccl on GPUs: the group is already there
    ...     rank_print("sum of ranks", int(t))   # "[rank 0] sum of ranks 1" and "[rank 1] sum of ranks 1"
    ...     return int(t)
    >>> launch(sum_of_ranks, num_processes=2, timeout=60)
    Launching 2 workers on ...
    1

Workers are forked by accelerate's ``notebook_launcher`` (torch's elastic agent underneath), so a function defined
in a notebook cell runs as is and nothing is imported again (~1 s to start two workers, not ~5 s each).

The same user code runs on several nodes from a shell: under ``torchrun --nproc-per-node 8 train.py`` or
``accelerate launch train.py`` each process already has ``RANK``/``WORLD_SIZE`` set, and ``launch`` then calls the
function in that process (initialising the group if needed) instead of forking; ``num_processes`` is ignored and
each rank gets its own return value.

A launch that runs past its ``timeout`` asks every worker where it was before killing it (``faulthandler`` dumps
each worker's stacks on SIGUSR1, even while it is blocked inside gloo), and the error names the rank that never
reached the collective the others wait in: see :mod:`nbtrain.run.launch.stacks`.
"""

from __future__ import annotations

import datetime
import errno
import faulthandler
import multiprocessing
import os
import pickle
import signal
import sys
import tempfile
import threading
import time
import traceback
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any, Callable

from nbtrain.checks import positive_int
from nbtrain.errors import InvalidArgumentError, LaunchError
from nbtrain.files import write_whole
from nbtrain.run.launch.environment import (SIGNALS, check_cuda_not_initialised, check_limit, cpu_env, free_port,
                                             launch_env, launch_folder, loopback_env, port_is_free, visible_gpus)
from nbtrain.run.launch.failures import (ChildWatcher, dump_stacks, exit_status, timeout_error, worker_error,
                                         worker_processes, write_exit_report)
from nbtrain.run.launch.group_release import release_process_groups

_PG_TIMEOUT = datetime.timedelta(minutes=30)  # torch's own default, used when no timeout is given
_FORK_WAIT_S = 600  # how long a forked rank waits for the agent to fork the others
# Forked workers' collectives time out this much after the launch's own timer fires: the parent then asks every rank
# where it was and names the one that hung. Were they equal, gloo would often fail first, on the rank that waited.
_PG_MARGIN_S = 30


def launch(fn: Callable[..., Any], *args: Any, num_processes: int = 2, port: int | None = None,
           timeout: float | None = None, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` on ``num_processes`` ranks of one process group; return rank 0's return value.

    ``launch(train, model_cfg, num_processes=4, timeout=600, steps=10)`` forks four workers, each with
    ``torch.distributed`` initialised (gloo without a GPU, nccl on one GPU per rank), runs ``train(model_cfg,
    steps=10)`` in each, and returns what rank 0 returned (it must pickle). ``num_processes=1`` runs ``fn`` in
    this process in a one-rank group, so ``%debug`` works. ``port`` is the rendezvous port (a free one by default),
    listened on at 127.0.0.1 only, as gloo's and NCCL's own sockets are: nothing outside this machine can reach the
    run. ``timeout`` (seconds) bounds the whole run. Forked workers' collectives time out 30 s later (``timeout +
    30``), so that a hang is reported by the launch, which names the rank that hung, rather than by gloo on a rank
    that waited for it; in one process, and under torchrun, every collective times out after ``timeout``.

    A worker that raises stops all workers and raises :class:`WorkerError` naming the rank, with its traceback;
    past ``timeout`` each worker's stacks are dumped, the workers are killed and :class:`LaunchTimeoutError` is
    raised, saying where each rank was and which one the others waited for (``error.ranks`` holds a
    :class:`~nbtrain.run.launch.stacks.RankStack` per rank); Ctrl-C stops the workers and re-raises ``KeyboardInterrupt``.
    In every case no worker process is left behind, nor any file or folder the launch made (torch elastic's logs
    included), and the kernel lives on. Forked workers cannot use CUDA once this process has initialised it: then
    :class:`CudaInitializedError` says what holds tensors on a GPU, before any worker is started. ``sys.exit()``,
    ``sys.exit(0)`` or ``sys.exit(None)`` in ``fn`` (a script ending in ``sys.exit(main())``) is a rank that finished,
    returning None; ``sys.exit(N)`` with N not 0 is a failure of that rank: :class:`WorkerError` names it with its
    exit status.
    """
    if not callable(fn):
        raise InvalidArgumentError(f"launch needs a function to run, got {type(fn).__name__}: launch(train, ...)")
    positive_int(num_processes, f"num_processes must be a positive int, got {num_processes!r}; "
                                "e.g. launch(fn, num_processes=2)")
    if timeout is not None and not timeout > 0:
        raise InvalidArgumentError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
    pg_timeout = datetime.timedelta(seconds=timeout) if timeout else _PG_TIMEOUT
    if launched_externally():  # already a torchrun / accelerate launch worker
        with cpu_env(visible_gpus() == 0):
            return _run_in_group(fn, args, kwargs, int(os.environ["WORLD_SIZE"]), pg_timeout, exits_normally=True)

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():  # forked workers would inherit it and never form their own
        raise LaunchError(f"this process already has a process group (world size {dist.get_world_size()}); "
                          "call torch.distributed.destroy_process_group() first, or restart the kernel")
    if num_processes > 1:  # forked workers start from a copy of this process, its CUDA state included
        check_cuda_not_initialised(fn, args, kwargs)
    gpus = visible_gpus()
    check_limit(num_processes, gpus)
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536):
        raise InvalidArgumentError(f"port must be an int in 1..65535 or None (pick a free one), got {port!r}")
    if port is not None and not port_is_free(port):
        raise InvalidArgumentError(f"port {port} is in use; pass another, or port=None to pick a free one")
    if num_processes == 1:
        with cpu_env(gpus == 0), loopback_env():
            return _run_in_group(fn, args, kwargs, 1, pg_timeout, exits_normally=True)
    fork_pg_timeout = datetime.timedelta(seconds=timeout + _PG_MARGIN_S) if timeout else _PG_TIMEOUT
    return _fork_and_run(fn, args, kwargs, num_processes, port, timeout, fork_pg_timeout, gpus)


def launched_externally() -> bool:
    """Whether this process is one rank of a group started by torchrun or ``accelerate launch`` (``RANK`` and
    ``WORLD_SIZE`` are set): :func:`launch` then runs the function here, on this rank, instead of forking."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def runs_in_this_process(num_processes: int) -> bool:
    """Whether ``launch(fn, num_processes=num_processes)`` calls ``fn`` in this process (one process, or a rank
    of torchrun / ``accelerate launch``) rather than in forked workers, which start from a copy of this process."""
    return num_processes == 1 or launched_externally()


def rank_print(*args: Any, sep: str = " ", end: str = "\n", file=None) -> None:
    """``print`` with a ``[rank k]`` prefix: ``rank_print("loss", 2.31)`` prints ``[rank 1] loss 2.31``.

    The line is written in one piece and flushed, so lines of several workers in one cell interleave whole
    (``print`` writes each argument separately, and a notebook shows those pieces mixed across ranks)."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", 0))
    stream = file or sys.stdout
    stream.write(f"[rank {rank}] {sep.join(map(str, args))}{end}")
    stream.flush()


def _fork_and_run(fn, args, kwargs, num_processes, port, timeout, pg_timeout, gpus):
    # imported before launch_env, which quiets torch elastic's loggers: importing creates them
    from accelerate import notebook_launcher  # noqa: F401
    from torch.distributed.elastic.multiprocessing import api  # noqa: F401
    from torch.distributed.launcher import api as launcher_api  # noqa: F401

    before = set(multiprocessing.active_children())
    timed_out = threading.Event()
    with launch_folder() as (workdir, user_tempdir), launch_env(gpus == 0):
        worker = _Worker(fn, args, kwargs, num_processes, workdir, "nccl" if gpus else "gloo", pg_timeout,
                         user_tempdir)
        timer = threading.Timer(timeout, _dump_stacks_and_stop_workers, (before, timed_out, workdir)) \
            if timeout else None
        watcher = ChildWatcher(before)
        try:
            if timer:
                timer.start()
            error = _run_launcher(worker, num_processes, port, gpus, workdir, watcher, timer, timed_out, timeout)
        finally:
            if timer:
                timer.cancel()
            watcher.stop()
            _stop_workers(before)
        # Raised here, out of the `except` that built it: raised there, it would carry elastic's exception as its
        # context, whose frames hold the agent and its store, and the port would stay open for as long as the
        # error is kept (IPython keeps the last one).
        if error is not None:
            del worker, watcher, timer  # the error's traceback keeps this frame: not the workers' pipes with it
            raise error
        result = Path(workdir) / "result.pkl"
        if not result.exists():
            raise LaunchError("the workers finished but rank 0 left no return value")
        return pickle.loads(result.read_bytes())


def _run_launcher(worker, num_processes, port, gpus, workdir, watcher, timer, timed_out, timeout):
    """accelerate's ``notebook_launcher`` with ``worker`` on every rank; returns None, or the error to raise."""
    from accelerate import notebook_launcher
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    store = _loopback_store(port)
    try:
        print(f"Launching {num_processes} workers on {'GPUs, one each (nccl)' if gpus else 'CPU (gloo)'}"
              f" at 127.0.0.1:{store.port}", flush=True)
        with redirect_stdout(_DropBanner(sys.stdout)):
            # The agent's static rendezvous makes its TCPStore on this port with multi_tenant=True, so it serves
            # from this loopback server rather than listening on every interface (loopback_store says why); the
            # workers connect to 127.0.0.1 as its clients.
            notebook_launcher(worker, num_processes=num_processes, use_port=str(store.port))
        return None
    except ChildFailedError as failure:
        if timed_out.is_set():
            timer.join()  # the dumps are written and the workers killed
            return timeout_error(workdir, num_processes, timeout)
        return worker_error(failure, workdir, num_processes, watcher)
    except SignalException as stop:  # elastic turns Ctrl-C (and SIGTERM) into this; it has already
        if stop.sigval == signal.SIGINT:  # signalled the workers
            return KeyboardInterrupt()
        return LaunchError(f"the launch was stopped by {stop.sigval.name}")
    except ValueError as error:  # accelerate's "Accelerator already initialised" and such
        return LaunchError(str(error))
    finally:
        del store  # the port closes with the launch, not while an error raised through here is kept


def _loopback_store(port: int | None):
    """The launch's rendezvous store, listening on 127.0.0.1 only: on ``port``, or on a free port."""
    from nbtrain.profiler.calibrate import loopback_store  # torch: not when nbtrain.launch is imported

    for _ in range(1 if port else 3):
        use_port = port or free_port()
        try:
            return loopback_store(use_port)
        except OSError as error:
            if error.errno != errno.EADDRINUSE:
                raise
            # a port given is the user's to change; one found free was taken by another process since: pick again
    raise InvalidArgumentError(f"port {use_port} is in use; pass another, or port=None to pick a free one")


class _Worker:
    """What each worker runs: set up the process, run ``fn`` in the group, hand back its result or traceback."""

    def __init__(self, fn, args, kwargs, num_processes, workdir, backend, pg_timeout, user_tempdir):
        self.fn, self.args, self.kwargs, self.num_processes = fn, args, kwargs, num_processes
        self.workdir, self.backend, self.pg_timeout = Path(workdir), backend, pg_timeout
        self.user_tempdir = user_tempdir  # the parent's tempfile.tempdir before the launch made it its own folder
        self.all_forked = multiprocessing.get_context("fork").Barrier(num_processes)
        self.stdout = sys.stdout  # the cell's own stream (ipykernel forwards a forked child's writes to it)
        # elastic names the run (and its error reports) after the entrypoint's __name__/__qualname__
        self.__name__ = self.__qualname__ = getattr(fn, "__name__", type(fn).__name__)

    def __call__(self) -> None:
        import torch

        rank = int(os.environ["RANK"])
        # The user's code writes its temporary files where it always does, not in the launch's folder (removed).
        tempfile.tempdir = self.user_tempdir
        # The parent sends SIGUSR1 to a launch past its timeout. faulthandler writes the stacks from its C signal
        # handler, so a rank blocked inside gloo (which never returns to the interpreter) answers too.
        # The file gets its name once the handler is there: the parent signals only workers with one.
        self.stack_file = open(self.workdir / f"rank{rank}.stack.tmp", "w")  # kept open for the handler
        faulthandler.register(signal.SIGUSR1, file=self.stack_file, all_threads=True, chain=False)
        os.replace(self.workdir / f"rank{rank}.stack.tmp", self.workdir / f"rank{rank}-pid{os.getpid()}.stack")
        # First, before any op: if the parent ran a multi-threaded torch op before forking, its OpenMP pool is
        # gone in the child and the next multi-threaded op here would wait on it forever. One thread never uses it.
        torch.set_num_threads(1)
        sys.stdout = self.stdout  # not the banner filter the fork copied
        # The fork copied elastic's Python-level handlers, which raise only when the interpreter next runs
        # bytecode: a worker blocked inside a collective or a deadlock would ignore the agent's SIGTERM (and
        # Ctrl-C) for the agent's 30 s grace period. The OS default ends the worker at once.
        for sig in SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        try:
            # No rank talks to the agent's store before the agent has forked every rank. The store's server thread
            # in the parent resolves a connecting peer's address (getnameinfo, under glibc's resolver lock); a rank
            # forked at that moment inherits the lock held, and its own first getnameinfo waits on it forever.
            self._wait_until_all_forked(rank)
            result = _run_in_group(self.fn, self.args, self.kwargs, self.num_processes, self.pg_timeout,
                                   self.backend)
            if rank == 0:  # written whole: the parent never reads half a file
                write_whole(self.workdir / "result.pkl", pickle.dumps(result))
        except BaseException as error:
            # The first rank to fail is the cause; the others usually fail after it ("connection closed by peer").
            report = traceback.TracebackException(*sys.exc_info())
            report.stack = traceback.StackSummary.from_list([f for f in report.stack if f.filename != __file__])
            if isinstance(error, SystemExit):  # sys.exit(N), N not 0: _run_in_group let only those through
                write_exit_report(self.workdir, rank, error, report.stack)
            write_whole(self.workdir / f"rank{rank}.err", f"{time.time()!r}\n{''.join(report.format())}")
            raise


    def _wait_until_all_forked(self, rank: int) -> None:
        try:
            # Not the launch's timeout: the parent enforces that, and a short one (2 s) on a loaded machine would
            # fail ranks whose peers are still being forked. This only bounds a rank the agent never forked.
            self.all_forked.wait(timeout=_FORK_WAIT_S)
        except threading.BrokenBarrierError:
            raise LaunchError(f"rank {rank}: not all {self.num_processes} workers started; the machine may be out "
                              "of memory or processes") from None


def _run_in_group(fn, args, kwargs, world_size, pg_timeout, backend=None, *, exits_normally: bool = False):
    """``fn`` in this process's rank of the group, made here unless there is one. ``exits_normally``: this process
    goes on, or finalizes its interpreter when it ends (torchrun's ranks, the notebook's one rank), unlike forked
    workers (``os._exit``); the groups made here are then released whole (:mod:`.group_release`)."""
    import torch
    import torch.distributed as dist

    from nbtrain.run.placement import strict_placement  # torch: here, as above, not when nbtrain.launch is imported

    created = not dist.is_initialized()
    if created:
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        if "MASTER_ADDR" in os.environ:  # env:// as torchrun, the elastic agent and accelerate set it up
            dist.init_process_group(backend, timeout=pg_timeout)
        else:  # a one-rank group in this process needs no rendezvous
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=pg_timeout)
    try:
        if dist.get_world_size() != world_size:
            raise LaunchError(f"rank {dist.get_rank()} sees a world of {dist.get_world_size()} processes, not "
                              f"{world_size}: the workers did not form one group (on a machine without a GPU, "
                              "ACCELERATE_USE_CPU=1 must be set before launching)")
        try:
            with strict_placement():
                result = fn(*args, **kwargs)
        except SystemExit as stop:
            if exit_status(stop) != 0:  # a failure of this rank: the launch names it with its status
                raise
            # sys.exit(), sys.exit(0), sys.exit(None): this rank finished (a script ending in sys.exit(main())).
            # It leaves through the barrier below as a rank that returned: a worker that left without a return value
            # would keep the forked launch's agent waiting for it forever.
            result = None
        if created and dist.is_initialized():
            # No rank may close its sockets while another still talks to it: a rank that leaves early makes its
            # peers' last collective fail, or abort at exit ("terminate called without an active exception").
            _barrier_at_the_end(pg_timeout)
            dist.destroy_process_group()
            if exits_normally:
                release_process_groups()
        return result
    except BaseException:
        # A one-rank group in the notebook must not outlive the call (the next launch would fork it). With peers,
        # the process exits instead: tearing the group down could wait on a collective a peer never finishes.
        if created and dist.is_initialized() and dist.get_world_size() == 1:
            dist.destroy_process_group()
            if exits_normally:
                release_process_groups()
        raise


def _barrier_at_the_end(pg_timeout: datetime.timedelta) -> None:
    """The barrier a rank enters once its function has returned. Past the collectives' timeout, an error that says
    what a rank alone there means (its traceback would show only torch's frames). It stays a plain ``barrier``: a
    timed-out launch's stack dumps name it as the launch's closing barrier."""
    import torch.distributed as dist

    try:
        dist.barrier()
    except RuntimeError as error:
        if "timed out" not in str(error).lower():
            raise
        raise LaunchError(f"rank {dist.get_rank()} finished, but the other ranks did not reach the end within the "
                          f"collectives' timeout ({pg_timeout.total_seconds():g} s): one still waits in a collective "
                          "this rank never called (did it return, or sys.exit(0), before a collective the others "
                          "call?), or is still working; given a timeout (launch(..., timeout=S), fit(..., "
                          "timeout=S)), the error says where each rank was") from None


class _DropBanner:
    """Drops accelerate's "Launching training on 2 CUDAs." (printed even on CPU); nbtrain prints a true line."""

    def __init__(self, stream):
        self.stream, self.dropping = stream, False

    def write(self, text: str) -> int:
        if text.startswith("Launching training on") or (self.dropping and text == "\n"):
            self.dropping = not self.dropping
            return len(text)
        return self.stream.write(text)

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def _dump_stacks_and_stop_workers(before, timed_out: threading.Event, workdir) -> None:
    """Past the timeout: have each worker of this launch dump its stacks (SIGUSR1), wait for the dumps, kill them."""
    timed_out.set()
    dump_stacks(before, workdir)
    for child in worker_processes(before):  # not joined here: elastic's join in the launching thread reaps them
        child.kill()


def _stop_workers(before) -> None:
    """Kill the workers this launch started (children now that were not there before) and reap them; in the launching
    thread, once elastic has returned (``worker_processes``: why not from another thread)."""
    for child in worker_processes(before):
        child.kill()
        child.join(5)
