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
    if _installed_spec(user, prefix) == SPEC:  # already there as it would be written: nothing to replace (a Jupyter
        return str(_destination(user, prefix))  # or papermill starting the kernel meanwhile never finds it gone)
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "kernel.json").write_text(json.dumps(SPEC, indent=1))
        return KernelSpecManager().install_kernel_spec(folder, kernel_name=NAME, user=user, prefix=prefix)


def _destination(user: bool, prefix: str | None) -> Path:
    """The folder :func:`install_kernel` installs to, as jupyter_client chooses it."""
    from jupyter_core.paths import jupyter_data_dir

    return (Path(jupyter_data_dir()) if user else Path(prefix) / "share" / "jupyter") / "kernels" / NAME


def _installed_spec(user: bool, prefix: str | None) -> dict | None:
    """The spec installed at :func:`_destination`, if one can be read there."""
    try:
        return json.loads((_destination(user, prefix) / "kernel.json").read_text())
    except (OSError, ValueError):
        return None


def kernel_installed() -> bool:
    from jupyter_client.kernelspec import KernelSpecManager

    return NAME in KernelSpecManager().find_kernel_specs()
