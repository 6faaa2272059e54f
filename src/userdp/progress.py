"""Progress bars for the long phases (reading a file into the store, tokenizing, planning,
evaluation), on stderr, through tqdm — the bar the training and pretraining loops show.

A bar shows only on a terminal (tqdm's ``disable=None``) and only while :func:`shown` allows it:
``userdp train --no-progress`` turns every one off, as it does the training bar. Bars are
``leave=False``: each phase still logs its one summary line when it ends.

On a stderr that is not a terminal (a log file, a CI job, ``nohup``) no bar is drawn: tqdm's
frames would each become a line of the log (800+ for the default run) and glue the next message
onto a frame. A loop that asks for ``lines=N`` (training, pretraining) then writes one plain line
every ~1/N of its total instead, each on its own line; the short phases write nothing there (their
summary line says what they did)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from tqdm import tqdm

#: the plain lines a training or pretraining loop writes off a terminal (one per ~10% of its steps)
LOOP_LINES = 10

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


def _terminal() -> bool:
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


def bar(total: int | None = None, desc: str = "", unit: str = "it", *, initial: int = 0, lines: int = 0):
    """A transient bar for one phase (use as a context manager; ``update(n)`` as work is done,
    ``set_postfix_str(s)`` for what it shows beside the count). Off a terminal: ``lines`` plain
    lines over the whole ``total`` (0: nothing), see the module docstring."""
    if _ENABLED.get() and not _terminal():
        return _Lines(total, desc, unit, initial, lines)
    return tqdm(
        total=total,
        initial=initial,
        desc=desc,
        unit=unit,
        leave=False,
        dynamic_ncols=True,
        file=sys.stderr,
        mininterval=0.5,
        disable=None if _ENABLED.get() else True,
    )


class _Lines:
    """The bar's interface, writing a plain ``desc: n/total unit postfix`` line every
    ``total / lines`` updates and at the end (nothing if ``lines`` is 0 or the total unknown)."""

    def __init__(self, total, desc, unit, initial, lines):
        self.total, self.desc, self.unit, self.n = total, desc, unit, int(initial)
        self.every = max(1, -(-int(total) // lines)) if lines and total else 0
        self.postfix = ""
        self._said = self.n

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.every and (self.n - self._said >= self.every or self.n >= self.total):
            self._said = self.n
            tail = f" {self.postfix}" if self.postfix else ""
            print(f"{self.desc}: {self.n}/{self.total} {self.unit}{tail}", file=sys.stderr, flush=True)

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = s

    def set_postfix(self, **kwargs) -> None:
        self.postfix = " ".join(f"{k} {v}" for k, v in kwargs.items())

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
