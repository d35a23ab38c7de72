"""The notebook's line to a session's workers: a pipe per rank, a stop flag, and a private folder for batches.

    >>> channel = open_channel(2)                         # in the notebook, before the workers are forked
    >>> path = channel.post([torch.arange(4)])            # a call's batches, once, for every rank to map
    >>> fetch(path)                                       # in each worker
    [tensor([0, 1, 2, 3])]
    >>> oct(os.stat(channel.folder).st_mode & 0o777)      # this user's only
    '0o700'
    >>> channel.close()

Nothing here listens, and no one else gets in (issue 43): each pipe is an anonymous socket pair made before the
workers are forked, so it is the notebook's and one rank's and no other process's; the stop flag is shared memory
they inherit; a call's batches go through one file in a folder only this user can open (``/dev/shm`` where it
exists: memory, not disk, limited by its size, half the machine's memory by default), which every rank maps instead
of receiving a copy (``torch.load(mmap=True)``), read with ``weights_only`` (tensors, lists, tuples, dicts, numbers).
Commands are pickled, but only the notebook writes them; a rank that cannot unpickle one (a function defined after
the session started, which the workers, forked before, do not hold) says so, like every rank, and the session goes
on. Each worker closes the other ranks' ends and the notebook's: when the notebook's process ends, its pipe reads
end-of-file and the worker leaves.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import shutil
import tempfile
import uuid
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

import torch


@dataclass
class Channel:
    """The pipes, the stop flag and the folder of one session (module docstring)."""

    kernel_ends: list[Connection]
    """The notebook's end of each rank's pipe."""
    worker_ends: list[Connection]
    """Each rank's end of its pipe (the workers inherit them)."""
    host_in: Connection
    """What the notebook reads of the host process: how the launch ended."""
    host_out: Connection
    stop: object
    """Shared flag: set by the notebook (an interrupted cell), read by the workers after each step."""
    folder: str
    """The private folder (mode 0700) a call's batches pass through."""
    posted: list[str] = field(default_factory=list)

    def send(self, rank: int, message) -> None:
        self.kernel_ends[rank].send_bytes(pickle.dumps(message))

    def post(self, obj) -> str:
        """Write ``obj`` (tensors, lists, tuples, dicts, numbers) where every rank maps it; returns its path."""
        path = Path(self.folder) / f"{uuid.uuid4().hex}.pt"
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            torch.save(obj, f)
        self.posted.append(str(path))
        return str(path)

    def clear(self) -> None:
        """Remove what calls posted (once every rank has read it)."""
        for path in self.posted:
            Path(path).unlink(missing_ok=True)
        self.posted.clear()

    def close(self) -> None:
        for conn in [*self.kernel_ends, self.host_in]:
            conn.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    # -- the workers' side ---------------------------------------------------------------------------------------
    def worker_end(self, rank: int) -> Connection:
        """In worker ``rank``: its own end; every other end this process inherited is closed, so that the end of the
        notebook's process reads as end-of-file here."""
        for i, conn in enumerate(self.worker_ends):
            if i != rank:
                conn.close()
        for conn in [*self.kernel_ends, self.host_in, self.host_out]:
            conn.close()
        return self.worker_ends[rank]

    def stopping(self) -> bool:
        return bool(self.stop.value)


def open_channel(ranks: int) -> Channel:
    """A channel to ``ranks`` workers, made in the notebook before they are forked."""
    ctx = multiprocessing.get_context("fork")
    pairs = [ctx.Pipe(duplex=True) for _ in range(ranks)]
    host_in, host_out = ctx.Pipe(duplex=False)
    stop = ctx.Value("b", 0, lock=False)
    shm = "/dev/shm"
    where = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None
    folder = tempfile.mkdtemp(prefix="nbtrain-session-", dir=where)  # mode 0700: this user's only
    return Channel([a for a, _ in pairs], [b for _, b in pairs], host_in, host_out, stop, folder)


def fetch(path: str):
    """A posted object, mapped rather than copied."""
    return torch.load(path, mmap=True, weights_only=True)


def receive(conn: Connection) -> bytes | None:
    """The next message on ``conn``, still pickled; None at end-of-file (the other side is gone)."""
    try:
        return conn.recv_bytes()
    except (EOFError, OSError):
        return None
