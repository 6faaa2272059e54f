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

A sharded run (``sharding: fsdp``) adds a folder of ``torch.distributed.checkpoint`` files,
``shards-<step>/``: every rank writes its own shards of the weights and the optimizer's states there
(:func:`userdp.engine.distributed.sharding.save_shards`), under the pending name ``.shards-<step>.pending/``; each
file is listed in the manifest like the others (``shards-<step>/__0_0.distcp``, ...), the folder is
switched in with the files, and the previous step's folder is removed after the commit.

An unseeded run's random states are secret — whoever holds them could subtract the noise — so
they are never saved, and a resumed unseeded run draws fresh entropy.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import zipfile
from collections.abc import Callable, Mapping

import torch

from userdp.errors import UserError
from userdp.fileio import failure_text, free_space, fsync_path, is_writer_failure, sha256_file

CHECKPOINT = "checkpoint.pt"
MANIFEST = "MANIFEST.json"
Writer = Callable[[str], None]
#: what a sharded run's checkpoint.pt holds in place of an optimizer state kept in its shards
IN_SHARDS = "in shards-<step>/"


def path(directory: str) -> str:
    """The engine state file of the checkpoint in ``directory``."""
    return os.path.join(directory, CHECKPOINT)


def manifest_path(directory: str) -> str:
    return os.path.join(directory, MANIFEST)


def exists(directory: str) -> bool:
    """Whether ``directory`` holds a checkpoint (committed, or a lone legacy checkpoint.pt)."""
    return os.path.exists(manifest_path(directory)) or os.path.exists(path(directory))


_SHARDS = re.compile(r"^shards-\d{8}$")


def _pending(directory: str, name: str) -> str:
    """Where ``name`` is written before the commit: ``.NAME.pending``, or for a file of a folder
    (``shards-<step>/FILE``) that file in the folder's pending name."""
    top, _, rest = name.partition("/")
    return os.path.join(directory, f".{top}.pending", rest) if rest else os.path.join(directory, f".{name}.pending")


def shards_folder(step: int) -> str:
    """The name of a sharded run's folder of ``torch.distributed.checkpoint`` files at ``step``."""
    return f"shards-{int(step):08d}"


def pending_folder(directory: str, folder: str) -> str:
    """Where the ranks write ``folder`` (:func:`shards_folder`) before the commit."""
    return os.path.join(directory, f".{folder}.pending")


def save(
    directory: str, state: dict, extra: Mapping[str, Writer] | None = None, shards: tuple[str, dict] | None = None
) -> None:
    """Write a checkpoint: ``state`` as ``checkpoint.pt`` plus ``extra`` files (name -> a function
    that writes that file at the path it is given), committed as one unit. ``shards``: a sharded
    run's ``(folder, {file: {"sha256", "bytes"}})``, files every rank has already written in
    :func:`pending_folder` (committed with the rest; removed if the rest cannot be written).

    Raises:
        UserError: the files could not be written (e.g. the disk is full); the previous checkpoint
            is left intact and no partial file remains.
    """
    os.makedirs(directory, exist_ok=True)
    writers: dict[str, Writer] = {CHECKPOINT: lambda p: torch.save(state, p)}
    writers.update(extra or {})
    written: list[str] = [pending_folder(directory, shards[0])] if shards else []
    tmp_manifest = os.path.join(directory, f".{MANIFEST}.pending")
    try:
        files = {f"{shards[0]}/{name}": meta for name, meta in shards[1].items()} if shards else {}
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
        _remove(written)
        if not is_writer_failure(exc, any_runtime_error=True):
            raise
        # torch.save's RuntimeError on a full disk, safetensors' error, an OSError: one line; the
        # ledger's journal already counts the steps, so the run resumes from the previous checkpoint
        raise UserError(
            f"{directory}: could not write the checkpoint at step {state.get('step')} "
            f"({exc.strerror if isinstance(exc, OSError) and exc.strerror else failure_text(exc)}"
            f"{free_space(directory)}); the previous checkpoint is intact: free "
            "space and resume the run"
        ) from None
    except BaseException:
        _remove(written)
        raise
    os.replace(tmp_manifest, manifest_path(directory))  # the commit
    fsync_path(directory)
    _switch(directory, manifest)


def _remove(paths: list[str]) -> None:
    for p in paths:
        if os.path.isdir(p):
            shutil.rmtree(p, ignore_errors=True)
        elif os.path.exists(p):
            os.unlink(p)


def _switch_folder(directory: str, folder: str) -> None:
    """The pending ``folder`` in place of a committed one of that name (a checkpoint saved twice at
    one step: the second replaces the first)."""
    final = os.path.join(directory, folder)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(pending_folder(directory, folder), final)


def _switch(directory: str, manifest: dict) -> None:
    folders = {name.partition("/")[0] for name in manifest["files"] if "/" in name}
    for name in manifest["files"]:
        pend = _pending(directory, name)
        if "/" not in name and os.path.exists(pend):
            os.replace(pend, os.path.join(directory, name))
    for folder in folders:  # a folder is switched whole (its files were checked by the writers)
        if os.path.isdir(pending_folder(directory, folder)):
            _switch_folder(directory, folder)
    for entry in os.listdir(directory):  # the previous checkpoint's shards, or a failed write's
        bare = entry[1 : -len(".pending")] if entry.startswith(".") and entry.endswith(".pending") else entry
        if _SHARDS.match(bare) and bare not in folders:
            shutil.rmtree(os.path.join(directory, entry), ignore_errors=True)
    fsync_path(directory)


def read_manifest(directory: str) -> dict:
    """The committed manifest, after rolling a half-switched checkpoint forward.

    Raises:
        UserError: the manifest is missing (while a checkpoint file exists) or unreadable.
    """
    mp = manifest_path(directory)
    if not os.path.exists(mp):
        if os.path.exists(path(directory)):
            raise UserError(
                f"{mp}: missing, so {path(directory)} cannot be verified (deleted, or the "
                "checkpoint was written by an older userdp); the run cannot be resumed"
            )
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
        if "/" not in name and os.path.exists(pend) and sha256_file(pend) == meta["sha256"]:
            os.replace(pend, os.path.join(directory, name))
    for folder in {name.partition("/")[0] for name in files if "/" in name}:
        if os.path.isdir(pending_folder(directory, folder)) and all(
            os.path.isfile(_pending(directory, n)) and sha256_file(_pending(directory, n)) == m["sha256"]
            for n, m in files.items()
            if n.partition("/")[0] == folder
        ):
            _switch_folder(directory, folder)
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
