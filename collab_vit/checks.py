"""Argument checks, one home for the package: each returns the checked value or raises a one-line ``ValueError``
worded ``"<name> must be <what>, got <value>"``.

Integers are ``numbers.Integral`` (Python and numpy integers) and never ``bool``; reals are ``numbers.Real``, never
``bool``, and finite. Imports nothing from the package, so every layer (``layers`` included) can use it.
"""
from __future__ import annotations

import math
import numbers
from typing import Union


def is_integer(value: object) -> bool:
    """An integer argument: ``numbers.Integral`` and not ``bool``."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """A real-valued argument: ``numbers.Real`` (NaN and infinities included) and not ``bool``."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_real(value: object) -> bool:
    """A finite real argument: :func:`is_number`, not NaN or infinite."""
    return is_number(value) and math.isfinite(value)


def _refuse(name: str, what: str, value: object) -> ValueError:
    return ValueError(f"{name} must be {what}, got {value!r}")


def integer(value: object, name: str) -> int:
    """``value`` as an ``int`` if it is an integer (any sign: a seed)."""
    if not is_integer(value):
        raise _refuse(name, "an integer", value)
    return int(value)


def positive_int(value: object, name: str) -> int:
    """``value`` as an ``int`` if it is an integer >= 1."""
    if not is_integer(value) or value <= 0:
        raise _refuse(name, "a positive integer", value)
    return int(value)


def positive_ints(value: object, name: str, what: str = "a positive integer or a list of them"
                  ) -> Union[int, list[int]]:
    """``value`` as an ``int`` if it is an integer >= 1, as a list of ``int`` if it is a non-empty list or tuple of
    them (one per layer or block: a key dim); an element that is not names itself (``positive_int``), any other value
    is refused as not ``what``."""
    if isinstance(value, (list, tuple)) and value:
        return [positive_int(v, name) for v in value]
    if is_integer(value):
        return positive_int(value, name)
    raise _refuse(name, what, value)


def nonnegative_int(value: object, name: str) -> int:
    """``value`` as an ``int`` if it is an integer >= 0."""
    if not is_integer(value) or value < 0:
        raise _refuse(name, "a non-negative integer", value)
    return int(value)


def fraction(value: object, name: str) -> float:
    """``value`` as a ``float`` if it is a real in (0, 1]."""
    if not is_real(value) or not 0 < value <= 1:
        raise _refuse(name, "in (0, 1]", value)
    return float(value)


def positive_real(value: object, name: str, alternative: str = "") -> float:
    """``value`` as a ``float`` if it is a finite real > 0; ``alternative`` names what else the argument may be
    (e.g. ``" or 'balanced'"``) in the message."""
    if not is_real(value) or not value > 0:
        raise _refuse(name, f"a positive finite number{alternative}", value)
    return float(value)
