"""Errors that reach the user as one clear line (the CLI prints them without a traceback), and
:func:`say`, which prints that line, or, in a worker of ``userdp train --nproc``, hands it to the
launcher, which prints the job's one line."""

import os
import sys
from pathlib import Path


class UserError(ValueError):
    """Bad input or an impossible request, described so that the user can fix it.

    The message names the argument, file, line or field at fault. The CLI prints
    ``userdp: error: <message>`` and exits with status 2. It is a ``ValueError``, so library
    callers can catch bad arguments the usual way.
    """


class BudgetExceededError(UserError):
    """A step would take the privacy spent past the target: the ledger refuses it."""


#: set in the workers' environment: the folder where each rank writes its one-line error
ERROR_DIR_ENV = "USERDP_LAUNCH_ERRORS"


def worker_error_file() -> Path | None:
    """Where this worker writes its one-line error (None: not started by :func:`userdp.launcher.launch`)."""
    folder = os.environ.get(ERROR_DIR_ENV)
    if not folder:
        return None
    return Path(folder) / f"rank{os.environ.get('RANK', '0')}.err"


def say(line: str, status: int) -> None:
    """Print this process's last line (``userdp: error: ...``) to stderr — or, in a worker of
    :func:`userdp.launcher.launch`, hand it to the launcher, which prints the job's one line."""
    if not _hand_over(line, status):
        print(line, file=sys.stderr)


def _hand_over(line: str, status: int) -> bool:
    path = worker_error_file()
    if path is None:
        return False
    try:
        path.write_text(f"{status}\n{line}\n", encoding="utf-8")
    except OSError:
        return False
    _silence_stderr()
    return True


def _silence_stderr() -> None:
    """After a worker has handed its line over, what it would still print is noise before the job's
    one line: torch.distributed's C++ stacks and warnings as its peers go, "Exception ignored in
    atexit" from its shutdown. Its stderr goes to the null device for the rest of its life."""
    try:
        sys.stderr.flush()
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 2)
        os.close(null)
    except OSError:  # no stderr to replace: nothing will be printed on it either
        pass
