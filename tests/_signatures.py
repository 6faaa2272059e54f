"""What a run calls, read by a profile hook (issue 36: no function on the ``userdp train`` path
takes more than 6 parameters): :func:`wide_functions_called`."""

import contextlib
import inspect
import os
import sys
import threading

import userdp

SRC = os.path.dirname(userdp.__file__)


def parameters(code) -> int:
    """A function's parameters, as a caller sees them (self and cls not counted)."""
    n = code.co_argcount + code.co_kwonlyargcount
    n += bool(code.co_flags & inspect.CO_VARARGS) + bool(code.co_flags & inspect.CO_VARKEYWORDS)
    return n - (n > 0 and code.co_varnames[0] in ("self", "cls"))


@contextlib.contextmanager
def functions_called():
    """The code objects of userdp's functions called inside the block, in every thread."""
    seen: set = set()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(SRC):
            seen.add(frame.f_code)

    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        yield seen
    finally:
        sys.setprofile(None)
        threading.setprofile(None)


def wide(called, limit: int = 6) -> list[str]:
    """``file:function (n)`` for each function in ``called`` that takes more than ``limit`` parameters."""
    return sorted(
        f"{os.path.relpath(c.co_filename, SRC)}:{c.co_qualname} ({n})" for c in called if (n := parameters(c)) > limit
    )
