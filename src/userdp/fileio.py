"""Small file primitives shared by the checkpoint, the ledger journal and the caches, and the
one way userdp writes a file (:func:`write_atomic`) or a folder (:func:`atomic_dir`).

Every write of a run directory, a cache, a plan, a config or tuning state goes through those two:
the new content is written under a temporary name in the same folder, fsynced and renamed over
the target, so that a reader sees the old file or the new one, never half of one. A failure (a
full disk, no permission, a read-only file system, a file where a folder is expected, a dangling
symbolic link) removes the temporary and becomes one line naming the path (:func:`os_error`).
A file the running command read as input (:func:`note_input`) is never overwritten.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import shutil
import stat
from collections.abc import Callable, Iterator
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
    temporary name, fsynced and renamed (:func:`write_atomic`). Returns the manifest."""
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
    write_atomic(os.path.join(root, name), json.dumps(manifest, indent=1, sort_keys=True))
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
        candidates = [p] + (
            [os.path.join(os.path.dirname(p), f".{os.path.basename(p)}.pending")] if accept_pending else []
        )
        ok = False
        for c in candidates:
            if (
                os.path.isfile(c)
                and os.path.getsize(c) == meta.get("bytes", os.path.getsize(c))
                and sha256_file(c) == meta["sha256"]
            ):
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


# ------------------------------------------------------------------------------ one way to write

_REASONS = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "a read-only file system",
    errno.ENOTDIR: "a file is where a folder is expected",
    errno.EISDIR: "a folder is where a file is expected",
    errno.ENOENT: "a folder on the way is missing or a symbolic link dangles",
    errno.ELOOP: "a loop of symbolic links",
    errno.ENAMETOOLONG: "the name is too long",
    errno.EFBIG: "the file is too large for the file system",
    errno.EIO: "an input/output error of the disk",
}

#: the errors of the environment (not of userdp) that the CLI reports in one line
ENVIRONMENT_ERRNOS = frozenset(_REASONS)

_INPUTS: set[str] = set()


def os_error(path: str | os.PathLike, exc: OSError, doing: str = "cannot write it") -> UserError:
    """One line for an ``OSError`` met at ``path``: ``"<path>: <doing> (<reason>)"``; a full disk
    or quota also says how much space is free there."""
    reason = _REASONS.get(exc.errno) or exc.strerror or str(exc)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        reason += free_space(path)
    return UserError(f"{os.fspath(path)}: {doing} ({reason})")


def free_space(path: str | os.PathLike) -> str:
    """``"; N MB free"`` on the file system of ``path`` (its nearest existing folder), or ``""``."""
    p = Path(os.fspath(path)).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        free = shutil.disk_usage(p).free
    except OSError:
        return ""
    return f"; {free / 2**20:.1f} MB free there"


#: what torch's and other writers' RuntimeErrors say when a write failed (a full disk, a quota)
_WRITE_FAILURE_TEXT = (
    "unexpected pos",
    "failed writing",
    "PytorchStreamWriter",
    "No space left",
    "quota",
    "File too large",
    "Input/output error",
)


def is_writer_failure(exc: BaseException, *, any_runtime_error: bool = False) -> bool:
    """Whether ``exc`` is how a writer library reports a failed write: an ``OSError``, torch's
    ``RuntimeError`` ("unexpected pos", "failed writing file") or safetensors' ``SafetensorError``
    (a full disk, a vanished folder). userdp's own ``UserError`` is not one: it passes through.
    ``any_runtime_error``: the code that raised is a writer and nothing else (a callable given to
    :func:`write_atomic`, a checkpoint's file writers), so any ``RuntimeError`` is its failure;
    otherwise (the body of :func:`atomic_dir`, which computes too) only one whose text says so."""
    if isinstance(exc, UserError):
        return False
    if isinstance(exc, OSError) or "safetensor" in type(exc).__name__.lower():
        return True
    return isinstance(exc, RuntimeError) and (any_runtime_error or any(t in str(exc) for t in _WRITE_FAILURE_TEXT))


def failure_text(exc: BaseException) -> str:
    """``"<Type>: <first line of the message>"`` (160 characters at most): a library error in one line."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:160]}" if text else type(exc).__name__


def writer_error(path: str | os.PathLike, exc: BaseException) -> UserError:
    """One line for a writer library's own failure (``torch.save``'s ``RuntimeError`` "unexpected
    pos" on a full disk, pyarrow's ``OSError``), naming the path and the free space."""
    if isinstance(exc, OSError) and exc.errno is not None:
        return os_error(path, exc)
    return UserError(f"{os.fspath(path)}: cannot write it ({failure_text(exc)}{free_space(path)}; is the disk full?)")


def path_within(inner: str | os.PathLike, outer: str | os.PathLike) -> bool:
    """Whether ``inner`` is ``outer`` or lies inside it, links resolved."""
    a, b = os.path.realpath(inner), os.path.realpath(outer)
    return a == b or a.startswith(b.rstrip(os.sep) + os.sep)


def read_input(path: str | os.PathLike, what: str, *, binary: bool = False) -> str | bytes:
    """The contents of the input file ``path``: the one opener of every file a command reads whole
    (a config, a plan, a search space, the public text, a secrets file). ``what`` names it in
    messages (``"--plan x.json"``). A pipe, socket or device is refused at once, never read (it
    would block forever, or be read once); the file is opened non-blocking and checked on the
    open descriptor, so that a path swapped for a pipe in between cannot hang the command either.
    Text is UTF-8 (a byte-order mark is dropped); a bad byte is named by its line. The path is
    recorded as an input (:func:`note_input`).

    Raises:
        UserError: one line naming ``what``: missing, a folder, not a regular file, unreadable,
            or not UTF-8."""
    p = os.fspath(path)
    if os.path.isdir(p):
        raise UserError(f"{what}: a folder, not a file")
    if not os.path.lexists(p):
        raise UserError(f"{what}: no such file")
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise os_error(what, exc, "cannot read it") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UserError(
                f"{what}: not a regular file (a pipe, socket or device); save it to a file and give its path"
            )
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        with os.fdopen(fd, "rb") as f:
            fd = -1
            data = f.read()
    except OSError as exc:
        raise os_error(what, exc, "cannot read it") from None
    finally:
        if fd >= 0:
            os.close(fd)
    note_input(p)
    if binary:
        return data
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise UserError(f"{what}: line {line}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


#: the file userdp writes into every folder it owns (a cache kind, a store): what may be deleted
OWNED_MARK = ".userdp-owned"


def owned_dir(path: str | os.PathLike) -> Path:
    """``path`` created if absent and marked as userdp's own (:data:`OWNED_MARK`): a folder that
    :func:`remove_owned` may later delete. An existing folder is marked only if it is empty or
    already marked: userdp never claims a folder that holds something of the user's (nor one an
    older userdp filled before markers: ``userdp cache clear`` then names it for the user to remove).

    Raises:
        UserError: ``path`` is not a folder or cannot be written."""
    p = Path(path)
    mark = p / OWNED_MARK
    try:
        p.mkdir(parents=True, exist_ok=True)
        if not mark.is_file() and not any(p.iterdir()):  # a folder that already holds files stays unclaimed
            mark.write_text("written by userdp: this folder and what it holds may be deleted by userdp\n")
    except FileExistsError:
        raise UserError(f"{p}: exists and is not a folder") from None
    except OSError as exc:
        raise os_error(p, exc, "cannot create it") from None
    return p


def unclaimable(path: str | os.PathLike) -> str | None:
    """Why :func:`owned_dir` would not claim ``path`` as userdp's folder (None: it would): a file,
    or a folder that holds files without userdp's marker."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        return "exists and is not a folder"
    if p.is_dir() and not (p / OWNED_MARK).is_file() and any(p.iterdir()):
        return f"holds files userdp did not make (no {OWNED_MARK})"
    return None


def is_owned(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a real folder (not a link) that carries userdp's marker."""
    p = Path(path)
    return p.is_dir() and not p.is_symlink() and (p / OWNED_MARK).is_file()


def remove_owned(path: str | os.PathLike, what: str) -> None:
    """Delete the folder ``path`` only if userdp can prove it wrote it (its marker, not a link)
    and it neither is nor holds a file this command read as input (:func:`note_input`).

    Raises:
        UserError: naming ``what`` and why nothing was deleted."""
    p = Path(path)
    if p.is_symlink():
        raise UserError(f"{what} {p}: a symbolic link; userdp does not follow links to delete; nothing was removed")
    if not p.exists():
        return
    if not is_owned(p):
        raise UserError(
            f"{what} {p}: not marked as written by userdp ({OWNED_MARK}); nothing was removed "
            "(remove it yourself if it is userdp's)"
        )
    for inp in _INPUTS:
        if path_within(inp, p):
            raise UserError(f"{what} {p}: it holds {inp}, an input of this command; nothing was removed")
    try:
        shutil.rmtree(p)
    except OSError as exc:
        raise os_error(p, exc, "cannot remove it") from None


def note_input(path: str | os.PathLike) -> None:
    """Record that the running command read ``path``: :func:`write_atomic` refuses to replace it."""
    _INPUTS.add(os.path.realpath(path))


def forget_inputs() -> None:
    """Start a new command (the CLI calls it before each one)."""
    _INPUTS.clear()


def make_dir(path: str | os.PathLike) -> Path:
    """``mkdir -p path``; a file on the way, no permission or a read-only disk is one line."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UserError(f"{path}: cannot make this folder (a file is where a folder is expected)") from None
    except OSError as exc:
        raise os_error(path, exc, "cannot make this folder") from None
    return path


def _check_target(path: Path, replaces_input: bool = False) -> None:
    if os.path.realpath(path) in _INPUTS and not replaces_input:
        raise UserError(f"{path}: is an input of this command; refusing to overwrite it (write elsewhere)")
    if path.is_symlink() and not path.exists():
        raise UserError(f"{path}: a dangling symbolic link; refusing to write through it")
    if path.is_dir():
        raise UserError(f"{path}: cannot write it (a folder is where a file is expected)")


def _unlink_quietly(p: Path) -> None:
    with contextlib.suppress(OSError):
        p.unlink()


def write_atomic(
    path: str | os.PathLike,
    content: str | bytes | Callable[[str], None],
    *,
    private: bool = False,
    replaces_input: bool = False,
    exclusive: bool = False,
) -> Path:
    """Write ``content`` to ``path`` atomically (temporary in the same folder, fsync, rename,
    fsync of the folder); missing parent folders are made.

    ``content``: text (UTF-8), bytes, or a callable that writes the file at the path it is given
    (``torch.save``, ``safetensors.torch.save_file``, ``matplotlib``'s ``savefig``).
    ``private``: the file is made with mode 0600 (secrets: only its owner may read it).
    ``replaces_input``: the command means to update a file it read (a run directory's own
    config.yaml on resume); otherwise a file the command read is never overwritten.
    ``exclusive``: the file must not exist; of two commands racing for it one wins and the other
    is refused (the new file is linked into place, which fails if the name is taken).

    Raises:
        UserError: one line naming ``path`` (an input of this command, a dangling link, a full disk,
            no permission, a read-only file system, a file where a folder is expected); no
            temporary file is left behind."""
    path = Path(path)
    _check_target(path, replaces_input)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if callable(content):
            content(str(tmp))
            fsync_path(tmp)
        else:
            data = content.encode("utf-8") if isinstance(content, str) else content
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o666)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        if exclusive:
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise UserError(
                    f"{path}: exists (written by another command meanwhile?); nothing was overwritten"
                ) from None
            _unlink_quietly(tmp)
        else:
            os.replace(tmp, path)
        with contextlib.suppress(OSError):
            fsync_path(path.parent)
    except OSError as exc:
        _unlink_quietly(tmp)
        raise os_error(path, exc) from None
    except BaseException as exc:
        _unlink_quietly(tmp)
        if callable(content) and is_writer_failure(exc, any_runtime_error=True):
            raise writer_error(path, exc) from None  # torch.save / safetensors failing mid-write
        raise
    return path


def write_json(path: str | os.PathLike, obj: Any, indent: int | None = 2, *, private: bool = False) -> Path:
    """:func:`write_atomic` of ``obj`` as strict JSON (a non-finite number is "inf" / "nan")."""
    return write_atomic(path, strict_dumps(obj, indent=indent) + "\n", private=private)


def _fsync_tree(root: Path) -> None:
    for base, _, names in os.walk(root):
        for n in names:
            fsync_path(os.path.join(base, n))
        fsync_path(base)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, *, keep_existing: bool = True) -> Iterator[Path]:
    """Build the folder ``path`` under a temporary sibling name (yielded); when the block ends
    without an error its files are fsynced and it is renamed to ``path``.

    ``keep_existing``: a folder already at ``path`` (another process built the same cache entry
    first) is kept and the new one dropped; otherwise it is replaced.

    Raises:
        UserError: one line naming ``path`` for an ``OSError`` in the block or in the rename; the
            temporary folder is removed whatever happens."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        if path.is_symlink() and not path.exists():
            raise UserError(f"{path}: a dangling symbolic link; refusing to write through it")
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        yield tmp
        _fsync_tree(tmp)
        if path.is_dir() and not keep_existing:
            old = path.with_name(f".{path.name}.old{os.getpid()}")
            os.replace(path, old)
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.replace(tmp, path)
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not path.is_dir():
                raise
            # another process made it first: theirs is as good as ours
        with contextlib.suppress(OSError):
            fsync_path(path.parent)
    except OSError as exc:
        raise os_error(path, exc) from None
    except Exception as exc:  # a writer library's own error inside the block (torch.save on a full disk)
        if is_writer_failure(exc):
            raise writer_error(path, exc) from None
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
