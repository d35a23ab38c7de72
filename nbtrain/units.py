"""Parse and format the quantities nbtrain shows: bytes (GiB/MiB), FLOPs, seconds, counts.

    >>> format_bytes(3 * 2**30), parse_bytes("40GiB"), format_count(6.74e9), format_seconds(0.0123)
    ('3.00 GiB', 42949672960, '6.74 B', '12.3 ms')
"""

from __future__ import annotations

import re

from nbtrain.errors import InvalidArgumentError

_BYTE_UNITS = {
    "": 1, "b": 1,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}


def parse_bytes(text: str | int | float) -> int:
    """``"40GiB"`` → 42949672960, as people type sizes: ``24GiB``, ``24 GiB``, ``24gib``, ``0.5TiB``, ``24GB``.

    Binary units for KiB/MiB/GiB/TiB and for the bare letters K/M/G/T (``24g``, ``24G``: as ``ulimit``, Slurm's
    ``--mem`` and the JVM's ``-Xmx`` read them); decimal for KB/MB/GB/TB (``24GB`` = 24e9 bytes, as disk and
    accelerate's ``max_memory`` read them); case does not matter. A number is bytes, and so is a bare number
    written as text when it is at least 1 MiB (``"25769803776"``); a smaller bare number (``"40"``) is refused,
    since 40 bytes is never the budget meant.
    """
    if isinstance(text, bool):
        raise InvalidArgumentError(f"cannot read {text!r} as a size; write it like '40GiB', '512MiB' or '80GB'")
    if isinstance(text, (int, float)):
        return int(text)
    if not isinstance(text, str):
        raise InvalidArgumentError(f"cannot read {text!r} ({type(text).__name__}) as a size; write it like "
                                   "'40GiB', '512MiB' or '80GB'")
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).lower() not in _BYTE_UNITS:
        raise InvalidArgumentError(f"cannot read {text!r} as a size; write it like '40GiB', '512MiB' or '80GB'")
    number, unit = float(match.group(1)), match.group(2).lower()
    if not unit and number < 2**20:
        raise InvalidArgumentError(f"{text.strip()!r} has no unit; write '{text.strip()}GiB' (or MiB, GB, ...; "
                                   f"'{text.strip()}B' for bytes)")
    if number == 0:
        raise InvalidArgumentError(f"{text.strip()!r} is no memory at all; give a size above 0, e.g. '24GiB'")
    return int(number * _BYTE_UNITS[unit])


def parse_fraction(text, flag: str) -> float:
    """A fraction below 1 as people type it: ``'10%'``, ``'0.1'``, ``0.1`` or ``'0'``; anything else raises
    InvalidArgumentError naming ``flag``.

        >>> parse_fraction("10%", "--headroom"), parse_fraction("0.05", "--headroom")
        (0.1, 0.05)
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(%?)\s*", str(text))
    value = float(match.group(1)) / (100 if match.group(2) else 1) if match else -1.0
    if not 0 <= value < 1:
        raise InvalidArgumentError(f"{flag} {text}: give a fraction from 0 to below 1, as '10%' or '0.1'")
    return value


def decimal_note(text: str | None, flag: str = "--memory") -> str | None:
    """How a size in decimal units was read (``24GB`` is 7% less than ``24GiB``), or None for any other size."""
    if not isinstance(text, str) or not re.fullmatch(r"\s*[0-9.eE+-]+\s*[kKmMgGtT][bB]\s*", text):
        return None
    size = parse_bytes(text)
    return (f"{flag} {text.strip()} is {size:,} bytes = {format_bytes(size)} (GB, MB, ... are decimal units; write "
            "GiB, MiB, ... or 24g for binary ones)")


def format_bytes(n: float) -> str:
    """Bytes in the largest binary unit that keeps the number at or above 1: ``1536 * 2**20`` → ``'1.50 GiB'``."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def format_count(n: float) -> str:
    """A count with a decimal suffix: ``124439808`` → ``'124.44 M'``."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f}"


def format_flops(n: float) -> str:
    """FLOPs with a decimal suffix: ``2.5e12`` → ``'2.50 TFLOP'``."""
    for unit, size in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("KFLOP", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} FLOP"


def format_seconds(t: float) -> str:
    """Seconds as s, ms or µs: ``0.0123`` → ``'12.3 ms'``."""
    if t >= 1:
        return f"{t:.2f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.1f} ms"
    return f"{t * 1e6:.1f} µs"


def format_rate(n: float, unit: str) -> str:
    """A rate with a decimal suffix: ``format_rate(2.5e10, "B/s")`` → ``'25.0 GB/s'``."""
    for prefix, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f} {prefix}{unit}"
    return f"{n:.1f} {unit}"
