"""The argument checks every layer shares: one message format, one place.

Each check returns the value converted (float or int) and raises :class:`~userdp.errors.UserError`
(a ``ValueError``) whose message names the parameter: ``"<name> must be ... (got <value>)"``.
The library names its parameters (``sampling_rate``, ``group size G``); the config layer names
its keys (``training.steps``); the CLI names its flags (``--steps``) through
:mod:`userdp.cli.argtypes`, which calls these checks.
"""

from __future__ import annotations

import difflib
import math
from typing import Iterable

from userdp.errors import UserError

#: Smallest sampling rate accounted (below it float64 loses the rate; denormals broke dp_accounting).
MIN_SAMPLING_RATE = 1e-12


def check_number(value, name: str) -> float:
    """A finite real number (bools refused).

    Raises:
        UserError: not a finite number.
    """
    if isinstance(value, bool):
        raise UserError(f"{name} must be a number (got {value!r})")
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise UserError(f"{name} must be a number (got {value!r})") from None
    if not math.isfinite(x):
        raise UserError(f"{name} must be a finite number (got {value})")
    return x


def check_positive(value, name: str) -> float:
    """A finite number > 0.

    Raises:
        UserError: not a finite number, or <= 0.
    """
    x = float(value) if not isinstance(value, bool) else math.nan
    if not math.isfinite(x) or x <= 0:
        raise UserError(f"{name} must be a positive number (got {value})")
    return x


def check_nonnegative(value, name: str) -> float:
    """A finite number >= 0.

    Raises:
        UserError: not a finite number, or < 0.
    """
    x = check_number(value, name)
    if x < 0:
        raise UserError(f"{name} must be >= 0 (got {value})")
    return x


def check_int(value, name: str, minimum: int = 1) -> int:
    """An integer >= ``minimum`` (an integral float such as 3.0 is accepted; bools are not).

    Raises:
        UserError: not an integer, or below ``minimum``.
    """
    ok = not isinstance(value, bool)
    try:
        ok = ok and int(value) == value and int(value) >= minimum
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        raise UserError(f"{name} must be an integer >= {minimum} (got {value})")
    return int(value)


def check_rate(value, name: str) -> float:
    """A sampling rate in (0, 1], at least :data:`MIN_SAMPLING_RATE`.

    Raises:
        UserError: outside (0, 1], or too small to account in float64.
    """
    x = float(value) if not isinstance(value, bool) else math.nan
    if not (0.0 < x <= 1.0):
        raise UserError(f"{name} must be in (0, 1] (got {value})")
    if x < MIN_SAMPLING_RATE:
        raise UserError(f"{name} = {x:g} is below {MIN_SAMPLING_RATE:g}, where float64 accounting is "
                        "not reliable; use a larger sampling rate")
    return x


def check_fraction(value, name: str) -> float:
    """A number strictly between 0 and 1 (a quantile, a delta).

    Raises:
        UserError: outside (0, 1).
    """
    x = float(value) if not isinstance(value, bool) else math.nan
    if not (0.0 < x < 1.0):
        raise UserError(f"{name} must be in (0, 1) (got {value})")
    return x


def check_choice(value, name: str, choices: Iterable[str]) -> str:
    """One of ``choices``.

    Raises:
        UserError: anything else (the message lists the choices).
    """
    options = list(choices)
    if value not in options:
        raise UserError(f"{name} must be one of {', '.join(map(str, options))} (got {value!r})")
    return value


def close_names(name, names: Iterable[str], n: int = 2) -> list[str]:
    """The names closest to ``name``, best first (a did-you-mean; empty when none is close)."""
    return difflib.get_close_matches(str(name), list(names), n=n, cutoff=0.6)
