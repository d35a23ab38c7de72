"""nbtrain's presets profiled once and read back: ``nbtrain plan llama-70b ...`` profiles the model the first time
(about 4 s on 2 cores, importing torch included, on fake tensors) and reads the profile back in milliseconds
afterwards, without torch.

    >>> prof = preset_profile("gpt-tiny", seq_len=64)      # profiled the first time, read from the cache after
    >>> preset_profile("gpt-tiny", seq_len=64).to_json() == prof.to_json()
    True

A preset's profile depends on its name, the arguments, nbtrain's code and torch's version, and on nothing else: the
file is named by a digest of all of them, under ``$NBTRAIN_CACHE_DIR/profiles`` (else ``~/.cache/nbtrain``, where
the measured links are kept), so any change to nbtrain or torch profiles again. A model given as ``module:attr``
or as a module is the user's code, which can change under the same name: it is never cached.
"""

from __future__ import annotations

import hashlib
import json
from importlib.metadata import version
from pathlib import Path

from nbtrain.files import write_whole
from nbtrain.profiler.collectives import cache_file
from nbtrain.profiler.result import ModelProfile

_CODE = Path(__file__).resolve().parent.parent  # the nbtrain package


def code_digest() -> str:
    """A digest of every Python file of nbtrain (path and bytes) and of torch's version."""
    h = hashlib.sha256(version("torch").encode())
    for path in sorted(_CODE.rglob("*.py")):
        h.update(str(path.relative_to(_CODE)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def cache_path(name: str, batch_size: int, seq_len: int | None, dtype: str) -> Path:
    """Where the profile of preset ``name`` with these arguments is kept."""
    key = hashlib.sha256(json.dumps([name, batch_size, seq_len, str(dtype), code_digest()]).encode()).hexdigest()
    return cache_file(1).parent / "profiles" / f"{name}-{key[:20]}.json"


def preset_profile(name: str, *, batch_size: int = 1, seq_len: int | None = None, dtype="bf16") -> ModelProfile:
    """``nbtrain.profile(name, batch_size=..., seq_len=..., dtype=...)`` for a preset (a name without ``:``), kept on
    disk the first time and read from there afterwards; anything else is profiled as ``nbtrain.profile`` does."""
    path = cache_path(name, batch_size, seq_len, dtype) if isinstance(name, str) and ":" not in name else None
    if path is not None and path.exists():
        try:
            return ModelProfile.from_dict(json.loads(path.read_text()))
        except (OSError, ValueError, TypeError, KeyError):
            pass  # a torn or stale file: profile again and replace it
    from nbtrain.profiler.model import profile  # torch, only when profiling

    result = profile(name, batch_size=batch_size, seq_len=seq_len, dtype=dtype)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_whole(path, result.to_json(indent=None))  # whole or not at all, for a second process reading it
        except OSError:
            pass  # a read-only home: the profile is still returned
    return result
