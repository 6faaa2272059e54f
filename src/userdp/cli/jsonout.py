"""Strict JSON for every ``--json`` output: JSON has no Infinity or NaN, so a non-finite number
is written as the string ``"inf"``, ``"-inf"`` or ``"nan"`` (Python's ``float()`` reads them back),
numpy scalars and arrays as numbers and lists, paths as strings."""

from __future__ import annotations

from typing import Any

from userdp.fileio import strict, strict_dumps

_clean = strict  # the one implementation (userdp.fileio), shared with every file userdp writes


def dumps(obj: Any, **kwargs) -> str:
    """``json.dumps`` of ``obj`` made strict (see the module docstring); other types via ``str``."""
    return strict_dumps(obj, **kwargs)
