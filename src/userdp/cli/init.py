"""``userdp init DATAFILE [--user-field F --text-field F] [--public-text PATH] [--output CONFIG.yaml]``.

Writes a commented starting config for the user's own file (JSONL, CSV, Parquet or a saved
Hugging Face dataset): it reads the file once, as training will (so a bad file fails here, with
the same one-line errors), guesses the user and text fields when they are not given, and fills
in the settings that follow from the data's shape. Reading the file is a touch of the data by
the data holder, before training; nothing of it is written to the config but field names and
counts.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import sys
import tempfile
from pathlib import Path

import pyarrow.parquet as pq

from userdp.data.acquire import read_public_file
from userdp.data.sources import Fields, detect_format, is_gzip, open_source
from userdp.data.stats import corpus_stats
from userdp.data.store import build_store
from userdp.errors import UserError
from userdp.fileio import write_atomic

#: the fewest users a config is written for (training holds one out and trains on the rest)
MIN_USERS = 2
USER_FIELDS = ("user", "user_id", "userid", "author", "author_id", "username", "speaker", "sender", "owner")
TEXT_FIELDS = ("text", "body", "message", "content", "msg", "post", "comment")


def _first_record_fields(path: Path, fmt: str) -> list[str]:
    """Field names of the first record (JSONL object keys, CSV header, Parquet/HF columns)."""
    if fmt == "jsonl":
        opener = gzip.open if is_gzip(path) else open
        # utf-8-sig: a byte-order mark before the first line is dropped, as the reader drops it
        with opener(path, "rt", encoding="utf-8-sig", errors="replace") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise UserError(
                            f"{path}:line {lineno}: not valid JSON ({exc.msg}); the first record must be a JSON object"
                        ) from None
                    if not isinstance(obj, dict):
                        raise UserError(f"{path}:line {lineno}: a JSON {type(obj).__name__}, not an object with fields")
                    return list(obj)
        return []
    if fmt == "csv":
        with open(path, newline="", encoding="utf-8-sig", errors="replace") as f:
            return next(csv.reader(f), [])
    if fmt == "parquet":
        try:
            return list(pq.read_schema(path).names)
        except Exception:  # noqa: BLE001 - the reader below gives the one-line error
            return []
    return []


def _guess(fields: list[str], candidates: tuple[str, ...], what: str, flag: str, path: Path) -> str:
    lower = {f.lower(): f for f in fields}
    for c in candidates:
        if c in lower:
            return lower[c]
    raise UserError(
        f"{path}: cannot tell which field holds the {what} (fields: {', '.join(fields) or 'none'}); give {flag}"
    )


def _yaml_str(x: str) -> str:
    return json.dumps(str(x))  # a JSON string is a valid YAML scalar


def build_config(
    path: Path, fmt: str, user_field: str, text_field: str, public: str | None, stats: dict, name: str = "CONFIG.yaml"
) -> str:
    """The commented YAML for ``path`` with the counts in ``stats`` (users, records, records_per_user)."""
    users, records = stats["users"], stats["records"]
    med = stats["records_per_user"]["median"]
    g = int(max(1, min(64, round(med))))
    heldout = 0.1 if users >= 200 else 0.2
    train_users = int(users * (1 - heldout))
    cohort = max(1, min(64, train_users // 10))
    dn = max(train_users, 2) ** -1.1  # the default delta (privacy.delta: null) at about this N
    lines = [
        f"# userdp training config for {path} (written by `userdp init`)",
        f"# The file holds {users:,} users and {records:,} records (median {med:g} records per user).",
        "# Every value below can be changed here or with --set key=value; `userdp train --print-config`",
        f"# shows the resolved config. Run:  userdp train {name}",
        "",
        "data:",
        f"  source: {fmt}",
        f"  path: {_yaml_str(str(path))}",
        f"  user_field: {_yaml_str(user_field)}        # one user = one person: the privacy unit",
        f"  text_field: {_yaml_str(text_field)}",
        f"  heldout_users: {heldout}                 # users kept out of training, for evaluation",
        "  max_eval_users: 150         # evaluate on at most this many held-out users (null: all of them)",
    ]
    if public:
        lines.append(
            f"  public_path: {_yaml_str(public)}   # text DECLARED PUBLIC: trains the tokenizer and "
            "pretrains the model, outside the guarantee"
        )
    else:
        lines += [
            "  public_path: null   # TODO: a .txt (documents separated by blank lines) or .jsonl file of",
            "                      # text you declare public; the tokenizer and the starting model are",
            "                      # trained on it, never on the private records (see README, 'Your own data')",
        ]
    lines += [
        "tokenizer:",
        "  vocab_size: 2048",
        "  seq_len: 64                 # tokens per record (longer records are truncated)",
        "model:",
        "  preset: tiny                # or path: a local AutoModelForCausalLM folder (declared public)",
        "  pretrain: true              # pretrain on the public text first (cached; the first run's main cost)",
        "  pretraining:",
        "    steps: 400                # non-private pretraining on the public text; fewer = a faster first run",
        "    batch_size: 32",
        "    lr: 0.003",
        "privacy:",
        "  epsilon: 3.0                # user-level (epsilon, delta)",
        f"  delta: null                 # null = N^-1.1 for the N training users: about {dn:.2g} = "
        f"{dn * train_users:.2g}/N",
        "                              # here; a mechanism that publishes one random user's data outright is",
        "                              # (0, 1/N)-DP, so delta must be far below 1/N. The report also states",
        "                              # epsilon at delta = 1e-6; a fixed delta may be set here instead",
        "  disclosed_touches:          # non-private touches of the data made by `userdp init` (the report lists them)",
        "    - "
        + _yaml_str(
            f"userdp init: the per-user record counts of all {users:,} users were read to set "
            f"training.group_size G = {g} (their exact median, not private) and "
            f"training.cohort_size = {cohort} (from the user count, not private)"
        ),
        "training:",
        "  algorithm: uls              # uls (users sampled, per-user clipping), els or fedavg; nonprivate is",
        "                              # the baseline to compare with (same users per step and records per",
        "                              # user, no clipping, no noise, no guarantee)",
        f"  group_size: {g}              # G: records per user per step (the median here)",
        f"  cohort_size: {cohort}             # expected users per step (of {train_users:,} training users)",
        "  steps: 100                  # DP steps; sigma is calibrated so that all of them meet epsilon",
        "  lr: 0.001",
        "  clip_norm: 1.0              # C: each user's (ULS) or record's (ELS) update is clipped to this norm",
        "  checkpoint_every: 25        # resume with `userdp train --resume RUN_DIR`",
        "eval:",
        "  before: true                # also evaluate the starting model (a before/after comparison)",
        "output:",
        "  cache: run                  # keep cached copies of this data inside the run directory",
    ]
    return "\n".join(lines) + "\n"


def _run(args: argparse.Namespace) -> int:
    path = Path(args.datafile)
    fmt = args.format or detect_format(str(path))
    if fmt not in ("jsonl", "csv", "parquet", "hf"):
        raise UserError(
            f"{path}: `userdp init` writes configs for JSONL, CSV, Parquet or saved Hugging Face "
            f"data (this is {fmt}; see examples/ for Stack Exchange and Shakespeare)"
        )
    if args.public_text is not None:  # read as training will read it: init accepts what train accepts
        docs = read_public_file(args.public_text, args.text_field or "text")
        if not docs:
            raise UserError(
                f"--public-text {args.public_text}: holds no text (training needs public text for "
                "the tokenizer and the starting model)"
            )
    out = Path(args.output)
    if out.exists():
        raise UserError(f"--output {out}: exists; choose another name (nothing was overwritten)")
    if not out.absolute().parent.is_dir():
        raise UserError(f"--output {out}: the folder {out.absolute().parent} does not exist (create it first)")
    fields = _first_record_fields(path, fmt) if path.is_file() else []
    uf = args.user_field or _guess(fields, USER_FIELDS, "user", "--user-field", path)
    tf = args.text_field or _guess(fields, TEXT_FIELDS, "text", "--text-field", path)
    print(f"reading {path} ({fmt}, user field {uf!r}, text field {tf!r}) ...", file=sys.stderr)
    source = open_source(str(path), fmt, fields=Fields(uf, tf))
    with tempfile.TemporaryDirectory(prefix="userdp-init-") as tmp:
        stats = corpus_stats(build_store(source, Path(tmp) / "store").store)
    if stats["users"] < MIN_USERS:
        raise UserError(
            f"{path}: holds {stats['users']} user(s); training needs at least {MIN_USERS} (one held out "
            f"for evaluation, one to train on), and a guarantee about one user among so few says little"
        )
    text = build_config(path, fmt, uf, tf, args.public_text, stats, str(out))
    # exclusive: of two inits racing for one --output, the second is refused (it overwrote the first)
    write_atomic(out, text, exclusive=True)  # a failed write leaves no file (it left a 0-byte config)
    print(
        f"wrote {out}: {stats['users']:,} users, {stats['records']:,} records. Next: "
        f"userdp plan {out} --compute-budget 64   or   userdp train {out}",
        file=sys.stderr,
    )
    if args.public_text is None:
        print("note: no --public-text given; set data.public_path in the config before training", file=sys.stderr)
    return 0


def register(p) -> None:
    p.description = __doc__.split("\n\n")[1].replace("\n", " ")
    p.add_argument("datafile", help="a JSONL[.gz], CSV, Parquet file or saved Hugging Face dataset folder")
    p.add_argument("--format", choices=["jsonl", "csv", "parquet", "hf"], help="default: from the name or contents")
    p.add_argument("--user-field", help="field naming the user (default: guessed: user, author, ...)")
    p.add_argument("--text-field", help="field holding the text (default: guessed: text, body, message, ...)")
    p.add_argument(
        "--public-text",
        metavar="PATH",
        help="text you declare public, for the tokenizer and pretraining (.txt or .jsonl)",
    )
    p.add_argument(
        "--output",
        default="userdp.yaml",
        metavar="CONFIG.yaml",
        help="config to write (default: userdp.yaml; never overwritten)",
    )
    p.set_defaults(func=_run)
