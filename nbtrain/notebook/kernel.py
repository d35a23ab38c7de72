"""The "Python (nbtrain)" Jupyter kernel: the spec nbtrain ships, and installing it where Jupyter finds it.

    $ nbtrain kernel install                 # into this environment (sys.prefix): what papermill -k nbtrain finds
    $ nbtrain kernel install --user          # into the user's Jupyter folder

The spec is ``kernels/nbtrain/kernel.json`` in the repository, written here too so that an installed package
(without the repository's folders) can install it. Its argv starts with ``python``: jupyter_client starts that
as the Python that runs Jupyter (or papermill), the one nbtrain is installed in.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

NAME = "nbtrain"
SPEC = {
    "argv": ["python", "-m", "ipykernel_launcher", "-f", "{connection_file}"],
    "display_name": "Python (nbtrain)",
    "language": "python",
    "metadata": {"debugger": True},
}


def install_kernel(user: bool = False, prefix: str | None = None) -> str:
    """Install the kernelspec ``nbtrain``: for this user, under ``prefix``, or (default) in this environment.
    Returns the folder it was installed to."""
    from jupyter_client.kernelspec import KernelSpecManager

    if not user and prefix is None:
        prefix = sys.prefix
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "kernel.json").write_text(json.dumps(SPEC, indent=1))
        return KernelSpecManager().install_kernel_spec(folder, kernel_name=NAME, user=user, prefix=prefix)


def kernel_installed() -> bool:
    from jupyter_client.kernelspec import KernelSpecManager

    return NAME in KernelSpecManager().find_kernel_specs()
