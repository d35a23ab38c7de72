"""Checks and counts every layer needs, written once: a positive whole number, powers of two.

    >>> positive_int(4, "steps must be a positive integer")
    4
    >>> positive_int(True, "steps must be a positive integer, got True")
    Traceback (most recent call last):
    ...
    nbtrain.errors.InvalidArgumentError: steps must be a positive integer, got True
    >>> power_of_two_divisors(24), is_power_of_two(24)
    ([1, 2, 4, 8], False)
"""

from __future__ import annotations

import operator

from nbtrain.errors import InvalidArgumentError


def positive_int(value, message: str, error: type[Exception] = InvalidArgumentError) -> int:
    """``value`` as an int ≥ 1 (any integer type, not a bool), or ``error(message)``."""
    try:
        n = operator.index(value) if not isinstance(value, bool) else None
    except TypeError:
        n = None
    if n is None or n < 1:
        raise error(message)
    return n


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def power_of_two_divisors(n: int) -> list[int]:
    """The powers of two that divide ``n``, smallest first (the degrees a count of ``n`` devices splits into)."""
    return [2**k for k in range(n.bit_length()) if n % 2**k == 0]
