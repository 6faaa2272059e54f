"""Errors that reach the user as one clear line (the CLI prints them without a traceback)."""


class UserError(ValueError):
    """Bad input or an impossible request, described so that the user can fix it.

    The message names the argument, file, line or field at fault. The CLI prints
    ``userdp: error: <message>`` and exits with status 2. It is a ``ValueError``, so library
    callers can catch bad arguments the usual way.
    """


class BudgetExceededError(UserError):
    """A step would take the privacy spent past the target: the ledger refuses it."""
