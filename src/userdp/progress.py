"""Progress bars for the long phases (reading a file into the store, tokenizing, planning,
evaluation), on stderr, through tqdm — the bar the training and pretraining loops show.

A bar shows only on a terminal (tqdm's ``disable=None``) and only while :func:`shown` allows it:
``userdp train --no-progress`` turns every one off, as it does the training bar. Bars are
``leave=False``: each phase still logs its one summary line when it ends."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Optional

from tqdm import tqdm

_ENABLED: ContextVar[bool] = ContextVar("userdp_progress", default=True)


@contextmanager
def shown(enabled: bool) -> Iterator[None]:
    """Within this block, bars show (on a terminal) only if ``enabled``."""
    token = _ENABLED.set(bool(enabled))
    try:
        yield
    finally:
        _ENABLED.reset(token)


def enabled() -> bool:
    return _ENABLED.get()


def bar(total: Optional[int] = None, desc: str = "", unit: str = "it") -> tqdm:
    """A transient bar for one phase (use as a context manager; ``update(n)`` as work is done)."""
    return tqdm(total=total, desc=desc, unit=unit, leave=False, dynamic_ncols=True, file=sys.stderr,
                mininterval=0.5, disable=None if _ENABLED.get() else True)
