"""The launching process's side of a launch: its environment and signal handlers for the launch's duration, the
GPUs it sees without initialising CUDA, the process limit, and a free port for the group's rendezvous."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
from contextlib import contextmanager, nullcontext

from nbtrain.profiler.catalog import local_gpus as visible_gpus  # noqa: F401 (the launch's name)
from nbtrain.errors import InvalidArgumentError

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
    try:
        with cpu_env(cpu_only):
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


def cpu_env(cpu_only: bool):
    # Without a GPU, an Accelerator in each worker reports one process (DistributedType.NO) and every worker
    # trains alone; ACCELERATE_USE_CPU=1 makes it see the gloo group (MULTI_CPU). Put back afterwards.
    from accelerate.utils import patch_environment

    return patch_environment(ACCELERATE_USE_CPU="1") if cpu_only else nullcontext()


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
