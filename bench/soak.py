"""Launch soak: many short trainings in a row from one parent, and what they leave behind.

    python bench/soak.py            # 50 launches of 2 workers, ~2 min on 2 cores; a table on stdout
    python bench/soak.py 200        # more
    python bench/soak.py --session  # 50 sessions: open, train, interrupt, replan, train, close (~3 min)

Each launch is ``nbtrain.fit`` of a tiny GPT for 2 steps under ``dp_replicate=2`` in 2 forked gloo workers; in every
ten, the failure paths must clean up too: one launch's worker raises, one worker is killed by SIGKILL, one training
with checkpoints is interrupted (rank 0 sends this process SIGINT, as a notebook's stop button does) and the next
resumes it. Each error is kept until the next one, as a notebook keeps the last (an error that held the launch's
port would show as a listening socket). After each, from ``/proc``: this
process's live children, its open file descriptors, the TCP sockets of this machine in LISTEN state (a rendezvous
port left open would stay there), and this process's resident memory; and the entries in the temporary directory
(torch elastic's ``torchelastic_*`` log folders and failed workers' ``pytorch-errorfile-*.pickle`` were left there by
every launch). The soak runs with a temporary directory of its own (``TMPDIR`` and ``tempfile.tempdir``, which the
workers inherit), empty at the start, so that other programs' files in ``/tmp`` are not counted; torch's compile
cache ``torchinductor_<user>``, which ``import torch._dynamo`` makes there once (with or without a launch) and every
later process reuses, is shown apart (``TORCH_CACHES``), not counted as left behind. Passes when no
child, descriptor or listening socket is left beyond what there was after the first launch, no entry is left in the
temporary directory, and the resident memory grew by less than ``NOISE_MIB`` between the first tenth and the end
(allocator pools warm up on the first launches).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time

import torch
import torch.distributed as dist

import nbtrain
from nbtrain.errors import WorkerError
from nbtrain.run.launch.workers import launch

NOISE_MIB = 16
TORCH_CACHES = ("torchinductor_",)
"""Entries torch keeps in the temporary directory on purpose: made once per user, reused by every process."""


def children() -> int:
    """Live child processes of this one (zombies included: an unreaped child is a leak too)."""
    me, count = str(os.getpid()), 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                count += f.read().rsplit(")", 1)[1].split()[1] == me
        except OSError:
            continue
    return count


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def listening_sockets() -> int:
    """TCP sockets listening in this process and its children (psutil): the machine's own count moves with whatever
    else runs on it (test suites beside this soak opened 1 to 76 listeners in a minute)."""
    import psutil

    me = psutil.Process()
    total = 0
    for process in (me, *me.children(recursive=True)):
        try:
            total += sum(c.status == psutil.CONN_LISTEN for c in process.net_connections(kind="tcp"))
        except psutil.Error:  # a child gone since it was listed
            pass
    return total


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb / 1024


def temporary_entries() -> list[str]:
    """What is in the temporary directory (the soak's own, empty at the start), torch's caches aside."""
    return sorted(name for name in os.listdir(tempfile.gettempdir()) if not name.startswith(TORCH_CACHES))


def failing_worker():
    raise RuntimeError("a worker that fails on purpose")


def with_fault(data, fault: str):
    """``data`` as a function, with rank ``1`` killed (``"kill"``) or rank 0 interrupting this process
    (``"interrupt"``) at batch 1."""
    def batch(step):
        if step == 1 and fault == "kill" and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        if step == 1 and fault == "interrupt" and dist.get_rank() == 0:
            os.kill(os.getppid(), signal.SIGINT)
        return data[step % len(data)]
    return batch


def session_files() -> list[str]:
    """The sessions' private folders (``/dev/shm`` or the temporary directory) still on disk."""
    places = [p for p in ("/dev/shm", tempfile.gettempdir()) if os.path.isdir(p)]
    return sorted(name for place in places for name in os.listdir(place) if name.startswith("nbtrain-session-"))


def soak_sessions(count: int) -> int:
    """``count`` sessions in a row: each opens, trains 2 steps, is interrupted (this process gets SIGINT, as the
    stop button sends) in a long call, replans, trains 2 more and closes; what each leaves behind, as for launches."""
    import threading

    torch.manual_seed(0)
    model = nbtrain.build_preset("gpt-tiny", device="cpu")
    g = torch.Generator().manual_seed(0)
    data = [(x, torch.roll(x, -1, 1)) for x in (torch.randint(0, 512, (4, 16), generator=g) for _ in range(2))]
    rows, started = [], time.perf_counter()
    for i in range(count):
        session = nbtrain.Session(model, "dp_replicate=2", num_processes=2, timeout=120)
        try:
            session.fit(data, steps=2, progress=False)
            threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
            session.fit(data, steps=100_000, progress=False)  # stopped after a step, the session goes on
            session.replan("dp_shard=2" if i % 2 == 0 else "0: dp_shard=2; 1-4: dp_replicate=2; 5: dp_shard=2")
            session.fit(data, steps=2, progress=False)
        finally:
            session.close()
        rows.append((i + 1, children(), open_fds(), listening_sockets(), rss_mib(),
                     len(temporary_entries()) + len(session_files())))
    return report(rows, count, time.perf_counter() - started, "sessions", None, 0)


def main(launches: int = 50, sessions: bool = False) -> int:
    checkpoints = tempfile.TemporaryDirectory(prefix="nbtrain-soak-")  # in the usual one: not counted
    scratch = tempfile.mkdtemp(prefix="nbtrain-soak-tmp-")
    saved = tempfile.tempdir, os.environ.get("TMPDIR")
    tempfile.tempdir = os.environ["TMPDIR"] = scratch
    try:
        return soak(launches, checkpoints.name, sessions)
    finally:
        tempfile.tempdir = saved[0]
        if saved[1] is None:
            del os.environ["TMPDIR"]
        else:
            os.environ["TMPDIR"] = saved[1]
        checkpoints.cleanup()
        shutil.rmtree(scratch, ignore_errors=True)  # listed above if anything was left


def soak(launches: int, checkpoints: str, sessions: bool = False) -> int:
    if sessions:
        return soak_sessions(launches)
    torch.manual_seed(0)
    model = nbtrain.build_preset("gpt-tiny", device="cpu")
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 512, (4, 16), generator=g) for _ in range(2)]
    data = [(x, torch.roll(x, -1, 1)) for x in ids]
    rows, failures, kept = [], 0, None
    run = dict(plan="dp_replicate=2", num_processes=2, progress=False, timeout=120)
    started = time.perf_counter()
    for i in range(launches):
        try:
            if i % 10 == 9:
                launch(failing_worker, num_processes=2, timeout=120)
            elif i % 10 == 3:
                nbtrain.fit(model, with_fault(data, "kill"), steps=4, **run)
            elif i % 10 == 5:
                folder = os.path.join(checkpoints, str(i))
                nbtrain.fit(model, with_fault(data, "interrupt"), steps=6, checkpoint_dir=folder, checkpoint_every=1,
                            **run)
            elif i % 10 == 6:  # resumes the interrupted one
                nbtrain.fit(model, data, steps=6, checkpoint_dir=os.path.join(checkpoints, str(i - 1)),
                            resume=True, **run)
            else:
                nbtrain.fit(model, data, steps=2, **run)
        except (WorkerError, KeyboardInterrupt) as error:
            failures, kept = failures + 1, error
        rows.append((i + 1, children(), open_fds(), listening_sockets(), rss_mib(), len(temporary_entries())))
    return report(rows, launches, time.perf_counter() - started, "launches", kept, failures)


def report(rows: list, launches: int, seconds: float, what: str, kept, failures: int) -> int:
    """The table of what was left after each, and PASS or FAIL."""
    print(f"{'launch':>6} {'children':>8} {'fds':>5} {'listen':>6} {'rss MiB':>8} {'tmp':>4}")
    for row in rows[:3] + rows[9::10]:
        print(f"{row[0]:>6} {row[1]:>8} {row[2]:>5} {row[3]:>6} {row[4]:>8.1f} {row[5]:>4}")
    first, last = rows[0], rows[-1]
    warm = rows[max(0, launches // 10 - 1)]
    grew = last[4] - warm[4]
    leaks = {"children": last[1] - first[1], "fds": last[2] - first[2], "listening sockets": last[3] - first[3]}
    left = temporary_entries()
    caches = sorted(name for name in os.listdir(tempfile.gettempdir()) if name.startswith(TORCH_CACHES))
    if kept is not None:
        print(f"last error kept: {type(kept).__name__}: {str(kept)[:100]}")
    print(f"\n{launches} {what} ({failures} failing on purpose) in {seconds:.0f} s, {seconds / launches:.2f} s each; "
          f"left behind since the first: " + ", ".join(f"{k} {v:+d}" for k, v in leaks.items())
          + f"; resident memory {warm[4]:.1f} → {last[4]:.1f} MiB ({grew:+.1f}) after launch {warm[0]}; "
          f"left on disk (the temporary directory): {len(left)} entries" + (f": {', '.join(left[:10])}"
                                                                             f"{' …' if len(left) > 10 else ''}"
                                                                             if left else "")
          + (f" (torch's own cache, kept on purpose: {', '.join(caches)})" if caches else ""))
    ok = all(v <= 0 for v in leaks.values()) and last[1] == 0 and grew < NOISE_MIB and not left
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    numbers = [a for a in sys.argv[1:] if a.isdigit()]
    sys.exit(main(int(numbers[0]) if numbers else 50, "--session" in sys.argv))
