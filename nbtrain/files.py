"""A file written whole or not at all, for another process reading it meanwhile.

    >>> import tempfile
    >>> from pathlib import Path
    >>> write_whole(Path(tempfile.mkdtemp()) / "links.json", "[]\\n")   # a temporary file of its own, renamed over

Used where a second process may read while this one writes: the measured links and the preset profiles a second
notebook (or the test suite's other worker) shares, a launch's worker reports that the parent reads while the agent
stops the workers. Not synced to disk: checkpoints, which must survive a crash, fsync (run/state/checkpoint.py).
"""

from __future__ import annotations

import os
from pathlib import Path


def write_whole(path: Path, data: str | bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file of this process's own in the same folder, renamed over
    ``path``: a reader sees the old file or the new one, never part of one, and two writers never share the
    temporary file. On an error the temporary file is removed and the error raised."""
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    try:
        if isinstance(data, bytes):
            partial.write_bytes(data)
        else:
            partial.write_text(data)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
