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
import re
from collections.abc import Iterable

from userdp.errors import UserError

#: Smallest sampling rate accounted (below it float64 loses the rate; denormals broke dp_accounting).
MIN_SAMPLING_RATE = 1e-12

#: what ``model.device`` accepts (checked against the machine by :func:`userdp.devices.resolve_device`;
#: the config and the CLI's flags validate their form here, without importing torch)
DEVICE_SPEC = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def _as_float(value) -> float:
    """``float(value)``, or nan for what is not a number (a bool, a string, None, a tensor of
    several elements): the checks below then refuse it with their own message."""
    if isinstance(value, (bool, str, bytes)) or value is None:
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):
        return math.nan


def check_number(value, name: str) -> float:
    """A finite real number (bools refused).

    Raises:
        UserError: not a finite number.
    """
    x = _as_float(value)
    if math.isnan(x) and not (isinstance(value, float) or type(value).__name__.startswith("float")):
        raise UserError(f"{name} must be a number (got {value!r})")
    if not math.isfinite(x):
        raise UserError(f"{name} must be a finite number (got {value})")
    return x


def check_positive(value, name: str) -> float:
    """A finite number > 0.

    Raises:
        UserError: not a finite number, or <= 0.
    """
    x = _as_float(value)
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


#: Most epochs any per-user loop runs (FedAvg's local SGD, personalization): more is a slip that
#: would run for hours per user, not a plan.
MAX_EPOCHS = 1000
#: Most steps a run can be given (the CLI's ``training.steps`` and ``TrainConfig.steps`` alike).
MAX_STEPS = 10**9


def check_int(value, name: str, minimum: int = 1, maximum: int | None = None) -> int:
    """An integer >= ``minimum`` (and <= ``maximum`` when given; an integral float such as 3.0 is
    accepted; bools are not).

    Raises:
        UserError: not an integer, or outside its range.
    """
    ok = not isinstance(value, bool)
    try:
        ok = ok and int(value) == value and int(value) >= minimum
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        raise UserError(f"{name} must be an integer >= {minimum} (got {value})")
    if maximum is not None and int(value) > maximum:
        raise UserError(f"{name} must be at most {maximum:,} (got {int(value):,})")
    return int(value)


def check_rate(value, name: str) -> float:
    """A sampling rate in (0, 1], at least :data:`MIN_SAMPLING_RATE`.

    Raises:
        UserError: outside (0, 1], or too small to account in float64.
    """
    x = _as_float(value)
    if not (0.0 < x <= 1.0):
        raise UserError(f"{name} must be in (0, 1] (got {value})")
    if x < MIN_SAMPLING_RATE:
        raise UserError(
            f"{name} = {x:g} is below {MIN_SAMPLING_RATE:g}, where float64 accounting is "
            "not reliable; use a larger sampling rate"
        )
    return x


def check_fraction(value, name: str) -> float:
    """A number strictly between 0 and 1 (a quantile, a delta).

    Raises:
        UserError: outside (0, 1).
    """
    x = _as_float(value)
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


def check_bool(value, name: str) -> bool:
    """``True`` or ``False`` (numpy bools accepted; 0/1, strings and None are not).

    Raises:
        UserError: anything else.
    """
    if value is True or value is False or type(value).__name__ == "bool_":
        return bool(value)
    raise UserError(f"{name} must be True or False (got {value!r})")


def check_instance(value, name: str, types, what: str):
    """``value`` is an instance of ``types``; the message says ``what`` was expected.

    Raises:
        UserError: of another type.
    """
    if not isinstance(value, types):
        raise UserError(f"{name} must be {what} (got {type(value).__name__} {_short(value)})")
    return value


def check_callable(value, name: str):
    """A callable (a function, a bound method, an object with ``__call__``).

    Raises:
        UserError: not callable.
    """
    if not callable(value):
        raise UserError(f"{name} must be callable (got {type(value).__name__} {_short(value)})")
    return value


def check_fields(obj, **checks) -> None:
    """Check and convert fields of a (frozen) dataclass in ``__post_init__``: ``checks`` maps a
    field to ``(check, name)`` or to ``(check, name, extra...)`` with the check's further
    arguments; a field whose value is None is skipped when its check is wrapped in
    :func:`optional`. The converted value (a float for ``1``, an int for ``3.0``) replaces the
    field's, so that what the object holds is what was checked (the one boundary)."""
    for field, (check, name, *extra) in checks.items():
        object.__setattr__(obj, field, check(getattr(obj, field), name, *extra))


def optional(check):
    """``check`` that lets None through (an optional field)."""

    def checked(value, name, *extra):
        return None if value is None else check(value, name, *extra)

    return checked


def check_string(value, name: str) -> str:
    """A non-empty ``str``.

    Raises:
        UserError: not a string, or empty.
    """
    if not isinstance(value, str) or not value:
        raise UserError(f"{name} must be a non-empty string (got {_short(value)})")
    return value


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
