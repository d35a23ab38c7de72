"""Where each rank of a hung launch was: its ``faulthandler`` stack dump read into one line, and who hung.

    >>> dumps = {rank: Path(f"rank{rank}.stack").read_text() for rank in (0, 1)}  # faulthandler's output
    >>> ranks = describe_ranks(dumps, world_size=2)
    >>> print(ranks[0])
    rank 0 waited in all_reduce (called at train.py:12 in step)
    >>> print(explain_hang(ranks))
    Rank 1 never reached the collective the others wait in: rank 1 was at data.py:40 in load; rank 0 waited in ...

A dump is what ``faulthandler.dump_traceback(all_threads=True)`` writes: one block per thread, each headed
``Thread 0x... (most recent call first):`` (``Current thread`` for the one that wrote it), one
``  File "path", line N in function`` per frame, innermost first. The worker's own thread is the one running
``nbtrain/run/launch/workers.py``; the rank waits in a collective when its innermost frames are ``torch/distributed`` code.
Below the launch's frames a forked worker also shows the parent's (the notebook cell that called ``launch``): those
are never taken for where the rank was. A function defined in a notebook runs from a file such as
``/tmp/ipykernel_4242/2853719463.py``; given IPython's names for those files, a frame there reads
``cell In[3], line 5``, as IPython's own tracebacks say.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePath
from typing import Callable

_HEADER = re.compile(r"((Current thread|Thread) 0x[0-9a-fA-F]+.*|Stack) \(most recent call first\):")
_FRAME = re.compile(r'\s+File "(?P<path>.*)", line (?P<line>\d+|\?\?\?) in (?P<function>.*)')
_LAUNCH = "nbtrain/run/launch/workers.py"
_TORCH = re.compile(r"[/\\]torch[/\\]")
_TORCH_DISTRIBUTED = re.compile(r"[/\\]torch[/\\]distributed[/\\]")
# The standard library (threading.py, queue.py, subprocess.py, ...) but not what pip installs beside it.
_STDLIB = re.compile(r"[/\\]lib[/\\]python3\.\d+[/\\](?!.*-packages[/\\])")


@dataclass(frozen=True)
class Frame:
    """One line of a dump: ``File "/home/me/train.py", line 12 in step``."""

    path: str
    """The file, as the worker saw it."""
    line: int | None
    """The line number; None where faulthandler wrote ``???``."""
    function: str
    """The function's name (``<module>`` for a script's top level)."""
    cell: str | None = None
    """``In[3]`` when the file is a notebook cell's code, as IPython's tracebacks name it; None elsewhere."""

    def __str__(self) -> str:
        line = self.line if self.line is not None else "?"
        if self.cell:
            return f"cell {self.cell}, line {line} in {self.function}"
        return f"{PurePath(self.path).name}:{line} in {self.function}"


@dataclass(frozen=True)
class RankStack:
    """Where one rank's worker thread was when its stacks were dumped."""

    rank: int
    """The rank in the launch's process group."""
    frames: tuple[Frame, ...] | None
    """The worker thread's frames, most recent call first; None when the rank sent back no dump."""
    collective: str | None
    """The ``torch.distributed`` function the rank waited in (``all_reduce``, ``barrier``, ...), or None."""
    site: Frame | None
    """The innermost frame of the user's code: where the collective was called, or where the rank was."""

    def __str__(self) -> str:
        return f"rank {self.rank} {self.whereabouts}"

    @property
    def whereabouts(self) -> str:
        """``waited in all_reduce (called at train.py:12 in step)`` or ``was at data.py:40 in load``."""
        if self.frames is None:
            return "sent back no stack dump"
        if self.collective and self.site and _is_launch(self.site.path):  # its init_process_group, closing barrier
            after = " after the function returned" if self.collective == "barrier" else ""
            return f"waited in {self.collective}, called by nbtrain's launch{after}"
        if self.collective:
            return f"waited in {self.collective}" + (f" (called at {self.site})" if self.site else "")
        return f"was at {self.site}" if self.site else "was running no Python code"


def describe_ranks(dumps: dict[int, str], world_size: int,
                   cell_name: Callable[[str], str | None] | None = None) -> list[RankStack]:
    """One :class:`RankStack` per rank ``0 .. world_size - 1`` from each rank's dump text (a rank with none: no dump).

    ``cell_name(path)`` gives a notebook cell's name (``In[3]``) for a file that holds a cell's code, else None."""
    return [_describe(rank, dumps.get(rank), cell_name or (lambda path: None)) for rank in range(world_size)]


def explain_hang(ranks: list[RankStack]) -> str:
    """What the stacks say about a launch that ran past its timeout, and what to do, in a few sentences."""
    waiting = [r for r in ranks if r.frames is not None and r.collective]
    elsewhere = [r for r in ranks if r.frames is not None and not r.collective]
    silent = [r for r in ranks if r.frames is None]
    if not waiting and not elsewhere:
        return ("No worker sent back where it was (were they still starting?). Raise the timeout, or look for a rank "
                "stuck in a collective the others never reach.")
    if waiting and elsewhere:  # the ranks outside every collective are the ones the others wait for
        culprits = _ranks(r.rank for r in elsewhere)
        text = (f"{culprits} never reached the collective the others wait in: {_where(elsewhere + waiting + silent)}. "
                f"Raise the timeout if {culprits} {'were' if len(elsewhere) > 1 else 'was'} only slow, or make every "
                "rank reach the same collectives.")
    elif waiting and silent:
        one = "ones" if len(silent) > 1 else "one"
        text = (f"{_ranks(r.rank for r in silent)} sent back no stack dump and may be the {one} that never reached the "
                f"collective the others wait in: {_where(waiting)}. Raise the timeout if it was only slow, or make "
                "every rank reach the same collectives.")
    elif len({(r.collective, r.site) for r in waiting}) > 1:
        text = (f"Every rank waited in a collective, but not in the same one: {_where(waiting)}. Make every rank call "
                "the same collectives in the same order.")
    elif waiting:
        text = (f"Every rank waited in the same collective, which never completed: {_where(waiting)}. Did the ranks "
                "call it on different process groups? Raise the timeout if it was only slow.")
    else:
        text = (f"No rank was in a collective: {_where(elsewhere + silent)}. Raise the timeout if the work is only "
                "slow.")
    return text[0].upper() + text[1:]


def _describe(rank: int, dump: str | None, cell_name: Callable[[str], str | None]) -> RankStack:
    if dump is None:
        return RankStack(rank, None, None, None)
    frames = _worker_thread(_threads(dump, cell_name))
    launched = next((i for i, f in enumerate(frames) if _is_launch(f.path)), len(frames))
    inner = 0  # the run of torch.distributed frames the rank is blocked in, if any
    while inner < launched and _TORCH_DISTRIBUTED.search(frames[inner].path):
        inner += 1
    collective = _collective_name(frames[:inner]) if inner else None
    users = [f for f in frames[inner:launched] if not _is_internal(f.path)]
    # No frame of the user's own: the launch's (its init_process_group, closing barrier, wait for the other forks).
    ours = [f for f in frames[inner:] if not _is_internal(f.path) or _is_launch(f.path)]
    site = (users or ours or list(frames) or [None])[0]
    return RankStack(rank, frames, collective, site)


def _threads(dump: str, cell_name: Callable[[str], str | None]) -> list[tuple[Frame, ...]]:
    threads: list[list[Frame]] = []
    for line in dump.splitlines():
        if _HEADER.fullmatch(line.strip()):
            threads.append([])
        elif (frame := _FRAME.fullmatch(line)) and threads:
            path, number = frame["path"], frame["line"]
            threads[-1].append(Frame(path, int(number) if number.isdigit() else None, frame["function"],
                                     cell_name(path)))
    return [tuple(frames) for frames in threads]


def _worker_thread(threads: list[tuple[Frame, ...]]) -> tuple[Frame, ...]:
    """The thread that runs the launch's worker; failing that the last one listed (the oldest: the main thread)."""
    for frames in threads:
        if any(_is_launch(f.path) for f in frames):
            return frames
    return threads[-1] if threads else ()


def _collective_name(frames: tuple[Frame, ...]) -> str:
    """The outermost ``distributed_c10d`` function of a run of ``torch.distributed`` frames: the one the user called
    (``all_gather_object``, not the ``all_gather`` it calls), skipping the logging ``wrapper`` around each."""
    named = [f for f in frames if f.function != "wrapper"] or list(frames)
    c10d = [f for f in named if PurePath(f.path).name == "distributed_c10d.py"]
    return (c10d or named)[-1].function


def _is_internal(path: str) -> bool:
    """torch, nbtrain's launch and the standard library: the user's own frame is the one that called into them."""
    return bool(_TORCH.search(path)) or _is_launch(path) or bool(_STDLIB.search(path)) or path.startswith("<frozen ")


def _is_launch(path: str) -> bool:
    return path.replace("\\", "/").endswith(_LAUNCH)


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return f"ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]}"


def _where(ranks: list[RankStack]) -> str:
    """``ranks 0 and 2 waited in all_reduce (...); rank 1 was at ...``: ranks that were at the same place together."""
    groups: dict[str, list[int]] = {}
    for r in ranks:
        groups.setdefault(r.whereabouts, []).append(r.rank)
    return "; ".join(f"{_ranks(members)} {_plural(whereabouts) if len(members) > 1 else whereabouts}"
                     for whereabouts, members in groups.items())


def _plural(whereabouts: str) -> str:
    return "were " + whereabouts[4:] if whereabouts.startswith("was ") else whereabouts
