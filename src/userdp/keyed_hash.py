"""A number per user from a keyed hash of that user's id alone: what every per-user choice that must
not depend on who else is in the data draws from (held-out users, the sample of users, a user's
cyclic-Poisson group)."""

from __future__ import annotations

import hashlib

import numpy as np


def keyed_uniforms(ids, seed: int, purpose: str) -> np.ndarray:
    """One number in [0, 1) per user id: the first 64 bits of sha256(purpose, seed, id). A user's
    number depends on that user's id alone, so adding or removing a user moves no one else (the
    unit of the mechanism D -> model stays one user)."""
    out = np.empty(len(ids), dtype=np.float64)
    prefix = f"userdp:{purpose}:{int(seed)}:".encode()
    for i, uid in enumerate(ids):
        h = hashlib.sha256(prefix + str(uid).encode("utf-8", "surrogatepass")).digest()
        out[i] = int.from_bytes(h[:8], "little") / 2.0**64
    return out
