"""The nbtrain kernel that papermill's tests start, installed once however many test workers get there first."""

from __future__ import annotations

import fcntl
import os
import tempfile


def nbtrain_kernel_installed() -> None:
    """The kernel "Python (nbtrain)" installed in this environment, as the README's test command needs for
    ``papermill -k nbtrain``: once, under a lock, since the suite's two workers (``-n 2``) may both get here first."""
    from nbtrain.notebook.kernel import install_kernel, kernel_installed

    with open(os.path.join(tempfile.gettempdir(), "nbtrain-test-kernel.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not kernel_installed():
            install_kernel()
