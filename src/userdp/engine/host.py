"""What the host machine offers the engine now: its free physical memory. One reading, shared by
the memory model (:mod:`userdp.engine.memory`, the chunk size) and the noise
(:mod:`userdp.engine.noise.gaussian`, whether a step's draw is made ahead), which must agree on it."""

from __future__ import annotations

import os


def free_host_bytes() -> int | None:
    """Available physical memory in bytes (``SC_AVPHYS_PAGES``), or None where the OS does not say."""
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return None
