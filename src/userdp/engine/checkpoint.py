"""Checkpoints as one atomic unit, with checksums.

A checkpoint is several files in one directory — ``checkpoint.pt`` (the engine's state: the
ledger, parameters, optimizer, clipping and sampler state, the unit table and, for seeded runs
only, the random states) plus whatever the caller adds (the LM job adds ``model.safetensors``
and ``ledger.json``). They are switched together:

1. every file is written under a pending name (``.NAME.pending``) and fsynced;
2. ``MANIFEST.json`` (the step, each file's size and sha256) is written to a temporary name,
   fsynced and ``os.replace``d into place — **this is the commit**;
3. each pending file is renamed to its final name.

A crash before (2) leaves the previous checkpoint intact (its manifest still describes the
final names, which were not touched); a crash during (3) is rolled forward by the next reader,
whose pending files match the new manifest. A write that fails (disk full) removes its pending
files and raises one clear :class:`UserError` saying the previous checkpoint is intact. Every
load checks every file against the manifest and refuses a mismatch, naming the file.

An unseeded run's random states are secret — whoever holds them could subtract the noise — so
they are never saved, and a resumed unseeded run draws fresh entropy.
"""

from __future__ import annotations

import json
import os
import pickle
import zipfile
from typing import Callable, Mapping, Optional

import torch

from userdp.errors import UserError
from userdp.fileio import failure_text, free_space, fsync_path, is_writer_failure, sha256_file

CHECKPOINT = "checkpoint.pt"
MANIFEST = "MANIFEST.json"
Writer = Callable[[str], None]


def path(directory: str) -> str:
    """The engine state file of the checkpoint in ``directory``."""
    return os.path.join(directory, CHECKPOINT)


def manifest_path(directory: str) -> str:
    return os.path.join(directory, MANIFEST)


def exists(directory: str) -> bool:
    """Whether ``directory`` holds a checkpoint (committed, or a lone legacy checkpoint.pt)."""
    return os.path.exists(manifest_path(directory)) or os.path.exists(path(directory))


def _pending(directory: str, name: str) -> str:
    return os.path.join(directory, f".{name}.pending")


def save(directory: str, state: dict, extra: Optional[Mapping[str, Writer]] = None) -> None:
    """Write a checkpoint: ``state`` as ``checkpoint.pt`` plus ``extra`` files (name -> a function
    that writes that file at the path it is given), committed as one unit.

    Raises:
        UserError: the files could not be written (e.g. the disk is full); the previous checkpoint
            is left intact and no partial file remains.
    """
    os.makedirs(directory, exist_ok=True)
    writers: dict[str, Writer] = {CHECKPOINT: lambda p: torch.save(state, p)}
    writers.update(extra or {})
    written: list[str] = []
    tmp_manifest = os.path.join(directory, f".{MANIFEST}.pending")
    try:
        files = {}
        for name, write in writers.items():
            pend = _pending(directory, name)
            written.append(pend)
            write(pend)
            fsync_path(pend)
            files[name] = {"sha256": sha256_file(pend), "bytes": os.path.getsize(pend)}
        manifest = {"format": 1, "step": int(state.get("step", -1)), "files": files}
        written.append(tmp_manifest)
        with open(tmp_manifest, "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
    except Exception as exc:  # noqa: BLE001 - classified below
        for p in written:
            if os.path.exists(p):
                os.unlink(p)
        if not is_writer_failure(exc, any_runtime_error=True):
            raise
        # torch.save's RuntimeError on a full disk, safetensors' error, an OSError: one line; the
        # ledger's journal already counts the steps, so the run resumes from the previous checkpoint
        raise UserError(f"{directory}: could not write the checkpoint at step {state.get('step')} "
                        f"({exc.strerror if isinstance(exc, OSError) and exc.strerror else failure_text(exc)}"
                        f"{free_space(directory)}); the previous checkpoint is intact: free "
                        "space and resume the run") from None
    except BaseException:
        for p in written:
            if os.path.exists(p):
                os.unlink(p)
        raise
    os.replace(tmp_manifest, manifest_path(directory))  # the commit
    fsync_path(directory)
    _switch(directory, manifest)


def _switch(directory: str, manifest: dict) -> None:
    for name in manifest["files"]:
        pend = _pending(directory, name)
        if os.path.exists(pend):
            os.replace(pend, os.path.join(directory, name))
    fsync_path(directory)


def read_manifest(directory: str) -> dict:
    """The committed manifest, after rolling a half-switched checkpoint forward.

    Raises:
        UserError: the manifest is missing (while a checkpoint file exists) or unreadable.
    """
    mp = manifest_path(directory)
    if not os.path.exists(mp):
        if os.path.exists(path(directory)):
            raise UserError(f"{mp}: missing, so {path(directory)} cannot be verified (deleted, or the "
                            "checkpoint was written by an older userdp); the run cannot be resumed")
        raise UserError(f"{directory}: no checkpoint")
    try:
        with open(mp) as f:
            manifest = json.load(f)
        files = manifest["files"]
        assert isinstance(files, dict) and all("sha256" in v for v in files.values())
    except (OSError, ValueError, KeyError, TypeError, AssertionError):
        raise UserError(f"{mp}: unreadable checkpoint manifest (damaged or edited)") from None
    # roll forward a commit whose files were not all switched in (a crash during step 3)
    for name, meta in files.items():
        pend = _pending(directory, name)
        if os.path.exists(pend) and sha256_file(pend) == meta["sha256"]:
            os.replace(pend, os.path.join(directory, name))
    return manifest


def verify(directory: str) -> dict:
    """Check every file of the committed checkpoint against the manifest; returns the manifest.

    Raises:
        UserError: naming the first file that is missing or whose checksum differs.
    """
    manifest = read_manifest(directory)
    for name, meta in manifest["files"].items():
        p = os.path.join(directory, name)
        if not os.path.isfile(p):
            raise UserError(f"{p}: missing from the checkpoint (listed in {MANIFEST})")
        if os.path.getsize(p) != meta.get("bytes", os.path.getsize(p)) or sha256_file(p) != meta["sha256"]:
            raise UserError(f"{p}: checksum mismatch with {MANIFEST} (the file is damaged or was edited)")
    return manifest


def load(directory: str) -> dict:
    """The engine state of the verified checkpoint in ``directory``.

    Raises:
        UserError: a file is missing, damaged or edited, or the state cannot be read.
    """
    verify(directory)
    try:
        return torch.load(path(directory), map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, OSError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError) as exc:
        raise UserError(f"{path(directory)}: unreadable checkpoint ({type(exc).__name__})") from None


def step_of(directory: str) -> int:
    """The step of the committed checkpoint (0 when there is none)."""
    if not exists(directory):
        return 0
    return int(read_manifest(directory).get("step", 0))
