"""Where userdp keeps what it derives from data, and the keys it files it under.

Two roots: :func:`cache_root` for what is derived from public text (pretrained tokenizers and
models; ``$USERDP_CACHE``, else ``~/.cache/userdp``), and :func:`private_cache_root` for what is
derived from the private data (user stores, tokenized records, perplexity scores): a run's own
folder, a project's folder, or the shared root (``output.cache``; :func:`private_cache_for`).
:func:`fingerprint` is the short content key every cache entry, and a run's data fingerprint, is
filed under. ``userdp cache info|clear`` shows and removes them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

from userdp.errors import UserError
from userdp.fileio import is_owned, owned_dir, unclaimable, write_json

_CACHE_OVERRIDE: list[Path] = []
_SHARED_RUN_CACHE: list[Path] = []


def cache_root() -> Path:
    """Where userdp caches what it derives from public text (pretrained tokenizers and models):
    ``$USERDP_CACHE``, else ``~/.cache/userdp``. ``userdp cache info|clear`` shows and removes it."""
    env = os.environ.get("USERDP_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "userdp"


def private_cache_root() -> Path:
    """Where userdp caches what it derives from the private data (user stores, tokenized records,
    perplexity scores): a run's own ``<run>/cache`` while a run with ``output.cache: run`` is active
    (a temporary folder during `userdp plan`), else :func:`cache_root`."""
    return _CACHE_OVERRIDE[-1] if _CACHE_OVERRIDE else cache_root()


def run_cache(run_root: Path) -> Path:
    """The private cache of a run with ``output.cache: run``: ``<run>/cache``, or the folder of
    :func:`shared_run_cache` when runs that share a data configuration (a tuning run's trials)
    are made inside one."""
    return _SHARED_RUN_CACHE[-1] if _SHARED_RUN_CACHE else Path(run_root) / "cache"


@contextlib.contextmanager
def shared_run_cache(path: Path):
    """Runs started inside share ``path`` as their ``output.cache: run`` private cache (still in the
    user's chosen directory): their data is read and tokenized once, not once a run."""
    _SHARED_RUN_CACHE.append(Path(path))
    try:
        yield
    finally:
        _SHARED_RUN_CACHE.pop()


#: in the shared cache root: the private caches userdp made elsewhere (run-local ``<run>/cache`` and
#: ``output.cache: <folder>``), so that ``userdp cache info`` can say what private data is at rest
LOCAL_CACHES = "local_caches.json"


def remember_local_cache(path: Path) -> None:
    """Add ``path`` to :data:`LOCAL_CACHES` (best effort: an unwritable shared root loses only the
    listing, never the run)."""
    index = cache_root() / LOCAL_CACHES
    try:
        known = json.loads(index.read_text()) if index.is_file() else []
        known = [str(x) for x in known] if isinstance(known, list) else []
        p = str(Path(path).resolve())
        if p not in known:
            index.parent.mkdir(parents=True, exist_ok=True)
            write_json(index, known + [p])
    except (OSError, ValueError, UserError):
        pass


def local_caches() -> list[Path]:
    """The private caches in :data:`LOCAL_CACHES` that still exist and are userdp's."""
    index = cache_root() / LOCAL_CACHES
    try:
        known = json.loads(index.read_text()) if index.is_file() else []
    except (OSError, ValueError):
        return []
    return [Path(x) for x in known if isinstance(x, str) and is_owned(x)] if isinstance(known, list) else []


def private_cache_for(setting: str, run_root: Path | None) -> Path | None:
    """Where a job with ``output.cache: setting`` keeps the private caches of its data: None for
    ``shared`` (:func:`cache_root`), the run's own for ``run`` (:func:`run_cache`; None without a
    run directory), else the folder ``setting`` names, shared by the runs (and ``plan`` and
    ``evaluate``) of one project. The folder is made and marked as userdp's (:func:`owned_dir`).

    Raises:
        UserError: a file, a folder that holds files userdp did not make, or one that cannot be made."""
    if setting == "shared":
        return None
    if setting == "run":
        if run_root is None:
            return None
        path = run_cache(run_root)
    else:
        path = Path(setting).expanduser()
        why = unclaimable(path)
        if why:
            raise UserError(
                f"output.cache: {path} {why}; give shared, run, or a new or empty folder for the "
                "project's private cache"
            )
    path = owned_dir(path)
    remember_local_cache(path)
    return path


@contextlib.contextmanager
def cache_in(path: Path):
    """Use ``path`` as the private cache root inside the ``with`` block."""
    _CACHE_OVERRIDE.append(Path(path))
    try:
        yield
    finally:
        _CACHE_OVERRIDE.pop()


def fingerprint(*parts) -> str:
    """A 16-hex-digit sha256 key of ``parts`` (lists and tuples item by item, the rest as sorted JSON)."""
    h = hashlib.sha256()
    for p in parts:
        if isinstance(p, (list, tuple)):
            for x in p:
                h.update(str(x).encode("utf-8", "replace"))
                h.update(b"\x00")
        else:
            h.update(json.dumps(p, sort_keys=True, default=str).encode())
        h.update(b"\x01")
    return h.hexdigest()[:16]
