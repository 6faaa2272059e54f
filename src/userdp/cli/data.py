"""``userdp data``: statistics of a user-partitioned corpus, and building a user-grouped store."""

from __future__ import annotations

import tempfile
from pathlib import Path

from userdp.cli import argtypes as A
from userdp.cli import jsonout
from userdp.data.sources import Fields, open_source
from userdp.data.stats import corpus_stats, format_stats, plot_records_per_user
from userdp.data.store import UserStore, build_store
from userdp.data.tokenize import TokenLayout, load_tokenizer, tokenize_store
from userdp.errors import UserError


def _add_source_args(p) -> None:
    p.add_argument(
        "source",
        help="a file (JSONL[.gz], CSV, Parquet), a folder (Stack Exchange dump, saved HF dataset, "
        "built store) or 'shakespeare'",
    )
    p.add_argument(
        "--format",
        choices=["jsonl", "csv", "parquet", "hf", "stackexchange", "shakespeare"],
        help="override the format detected from the name or contents",
    )
    p.add_argument("--user-field", default="user", help="field naming the user (default: user)")
    p.add_argument("--text-field", default="text", help="field holding the text (default: text)")
    p.add_argument("--date-field", default=None, help="optional field holding the record's date")
    p.add_argument("--split", default=None, help="split of a saved Hugging Face DatasetDict")
    p.add_argument("--public-plays", default="", help="shakespeare: comma-separated plays set aside as public text")
    p.add_argument("--sites", default="", help="stackexchange: comma-separated site folders to read (default: all)")
    p.add_argument(
        "--shards", type=A.int_range(1, 4096), default=None, help="number of hash shards for the out-of-core build"
    )


def _open_store(args, out_dir):
    src_path = Path(args.source)
    if args.source != "shakespeare" and (src_path / "meta.json").is_file() and (src_path / "records.arrow").is_file():
        return UserStore(src_path)
    plays = tuple(p for p in args.public_plays.split(",") if p.strip())
    source = open_source(
        args.source,
        args.format,
        fields=Fields(args.user_field, args.text_field, args.date_field),
        split=args.split,
        public_plays=plays,
        sites=tuple(x for x in args.sites.split(",") if x.strip()),
    )
    return build_store(source, out_dir, num_shards=args.shards, overwrite=getattr(args, "overwrite", False)).store


def _stats(args) -> int:
    with tempfile.TemporaryDirectory(prefix="userdp-data-") as tmp:
        store = _open_store(args, Path(tmp) / "store")
        tokenized = None
        if args.tokenizer:
            tok = load_tokenizer(args.tokenizer)
            tokenized = tokenize_store(
                store, tok, TokenLayout(2**30, "full", add_eos=False), cache_dir=Path(tmp) / "tokenized"
            )
        s = corpus_stats(store, tokenized)
        if args.plot:
            plot_records_per_user(
                store.sizes(),
                args.plot,
                title=f"{Path(str(args.source)).name}: {s['users']:,} users, {s['records']:,} records",
            )
        if args.json:
            print(jsonout.dumps(s, indent=1))
        else:
            print(format_stats(s))
            if args.plot:
                print(f"histogram written to {args.plot}")
    return 0


def _build(args) -> int:
    out = Path(args.out)
    if (Path(args.source) / "meta.json").is_file():
        raise UserError(f"{args.source} is already a built store")
    store = _open_store(args, out)
    print(format_stats(corpus_stats(store)))
    print(f"store written to {out} (fingerprint {store.fingerprint})")
    return 0


def register(p) -> None:
    sub = p.add_subparsers(dest="data_command", metavar="SUBCOMMAND")
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])

    s = sub.add_parser("stats", help="users, records, characters, tokens, records per user; histogram")
    _add_source_args(s)
    s.add_argument("--tokenizer", default=None, help="tokenizer.json or tokenizer folder: also count tokens")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.add_argument(
        "--plot", default=None, metavar="FILE.png", type=A.plot_file, help="write a records-per-user histogram"
    )
    s.set_defaults(func=_stats)

    b = sub.add_parser("build", help="build a user-grouped store on disk (out of core)")
    _add_source_args(b)
    b.add_argument("--out", required=True, type=A.output_dir, help="store folder to write")
    b.add_argument("--overwrite", action="store_true", help="replace an existing store folder")
    b.set_defaults(func=_build)
