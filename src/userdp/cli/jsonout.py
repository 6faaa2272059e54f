"""Strict JSON for every ``--json`` output: JSON has no Infinity or NaN, so a non-finite number
is written as the string ``"inf"``, ``"-inf"`` or ``"nan"`` (Python's ``float()`` reads them back),
numpy scalars and arrays as numbers and lists, paths as strings."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def _clean(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else ("nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf"))
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "item") and hasattr(obj, "dtype") and getattr(obj, "ndim", 1) == 0:  # numpy scalar
        return _clean(obj.item())
    if hasattr(obj, "tolist"):  # numpy array
        return _clean(obj.tolist())
    return obj


def dumps(obj: Any, **kwargs) -> str:
    """``json.dumps`` of ``obj`` made strict (see the module docstring); other types via ``str``."""
    return json.dumps(_clean(obj), allow_nan=False, default=str, **kwargs)
