"""``userdp cache info|clear``: see and remove what userdp keeps on disk between runs.

The cache (``$USERDP_CACHE``, else ``~/.cache/userdp``) holds, by kind:
* ``stores/`` — user-grouped stores: a raw copy of every record of the data (**private**);
* ``tokenized/`` — token ids of the records (**private**);
* ``perplexity/`` — per-record perplexity scores (**private**);
* ``pretrained/`` — tokenizers and models pretrained on text declared public.

``output.cache: run`` in a training config keeps a run's caches inside its run directory
instead (``<run>/cache``), so that deleting the run deletes every copy of the data;
``output.cache: FOLDER`` keeps them in a folder the project's runs, plans and evaluations share.
``cache info`` lists those too (``elsewhere``), and counts them as private data at rest;
``cache clear`` leaves them to their runs and projects (delete the folder to remove them).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from userdp.caches import cache_root, local_caches
from userdp.cli import jsonout
from userdp.errors import UserError
from userdp.fileio import OWNED_MARK, is_owned, remove_owned

KINDS = {"stores": True, "tokenized": True, "perplexity": True, "pretrained": False}  # kind -> private


def _size(path: Path) -> int:
    return (
        sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and p.name != OWNED_MARK) if path.is_dir() else 0
    )


#: an entry of a userdp cache kind: ``<kind>-<hex key>`` (or an interrupted build's ``.<entry>.tmp<pid>``)
_ENTRY = re.compile(r"^(?:[A-Za-z0-9_.]+-[0-9a-f]{12,}|\..+\.tmp\d+)$")


def _made_by_an_older_userdp(d: Path) -> bool:
    """Whether ``d`` (a cache kind folder without the marker, from a userdp before markers) holds
    nothing but userdp's own entries: folders named as userdp names them, each with a file userdp
    writes. A folder with anything else (a user's file) is not userdp's."""
    entries = list(d.iterdir())
    return bool(entries) and all(
        e.is_dir()
        and not e.is_symlink()
        and _ENTRY.match(e.name)
        and (e.name.startswith(".") or any(e.glob("*.json")) or (e / "scores.npy").is_file())
        for e in entries
    )


def info(root: Path, local: list[Path] = ()) -> dict:
    """What the cache at ``root`` holds: per kind, the entries, bytes and whether it is private; and
    the private caches userdp made elsewhere (``local``: run-local ``<run>/cache`` and project
    folders of ``output.cache``), which count as private data at rest too."""
    kinds = {}
    for kind, private in KINDS.items():
        d = root / kind
        # (a pretraining's lock file, `.<entry>.lock`, is not an entry)
        entries = (
            sorted(p.name for p in d.iterdir() if p.name != OWNED_MARK and not p.name.endswith(".lock"))
            if d.is_dir()
            else []
        )
        kinds[kind] = {"entries": len(entries), "bytes": _size(d), "private": private, "path": str(d)}
    elsewhere = [{"path": str(p), "bytes": sum(_size(p / k) for k, private in KINDS.items() if private)} for p in local]
    return {
        "root": str(root),
        "exists": root.is_dir(),
        "kinds": kinds,
        "local": elsewhere,
        "private_bytes": sum(k["bytes"] for k in kinds.values() if k["private"]) + sum(x["bytes"] for x in elsewhere),
    }


def _human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def _run(args: argparse.Namespace) -> int:
    root = cache_root()
    if args.action == "info":
        rep = info(root, local_caches())
        if args.json:
            print(jsonout.dumps(rep))
            return 0
        print(f"cache: {root}" + ("" if rep["exists"] else " (empty)"))
        for kind, k in rep["kinds"].items():
            label = "PRIVATE: derived from the training data" if k["private"] else "public text only"
            print(f"  {kind:<11} {k['entries']:>4} entries  {_human(k['bytes']):>10}  ({label})")
        for x in rep["local"]:  # run-local and project caches (output.cache: run or a folder)
            print(f"  elsewhere   {_human(x['bytes']):>23}  (PRIVATE: {x['path']})")
        print(
            f"  private data at rest: {_human(rep['private_bytes'])}; remove it with `userdp cache clear "
            "--private-only`, or set output.cache: run to keep it inside each run directory"
        )
        return 0
    kinds = [k for k, private in KINDS.items() if private or not args.private_only]
    for kind in kinds:  # checked before anything is removed: only folders userdp marked as its own
        d = root / kind
        if d.is_symlink():
            raise UserError(
                f"{d}: a symbolic link; `cache clear` does not follow links to delete "
                f"(remove the link and what it points to yourself; nothing was removed)"
            )
        if d.exists() and not d.is_dir():
            raise UserError(f"{d}: not a folder; nothing was removed")
        if d.is_dir() and not is_owned(d) and not _made_by_an_older_userdp(d):
            raise UserError(
                f"{d}: not marked as userdp's ({OWNED_MARK} is missing: a folder of yours, or a cache "
                "of a userdp before 0.4); nothing was removed: remove it yourself if it is userdp's"
            )
    removed = 0
    for kind in kinds:
        d = root / kind
        if d.is_dir():
            removed += _size(d)
            if not is_owned(d):  # an older userdp's cache, recognised entry by entry: marked now, then removed
                (d / OWNED_MARK).write_text("written by userdp: recognised as an older userdp's cache\n")
            remove_owned(d, "cache")
    print(f"removed {', '.join(kinds)} from {root} ({_human(removed)})", file=sys.stderr)
    return 0


def register(p) -> None:
    p.description = __doc__.split("\n\n")[0]
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    i = sub.add_parser("info", help="what the cache holds, by kind, and which kinds are private")
    i.add_argument("--json", action="store_true", help="print one JSON object")
    c = sub.add_parser("clear", help="remove the cache (the private kinds, or everything)")
    c.add_argument(
        "--private-only",
        action="store_true",
        help="keep the models pretrained on public text; remove stores, tokenized data and scores",
    )
    p.set_defaults(func=_run)
