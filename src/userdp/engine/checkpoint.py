"""Atomic checkpoints: one file written to a temporary name, fsynced, then ``os.replace``d.

A checkpoint holds the ledger, the parameters, the optimizer state, the clipping state, the
sampler state, the unit table and (only for seeded runs) the random states. An unseeded run's
random states are secret — whoever holds them could subtract the noise — so they are not
saved, and a resumed unseeded run draws fresh entropy.
"""

from __future__ import annotations

import os
import tempfile

import torch

CHECKPOINT = "checkpoint.pt"


def path(directory: str) -> str:
    return os.path.join(directory, CHECKPOINT)


def exists(directory: str) -> bool:
    return os.path.exists(path(directory))


def save(directory: str, state: dict) -> None:
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".checkpoint-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path(directory))
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load(directory: str) -> dict:
    return torch.load(path(directory), map_location="cpu", weights_only=True)
