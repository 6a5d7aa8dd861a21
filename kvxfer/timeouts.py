"""What a timeout argument may be: one rule for every call that takes one.

A timeout is a real number of seconds, finite and above 0 (``bool`` is not a
number here); ``None`` means the call's documented default. ``nan`` (which
compares false with every deadline), ``inf`` (a lease held forever) and values
``<= 0`` (a request over before it was posted) raise :class:`ValueError` at the
call, before anything is posted or leased.
"""
from __future__ import annotations

import math
import numbers


def check_timeout(value, name: str = "timeout") -> float | None:
    """``value`` as a float, or None for None; TypeError if it is not a real number,
    ValueError unless ``0 < value < inf``."""
    if value is None:
        return None
    t = type(value)
    if t is not float and t is not int and (t is bool or not isinstance(value, numbers.Real)):
        raise TypeError(f"{name} must be a number of seconds or None, got {type(value).__name__}")
    seconds = float(value)
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
    return seconds
