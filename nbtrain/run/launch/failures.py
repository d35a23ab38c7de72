"""What went wrong in a launch: which rank failed first, and why, from what the workers left in the launch's folder.

    >>> watcher = ChildWatcher(before)                      # while the launch runs: how each worker ends
    >>> error = worker_error(failure, workdir, 2, watcher)  # WorkerError("rank 1 of 2 died with signal SIGKILL ...")
    >>> watcher.stop()                                      # once the launch has returned: it holds the workers
    >>> error = timeout_error(workdir, 2, timeout=20)       # LaunchTimeoutError naming the rank that hung

Each worker leaves ``rank{r}-pid{p}.stack`` when it starts (its stack dump on SIGUSR1) and ``rank{r}.err`` (time and
traceback) when it raises, and ``rank{r}.exit`` (status, where) when its function called ``sys.exit(N)``, N not 0
(``sys.exit(0)`` is a rank that finished). A rank killed by a signal (the out-of-memory killer, ``kill -9``) leaves
no report, and its peers then fail with "connection reset by peer": torch's elastic agent reports whichever failed
process it saw first, often a peer. The watcher keeps every worker process of the launch, so its exit status is known
after the agent has reaped it; a rank that died silently while the reports only say that a peer went away is the
cause.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

from nbtrain.errors import LaunchTimeoutError, WorkerError
from nbtrain.files import write_whole
from nbtrain.run.launch.stacks import describe_ranks, explain_hang

STACK_FILE = re.compile(r"rank(\d+)-pid(\d+)\.stack")
_DUMP_WAIT_S = 2  # how long a timed-out launch waits for its workers' stack dumps before killing them
# what gloo and NCCL say on a rank whose peer went away: a consequence, not a cause
_PEER_LOST = re.compile(r"connection (reset|closed) by peer|socket closed|broken pipe|remote process exited|"
                        r"communicator was aborted", re.IGNORECASE)


def worker_processes(before: set) -> list[multiprocessing.Process]:
    """This launch's worker processes (the children not in ``before``), read without reaping any.

    ``multiprocessing.active_children()`` polls each child (``waitpid``); from a second thread that races elastic's
    own ``join`` in the launching thread: whichever reaps a worker first, the other reads its exit code as None, and
    elastic then fails with a TypeError instead of reporting the failure. The set of started processes is read as it
    is instead (CPython's ``multiprocessing.process._children``, what ``active_children`` itself reads)."""
    return [p for p in set(multiprocessing.process._children) if p not in before]


class ChildWatcher:
    """Every process this launch forks (children that were not in ``before``), kept to read how each ended."""

    def __init__(self, before: set, interval_s: float = 0.05):
        self.before, self.interval_s = before, interval_s
        self.processes: dict[int, multiprocessing.Process] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="nbtrain-child-watcher", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._look()

    def _look(self) -> None:
        for child in worker_processes(self.before):
            self.processes.setdefault(child.pid, child)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def exit_codes(self, workdir) -> dict[int, int]:
        """Rank → exit code of the workers that have ended (negative: the signal that ended it). Read in the launching
        thread once elastic has returned (it has joined every worker by then)."""
        ranks = {int(m.group(2)): int(m.group(1)) for m in map(STACK_FILE.fullmatch, os.listdir(workdir)) if m}
        codes = {}
        for pid, process in list(self.processes.items()):
            if pid in ranks and process.exitcode is not None:
                codes[ranks[pid]] = process.exitcode
        return codes


def exit_status(stop: SystemExit) -> int:
    """The process exit status Python gives ``sys.exit(code)``: 0 for ``None``, the int itself, 1 for anything else
    (``sys.exit("message")`` prints the message and exits 1)."""
    code = stop.code
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


def write_exit_report(workdir, rank: int, stop: SystemExit, stack: traceback.StackSummary) -> None:
    """In a worker whose function called ``sys.exit(N)`` with N not 0: its status and where it was called, which
    :func:`worker_error` reads to name the rank as one that exited, not one that raised."""
    where = f"{stack[-1].filename}, line {stack[-1].lineno}" if stack else None
    write_whole(Path(workdir) / f"rank{rank}.exit",
                json.dumps({"status": exit_status(stop), "call": f"sys.exit({stop.code!r})", "where": where}))


def worker_error(failure, workdir, num_processes: int, watcher: ChildWatcher | None = None) -> WorkerError:
    """The error for a launch in which a worker raised or died: the first rank to fail, with its traceback (or, for
    a rank that called ``sys.exit(N)``, its exit status and where it called it)."""
    reports = {}
    for path in Path(workdir).glob("rank*.err"):
        stamp, _, text = path.read_text().partition("\n")
        reports[int(path.stem[4:])] = (float(stamp), text.rstrip())
    codes = watcher.exit_codes(workdir) if watcher is not None else {}
    rank, first = failure.get_first_failure()  # the agent's own: a worker the watcher never saw alive included
    codes[rank] = first.exitcode
    silent = {rank: code for rank, code in codes.items() if code and rank not in reports}
    if silent and all(_PEER_LOST.search(text) for _, text in reports.values()):
        # the agent stops the others with SIGTERM: a rank that died of anything else came first
        rank = min(silent, key=lambda r: (silent[r] == -signal.SIGTERM, r))
        return _died(rank, silent[rank], num_processes, sorted(reports))
    if not reports:
        return _died(rank, first.exitcode, num_processes, [])
    # A rank that lost its peer can write its report before the peer that failed has written its own.
    causes = [r for r in reports if not _PEER_LOST.search(reports[r][1])] or list(reports)
    rank = min(causes, key=lambda r: reports[r][0])
    if len({reports[r][1].splitlines()[-1] for r in causes}) == 1:  # every rank failed alike (a NaN loss): say rank 0's
        rank = min(causes)
    text = reports[rank][1]
    others = sorted(r for r in reports if r != rank)
    also = f" (then rank{'s' * (len(others) > 1)} {', '.join(map(str, others))} failed too)" if others else ""
    exited = Path(workdir) / f"rank{rank}.exit"
    if exited.is_file():
        report = json.loads(exited.read_text())
        where = f" at {report['where']}" if report.get("where") else ""
        return WorkerError(f"rank {rank} of {num_processes} exited with status {report['status']} "
                           f"({report['call']}{where}){also}; the other workers were stopped", rank)
    last = text.splitlines()[-1].removeprefix("nbtrain.errors.")  # nbtrain's own errors by name, as everywhere
    return WorkerError(f"rank {rank} of {num_processes} failed: {last}{also}; the other workers "
                       f"were stopped. Fix the cause and run again. Traceback of rank {rank}:\n{text}",
                       rank, text)


def _died(rank: int, code: int, num_processes: int, lost_it: list[int]) -> WorkerError:
    how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
    then = ""
    if lost_it:
        who = f"rank{'s' * (len(lost_it) > 1)} {', '.join(map(str, lost_it))}"
        then = f"; {who} then lost {'their' if len(lost_it) > 1 else 'its'} connection to it"
    return WorkerError(f"rank {rank} of {num_processes} died with {how} without raising (the out-of-memory killer? "
                       f"a crash in native code? os._exit?){then}; the other workers were stopped", rank)


def timeout_error(workdir, num_processes: int, timeout: float) -> LaunchTimeoutError:
    """The error for a launch past its timeout, naming the rank that hung from the workers' stack dumps."""
    dumps = {}
    for path in Path(workdir).glob("rank*-pid*.stack"):
        text = path.read_text(errors="replace")
        if text.strip():
            dumps[int(STACK_FILE.fullmatch(path.name).group(1))] = text
    ranks = describe_ranks(dumps, num_processes, _notebook_cell_name())
    error = LaunchTimeoutError(f"the {num_processes} workers ran past timeout={timeout:g} s and were killed. "
                               f"{explain_hang(ranks)}")
    error.ranks = ranks
    return error


def _notebook_cell_name():
    """IPython's name for the file a cell's code runs from (``In[3]``), as its own tracebacks show it; outside a
    notebook, None."""
    shell = sys.modules["IPython"].get_ipython() if "IPython" in sys.modules else None
    format_code_name = getattr(getattr(shell, "compile", None), "format_code_name", None)
    if format_code_name is None:
        return None
    return lambda path: (format_code_name(path) or (None, None))[1]


def dump_stacks(before: set, workdir) -> None:
    """Have each worker of this launch (children not in ``before``) dump its stacks (SIGUSR1); wait for the dumps."""
    children = {child.pid for child in worker_processes(before)}
    files = {int(STACK_FILE.fullmatch(path.name).group(2)): path for path in Path(workdir).glob("rank*-pid*.stack")}
    # Only workers that registered the handler (their file is named): SIGUSR1 ends a process that has none.
    listening = {pid: path for pid, path in files.items() if pid in children}
    for pid in listening:
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:  # it ended meanwhile
            pass
    _wait_for_dumps(list(listening.values()))


def _wait_for_dumps(paths: list[Path]) -> None:
    """Until every file is non-empty and has stopped growing, at most ``_DUMP_WAIT_S``."""
    deadline, sizes = time.monotonic() + _DUMP_WAIT_S, None
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = [path.stat().st_size for path in paths]
        if all(now) and now == sizes:
            return
        sizes = now
