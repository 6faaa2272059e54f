"""Small file primitives shared by the checkpoint, the ledger journal and the caches."""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

from userdp.errors import UserError


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's content, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file, or a directory (so that a rename or a new file in it is durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


MANIFEST = "MANIFEST.json"


def write_manifest(directory: str | os.PathLike, name: str = MANIFEST, exclude: tuple[str, ...] = ()) -> dict:
    """Write ``directory/MANIFEST.json``: the sha256 and size of every file under it (recursively;
    ``exclude``: top-level names left out, e.g. a derived file rewritten later), written to a
    temporary name, fsynced and renamed. Returns the manifest."""
    root = os.fspath(directory)
    files = {}
    for base, _, names in os.walk(root):
        for n in sorted(names):
            p = os.path.join(base, n)
            rel = os.path.relpath(p, root)
            if rel == name or n.endswith(".tmp") or rel in exclude:
                continue
            files[rel] = {"sha256": sha256_file(p), "bytes": os.path.getsize(p)}
    manifest = {"format": 1, "files": files}
    tmp = os.path.join(root, name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, name))
    return manifest


def verify_manifest(directory: str | os.PathLike, name: str = MANIFEST, *, accept_pending: bool = False) -> None:
    """Check every file ``directory/MANIFEST.json`` lists against its sha256 and size.

    ``accept_pending``: a checkpoint committed but not yet switched holds the new file under
    ``.NAME.pending`` (userdp.engine.checkpoint); it counts when it matches.

    Raises:
        UserError: naming the manifest (missing, unreadable) or the first file that is missing or
            differs."""
    root = os.fspath(directory)
    mp = os.path.join(root, name)
    try:
        with open(mp) as f:
            files = json.load(f)["files"]
        assert isinstance(files, dict) and all(isinstance(v, dict) and "sha256" in v for v in files.values())
    except FileNotFoundError:
        raise UserError(f"{mp}: missing, so the files in {root} cannot be verified") from None
    except (OSError, ValueError, KeyError, TypeError, AssertionError, RecursionError):
        raise UserError(f"{mp}: unreadable manifest (damaged or edited)") from None
    for rel, meta in files.items():
        p = os.path.join(root, rel)
        candidates = [p] + ([os.path.join(os.path.dirname(p), f".{os.path.basename(p)}.pending")]
                            if accept_pending else [])
        ok = False
        for c in candidates:
            if os.path.isfile(c) and os.path.getsize(c) == meta.get("bytes", os.path.getsize(c)) \
                    and sha256_file(c) == meta["sha256"]:
                ok = True
                break
        if not ok:
            if not os.path.isfile(p):
                raise UserError(f"{p}: missing (listed in {mp})")
            raise UserError(f"{p}: checksum mismatch with {mp} (the file is damaged or was edited)")


def strict(obj: Any) -> Any:
    """``obj`` made valid JSON: JSON has no Infinity or NaN, so a non-finite number becomes the
    string ``"inf"``, ``"-inf"`` or ``"nan"`` (``float()`` reads them back); numpy scalars and
    arrays become numbers and lists, paths strings. Every file userdp writes and every ``--json``
    output goes through it."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else ("nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf"))
    if isinstance(obj, dict):
        return {str(k): strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "item") and hasattr(obj, "dtype") and getattr(obj, "ndim", 1) == 0:  # numpy scalar
        return strict(obj.item())
    if hasattr(obj, "tolist"):  # numpy array
        return strict(obj.tolist())
    return obj


def strict_dumps(obj: Any, **kwargs) -> str:
    """``json.dumps`` of :func:`strict` ``(obj)``; other types via ``str``; never NaN or Infinity."""
    return json.dumps(strict(obj), allow_nan=False, default=str, **kwargs)
