"""Reading a learner's answer in the lab (:mod:`nbtrain.notebook.lab`): a number however it is written, and how
the checks print one back.

    >>> number("27%"), number("3/11"), number("12.5 GiB", unit="GiB")
    (Fraction(27, 100), Fraction(3, 11), Fraction(25, 2))
"""

from __future__ import annotations

import math
from fractions import Fraction

GiB = 2**30


class Unreadable(Exception):
    """The answer is not a number/plan the check can read; the message says what was expected."""


def number(answer, unit: str = "") -> Fraction:
    """A real number from an int, float, Fraction, numpy scalar or string ("0.27", "3/11", "27%", "12.5 GiB")."""
    if isinstance(answer, bool):
        raise Unreadable(f"{answer!r} is a bool; give a number")
    if isinstance(answer, str):
        text = answer.strip().replace(",", "").replace("_", "")
        scale = Fraction(1)
        if text.endswith("%"):
            text, scale = text[:-1].strip(), Fraction(1, 100)
        elif unit == "GiB":
            for suffix, factor in (("gib", 1), ("gb", Fraction(10**9, GiB)), ("mib", Fraction(1, 1024))):
                if text.lower().endswith(suffix):
                    text, scale = text[: -len(suffix)].strip(), Fraction(factor)
                    break
        try:
            return Fraction(text) * scale
        except (ValueError, ZeroDivisionError):
            raise Unreadable(f"{answer!r} is not a number") from None
    try:
        value = float(answer)
    except (TypeError, ValueError, OverflowError):
        raise Unreadable(f"{answer!r} ({type(answer).__name__}) is not a number") from None
    if not math.isfinite(value):
        raise Unreadable(f"{answer!r} is not a finite number")
    return Fraction(answer) if isinstance(answer, (int, Fraction)) else Fraction(value)


def percent(x) -> str:
    return f"{float(x):.1%}"


def gib(nbytes) -> str:
    return f"{float(nbytes) / GiB:.2f} GiB"
