"""The launching process's side of a launch: its environment and signal handlers for the launch's duration (gloo's
and NCCL's sockets on loopback among them), the launch's own temporary folder (removed after it), the check that
CUDA is not initialised before forking, the GPUs it sees without initialising CUDA, the process limit, and a free
port for the group's rendezvous."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
from contextlib import contextmanager, nullcontext

from nbtrain.profiler.catalog import local_gpus as visible_gpus  # noqa: F401 (the launch's name)
from nbtrain.errors import CudaInitializedError, InvalidArgumentError

SIGNALS = [getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")]
"""torch elastic's default TORCHELASTIC_SIGNALS_TO_HANDLE: it installs handlers for these in the launching process."""


@contextmanager
def launch_env(cpu_only: bool):
    """The parent's setting for one launch, all put back after it: environment, signal handlers, elastic's logs."""
    on_main = threading.current_thread() is threading.main_thread()
    handlers = {sig: signal.getsignal(sig) for sig in SIGNALS} if on_main else {}
    # A failure is reported once, by WorkerError, not after pages of agent logs. Each of torch's loggers has its
    # own level, so the parents' level would not reach them.
    quiet = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)
             if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing"))]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.CRITICAL)
    saved = dict(os.environ)
    # Busy-waiting OpenMP threads on a small machine can be 30x slower. Forked workers keep the OpenMP runtime
    # the parent loaded (it read its environment at `import torch`); there one intra-op thread is what prevents
    # spinning. This reaches what the workers start afresh (exec'd tools, spawned helpers). The user's setting wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if not cpu_only:  # the caching allocator grows one mapping instead of caching fixed segments, which fragment
        # (PyTorch's remedy, as torchtitan's launcher sets it); the planner's headroom assumes it. The user's wins.
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    try:
        with cpu_env(cpu_only), loopback_env():
            yield
    finally:
        for key in set(os.environ) - set(saved):  # key by key: other threads never see an empty environment
            del os.environ[key]
        os.environ.update({key: value for key, value in saved.items() if os.environ.get(key) != value})
        for logger, level in zip(quiet, levels):
            logger.setLevel(level)
        # elastic installs handlers that raise SignalException and never puts the old ones back: a kernel left
        # with them would turn the next Ctrl-C into a SignalException.
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


@contextmanager
def launch_folder():
    """A fresh folder for one launch, removed when it ends however it ends: ``(folder, user_tempdir)``.

    It holds nbtrain's own files (the workers' reports, rank 0's result) and, while the launch runs, is this process's
    temporary directory (``tempfile.tempdir``): torch elastic makes its log folder (``torchelastic_*``) there, and
    the files a failing worker's traceback goes to (``pytorch-errorfile-*.pickle``), and removes neither; a day of
    notebook launches left thousands in ``/tmp``. ``user_tempdir`` is the setting before, which each worker puts
    back first, so the user's code in the workers writes its temporary files where it always does (kept)."""
    user_tempdir = tempfile.tempdir  # None: not looked up yet (then from TMPDIR, which stays as it is)
    folder = tempfile.mkdtemp(prefix="nbtrain-launch-")
    elastic = os.path.join(folder, "tmp")
    os.mkdir(elastic)
    tempfile.tempdir = elastic
    try:
        yield folder, user_tempdir
    finally:
        tempfile.tempdir = user_tempdir
        shutil.rmtree(folder, ignore_errors=True)


def check_cuda_not_initialised(fn, args: tuple, kwargs: dict) -> None:
    """Before forking: refuse when CUDA is initialised in this process, saying what did it.

    A forked child cannot use a CUDA context its parent created: every worker would fail at its first CUDA call
    with "Cannot re-initialize CUDA in forked subprocess", the trap users of accelerate's and Lightning's notebook
    launchers meet most. ``torch.cuda.is_initialized()`` says whether it happened; the tensors on a GPU given to the
    launch, held by ``fn``, or left in the notebook say what did it."""
    import torch

    if not torch.cuda.is_initialized():
        return
    found = _on_gpu(fn, args, kwargs)
    what = "; ".join(found[:3]) + (f"; and {len(found) - 3} more" if len(found) > 3 else "") if found else \
        ("torch.cuda was initialised by something no longer in sight (a .cuda() or .to('cuda') whose tensors are "
         "gone, or a torch.cuda call such as torch.cuda.current_device())")
    raise CudaInitializedError(
        f"CUDA is already initialised in this process: {what}. Workers forked from it cannot use CUDA (\"Cannot "
        "re-initialize CUDA in forked subprocess\"), so none was started. Restart the kernel, keep the model on the "
        "CPU or the meta device until the launch (%%autoparallel --launch, fit, launch), and call no torch.cuda "
        "function before it")


def _on_gpu(fn, args: tuple, kwargs: dict) -> list[str]:
    """What holds tensors on a GPU: the launch's arguments (one level into lists, tuples and dicts), the variables
    ``fn`` closes over, its module's globals and the notebook's; each named once."""
    import torch

    seen: set[int] = set()
    found = []

    def look(value, name: str | None, where: str = "") -> None:
        values = [value]
        if name is None and isinstance(value, (list, tuple, dict)):  # a list of batches, a dict of options
            values = list(value.values() if isinstance(value, dict) else value)[:1000]
        for item in values:
            try:
                device = _gpu_device(item)
            except Exception:  # an odd object in the notebook (a lazy proxy): it does not stop the message
                device = None
            if device is None or id(item) in seen:
                continue
            seen.add(id(item))
            if isinstance(item, torch.Tensor):
                found.append(f"a tensor given to the launch is on {device}" if name is None
                             else f"{name} (a tensor{where}) is on {device}")
            else:
                kind = type(item).__name__
                found.append(f"the {kind} given to the launch has parameters on {device}" if name is None
                             else f"{name} (a {kind}{where}) has parameters on {device}")

    for value in (*args, *kwargs.values()):
        look(value, None)
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    for name, cell in zip(getattr(code, "co_freevars", ()), cells):
        try:
            look(cell.cell_contents, name, f" used by {getattr(fn, '__name__', 'the function')}")
        except ValueError:  # a cell not filled yet
            continue
    shell = sys.modules["IPython"].get_ipython() if "IPython" in sys.modules else None
    spaces = [(getattr(shell, "user_ns", None), " in the notebook"), (getattr(fn, "__globals__", None), None)]
    looked: set[int] = set()
    for space, where in spaces:
        if not isinstance(space, dict) or id(space) in looked:
            continue
        looked.add(id(space))
        for name, value in list(space.items()):
            if not name.startswith("_") and name not in ("In", "Out"):  # IPython's own history
                look(value, name, where or f" in {space.get('__name__', 'the module of the function')}")
    return found


def _gpu_device(value) -> str | None:
    """The GPU a tensor is on, or the first GPU a module's parameters or buffers are on; None for anything else."""
    import torch

    if isinstance(value, torch.Tensor):
        return str(value.device) if value.device.type == "cuda" else None
    if isinstance(value, torch.nn.Module):
        for tensor in (*value.parameters(), *value.buffers()):
            if tensor.device.type == "cuda":
                return str(tensor.device)
    return None


def cpu_env(cpu_only: bool):
    # Without a GPU, an Accelerator in each worker reports one process (DistributedType.NO) and every worker
    # trains alone; ACCELERATE_USE_CPU=1 makes it see the gloo group (MULTI_CPU). Put back afterwards.
    from accelerate.utils import patch_environment

    return patch_environment(ACCELERATE_USE_CPU="1") if cpu_only else nullcontext()


def loopback_env():
    """For a launch on this machine alone (forked workers, or one process): gloo's pairs and NCCL's bootstrap
    listen on loopback, not on the address the hostname names, reachable from the network and unauthenticated
    (:func:`~nbtrain.profiler.calibrate.loopback_only_env`); put back afterwards. Not the user's setting: one made for
    multi-node runs would open this machine's run to the network, and loopback always works here."""
    from accelerate.utils import patch_environment

    from nbtrain.profiler.calibrate import loopback_only_env  # torch: not when nbtrain.launch is imported

    return patch_environment(**loopback_only_env())


def check_limit(num_processes: int, gpus: int) -> None:
    if gpus and num_processes > gpus:
        raise InvalidArgumentError(f"num_processes={num_processes} but {gpus} GPU(s) are visible and each worker "
                                   f"needs its own; use num_processes={gpus} or fewer")
    cores = os.cpu_count() or 1
    limit = int(os.environ.get("NBTRAIN_MAX_PROCESSES", max(8, cores)))
    if not gpus and num_processes > limit:
        raise InvalidArgumentError(f"num_processes={num_processes} is more than the {limit} CPU workers allowed on "
                                   f"this {cores}-core machine (each holds its own copy of the model); use fewer, "
                                   "or set NBTRAIN_MAX_PROCESSES to allow more")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore binds: TIME_WAIT is no conflict
        try:
            sock.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False
