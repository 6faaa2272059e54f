"""Readers that turn a source (a path or ``shakespeare``) into batches of (user, text, date) records.

A *source* is anything with ``batches(batch_size) -> Iterator[RecordBatch]``, a ``drops``
:class:`~userdp.data.records.DropReport`, ``has_dates``, ``size_hint`` (bytes, for sizing the
out-of-core build) and ``description``. Readers stream: no reader holds more than one batch.

Fail or skip, decided per case (docs/data.md lists them):

- a missing user/text/date field, a null user, text that is not a string, invalid UTF-8, a line
  that is not JSON, a CSV header without the fields: **fail** with a ``UserError`` naming the file,
  the line/row and the field — these mean the command line or the file is wrong, and guessing
  would silently change who the users are;
- a null, empty or whitespace-only text: **skipped and counted** by the store builder (common in
  real dumps, and harmless to drop); blank lines in JSONL are skipped and counted too.
"""

from __future__ import annotations

import codecs
import csv
import dataclasses
import gzip
import io
import json
import os
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from userdp.data.records import DropReport, RecordBatch
from userdp.data.shakespeare import ShakespeareSource
from userdp.data.stackexchange import StackExchangeSource
from userdp.errors import UserError
from userdp.fileio import note_input

FORMATS = ("jsonl", "csv", "parquet", "hf", "stackexchange", "shakespeare")
BLANK_LINES = "jsonl_blank_lines"


def is_gzip(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == b"\x1f\x8b"


def _size_hint(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    size = path.stat().st_size
    return size * 4 if is_gzip(path) else size


def check_readable(path: Path) -> None:
    """A data source must be a regular file or a folder: a pipe or device would be read once and
    lose the bytes the format detection consumed (or block forever).

    Raises:
        UserError: naming the path."""
    if path.exists() and not (path.is_file() or path.is_dir()):
        raise UserError(
            f"{path}: not a regular file (a pipe, socket or device); save the data to a file and give its path"
        )


def detect_format(source: str) -> str:
    """The format of ``source`` from its name, extension or contents (``--format`` overrides)."""
    if source == "shakespeare":
        return "shakespeare"
    path = Path(source)
    if not path.exists():
        raise UserError(f"data source {source!r} does not exist (give a file, a folder or 'shakespeare')")
    check_readable(path)
    if path.is_dir():
        if (path / "Posts.xml").is_file() or any((p / "Posts.xml").is_file() for p in path.iterdir() if p.is_dir()):
            return "stackexchange"
        if (
            (path / "dataset_info.json").is_file()
            or (path / "state.json").is_file()
            or (path / "dataset_dict.json").is_file()
        ):
            return "hf"
        parquet = sorted(path.glob("*.parquet"))
        if parquet:
            return "parquet"
        raise UserError(
            f"{source}: cannot tell the format of this folder (no Posts.xml, no saved Hugging Face "
            "dataset, no .parquet files); pass --format"
        )
    name = path.name.lower()
    for ext in (".gz", ".gzip"):
        if name.endswith(ext):
            name = name[: -len(ext)]
    if name.endswith((".jsonl", ".ndjson", ".json")):
        return "jsonl"
    if name.endswith((".csv", ".tsv")):
        return "csv"
    if name.endswith((".parquet", ".pq")):
        return "parquet"
    # sniff the contents
    opener = gzip.open if is_gzip(path) else open
    with opener(path, "rb") as f:
        head = f.read(4096).lstrip()
    if head[:4] == b"PAR1":
        return "parquet"
    if head[:1] == b"{":
        return "jsonl"
    raise UserError(f"{source}: cannot tell the format from the name or contents; pass --format ({', '.join(FORMATS)})")


@dataclasses.dataclass(frozen=True)
class Fields:
    """Which field of a record (JSONL, CSV, Parquet, a saved HF dataset) names its user, which holds
    its text, and which its date (None: no dates).

    Raises:
        UserError: the user and text fields are one field (every distinct text would become its own
            user), or the date field is one of them."""

    user: str = "user"
    text: str = "text"
    date: str | None = None

    def __post_init__(self):
        if self.user == self.text:
            raise UserError(
                f"--user-field and --text-field are both {self.user!r}: every distinct text "
                "would become its own user, which silently changes the privacy unit"
            )
        if self.date is not None and self.date in (self.user, self.text):
            raise UserError(f"--date-field {self.date!r} is also the user or text field")


def open_source(
    source: str,
    format: str | None = None,
    *,
    fields: Fields | None = None,
    split: str | None = None,
    public_plays: tuple[str, ...] = (),
    sites: tuple[str, ...] = (),
):
    """Open ``source`` (a path, or ``shakespeare``) as a streaming record source. ``fields``: which
    of a record's fields hold its user, text and date (default ``Fields()``: user, text, no date);
    ``split`` a saved HF dataset's split; ``public_plays`` and ``sites`` the bundled sources'."""
    fields = fields or Fields()
    fmt = format or detect_format(source)
    if fmt != "shakespeare" and os.path.exists(source):
        note_input(source)
    if fmt not in FORMATS:
        raise UserError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if fmt == "shakespeare":
        return ShakespeareSource(public_plays=public_plays)
    path = Path(source)
    if not path.exists():
        raise UserError(f"data source {source!r} does not exist")
    check_readable(path)
    if fmt in ("jsonl", "csv") and path.is_dir():
        raise UserError(f"{source}: a folder, not a {fmt.upper()} file")
    if fmt == "stackexchange":
        return StackExchangeSource(path, sites=sites)
    if fmt == "jsonl":
        return JsonlSource(path, fields)
    if fmt == "csv":
        return CsvSource(path, fields)
    if fmt == "parquet":
        return ParquetSource(path, fields)
    return HfDiskSource(path, fields, split=split)


class _FieldSource:
    def __init__(self, path: Path, fields: Fields):
        self.path = Path(path)
        self.user_field = fields.user
        self.text_field = fields.text
        self.date_field = fields.date
        self.has_dates = fields.date is not None
        self.drops = DropReport()
        self.size_hint = _size_hint(self.path)

    @property
    def description(self) -> str:
        return f"{self.kind} {self.path} (user={self.user_field}, text={self.text_field}" + (
            f", date={self.date_field})" if self.date_field else ")"
        )

    def _fields(self) -> list[tuple[str, str]]:
        out = [("user", self.user_field), ("text", self.text_field)]
        if self.date_field:
            out.append(("date", self.date_field))
        return out


def _user_value(v, where: str, field: str) -> str:
    if v is None or (isinstance(v, str) and not v.strip()):
        raise UserError(f"{where}: the user field {field!r} is empty or null (every record needs a user)")
    if isinstance(v, (str, int)) and not isinstance(v, bool):
        return str(v)
    raise UserError(f"{where}: the user field {field!r} must be a string or an integer, got {type(v).__name__}")


def _text_value(v, where: str, field: str) -> str | None:
    if v is None or isinstance(v, str):
        return v
    raise UserError(f"{where}: the text field {field!r} must be a string, got {type(v).__name__}")


def _date_value(v, where: str, field: str) -> str | None:
    if v is None:
        return None
    if isinstance(v, (str, int, float)) and not isinstance(v, bool):
        return str(v)
    return str(v)  # datetime etc.


class _DuplicateKey(ValueError):
    pass


def _no_duplicate_keys(pairs):
    d = dict(pairs)
    if len(d) != len(pairs):
        seen = set()
        for k, _ in pairs:
            if k in seen:
                raise _DuplicateKey(k)
            seen.add(k)
    return d


def _check_unicode(value, where: str, which: str, field: str) -> None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise UserError(
                f"{where}: the {which} field {field!r} holds an unpaired surrogate (invalid Unicode)"
            ) from None


def _first_bad_utf8(path) -> tuple[int, int]:
    """(line, byte within the line), both from 1, of the first byte that is not UTF-8 in the
    (plain or gzip) file; (0, 0) when none is found. The decoder reads ahead in blocks, so its
    own error cannot say which line it met (only the failure path pays for this scan)."""
    opener = gzip.open if is_gzip(path) else open
    decoder = codecs.getincrementaldecoder("utf-8")()
    with opener(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                decoder.decode(raw)
            except UnicodeDecodeError as exc:
                return lineno, exc.start + 1
    return 0, 0


class _TextFileSource(_FieldSource):
    """A line-oriented file, plain or gzip: a damaged or truncated gzip stream is one line naming
    the file. Subclasses implement ``_batches``."""

    def batches(self, batch_size: int = 50_000) -> Iterator[RecordBatch]:
        try:
            yield from self._batches(batch_size)
        except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
            raise UserError(
                f"{self.path}: the compressed data is damaged or truncated ({type(exc).__name__}: {exc})"
            ) from None

    def _batches(self, batch_size: int) -> Iterator[RecordBatch]:
        raise NotImplementedError


class JsonlSource(_TextFileSource):
    """One JSON object per line; plain or gzip (detected from the bytes, not the name).

    Refused, naming the line and field: invalid UTF-8 or JSON, a line that is not an object, a
    repeated key (which value is meant is ambiguous), an unpaired surrogate, a damaged gzip."""

    kind = "jsonl"

    def _batches(self, batch_size: int) -> Iterator[RecordBatch]:
        uf, tf, df = self.user_field, self.text_field, self.date_field
        keys = [json.dumps(k).encode() for k in (uf, tf, df) if k]  # a duplicate of these is ambiguous
        opener = gzip.open if is_gzip(self.path) else open
        fname = str(self.path)
        users: list[str] = []
        texts: list = []
        dates: list | None = [] if df else None
        lines: list[int] = []
        with opener(self.path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                if not raw.strip():
                    self.drops.add(BLANK_LINES, example=f"{fname}:line {lineno}")
                    continue
                try:
                    obj = json.loads(raw)
                    if any(raw.count(k) > 1 for k in keys):  # maybe a field given twice: check exactly
                        json.loads(raw, object_pairs_hook=_no_duplicate_keys)
                except _DuplicateKey as exc:
                    raise UserError(
                        f"{fname}:line {lineno}: the field {exc.args[0]!r} appears twice in one object (ambiguous)"
                    ) from None
                except UnicodeDecodeError as exc:
                    raise UserError(
                        f"{fname}:line {lineno}: invalid UTF-8 ({exc.reason} at byte {exc.start} of the line)"
                    ) from None
                except json.JSONDecodeError as exc:
                    raise UserError(
                        f"{fname}:line {lineno}: not valid JSON ({exc.msg} at column {exc.colno})"
                    ) from None
                if not isinstance(obj, dict):
                    raise UserError(f"{fname}:line {lineno}: expected a JSON object, got {type(obj).__name__}")
                try:
                    u = obj[uf]
                    t = obj[tf]
                    d = obj[df] if df else None
                except KeyError as exc:
                    field = exc.args[0]
                    which = {uf: "user", tf: "text", df: "date"}[field]
                    raise UserError(
                        f"{fname}:line {lineno}: missing {which} field {field!r} (fields here: "
                        f"{', '.join(sorted(map(str, obj))) or 'none'}; use --{which}-field)"
                    ) from None
                where = f"{fname}:line {lineno}"
                if b"\\ud" in raw or b"\\uD" in raw:  # an escaped surrogate: check it is paired
                    _check_unicode(u, where, "user", uf)
                    _check_unicode(t, where, "text", tf)
                users.append(u if type(u) is str and u.strip() else _user_value(u, where, uf))
                texts.append(t if type(t) is str else _text_value(t, where, tf))
                if dates is not None:
                    dates.append(_date_value(d, where, df))
                lines.append(lineno)
                if len(users) >= batch_size:
                    yield RecordBatch(users, texts, dates, lines, fname)
                    users, texts, lines = [], [], []
                    dates = [] if df else None
        if users:
            yield RecordBatch(users, texts, dates, lines, fname)


class CsvSource(_TextFileSource):
    """A CSV (or .tsv) file with a header row naming the fields; plain or gzip."""

    kind = "csv"

    def _batches(self, batch_size: int) -> Iterator[RecordBatch]:
        fname = str(self.path)
        csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
        binary = gzip.open(self.path, "rb") if is_gzip(self.path) else open(self.path, "rb")  # noqa: SIM115 - closed in the finally below
        delim = "\t" if ".tsv" in self.path.name.lower() else ","
        last_row = 0
        try:
            with io.TextIOWrapper(binary, encoding="utf-8-sig", errors="strict", newline="") as f:
                reader = csv.reader(f, delimiter=delim, strict=True)
                try:
                    header = next(reader)
                except StopIteration:
                    raise UserError(f"{fname}: empty CSV file (expected a header row)") from None
                cols = {}
                for which, field in self._fields():
                    if header.count(field) > 1:
                        raise UserError(
                            f"{fname}:line 1: the CSV header names the {which} field {field!r} "
                            f"{header.count(field)} times (ambiguous)"
                        )
                    if field not in header:
                        raise UserError(
                            f"{fname}:line 1: the CSV header lacks the {which} field {field!r} "
                            f"(header: {', '.join(header)}; use --{which}-field)"
                        )
                    cols[which] = header.index(field)
                ui, ti, di = cols["user"], cols["text"], cols.get("date")
                need = max(cols.values())
                users: list[str] = []
                texts: list = []
                dates: list | None = [] if di is not None else None
                lines: list[int] = []
                for row in reader:
                    last_row = reader.line_num
                    if not row:
                        continue  # a blank line is no record in CSV
                    if len(row) != len(header) and len(row) > need:
                        raise UserError(
                            f"{fname}:line {reader.line_num}: the row has {len(row)} fields but "
                            f"the header has {len(header)} (a stray delimiter or quote)"
                        )
                    if len(row) <= need:
                        missing = [w for w, c in cols.items() if c >= len(row)]
                        raise UserError(
                            f"{fname}:line {reader.line_num}: the row has {len(row)} fields and no "
                            f"value for the {missing[0]} field {dict(self._fields())[missing[0]]!r}"
                        )
                    users.append(_user_value(row[ui], f"{fname}:line {reader.line_num}", self.user_field))
                    if "\x00" in row[ti] or "\x00" in row[ui]:
                        raise UserError(
                            f"{fname}:line {reader.line_num}: a NUL byte in the row (a binary or damaged file)"
                        )
                    texts.append(row[ti])
                    if dates is not None:
                        dates.append(row[di] or None)
                    lines.append(reader.line_num)
                    if len(users) >= batch_size:
                        yield RecordBatch(users, texts, dates, lines, fname)
                        users, texts, lines = [], [], []
                        dates = [] if di is not None else None
                if users:
                    yield RecordBatch(users, texts, dates, lines, fname)
        except UnicodeDecodeError as exc:
            line, col = _first_bad_utf8(self.path)
            where = f"line {line}, byte {col}" if line else f"after line {last_row}"
            raise UserError(
                f"{fname}:{where}: invalid UTF-8 ({exc.reason}; a Latin-1 or other non-UTF-8 file? save it as UTF-8)"
            ) from None
        except csv.Error as exc:
            raise UserError(f"{fname}:line {last_row + 1}: malformed CSV ({exc})") from None


class _ArrowSource(_FieldSource):
    line_kind = "row"

    def _check_columns(self, names: list[str], where: str) -> None:
        for which, field in self._fields():
            if field not in names:
                raise UserError(
                    f"{where}: no {which} field {field!r} (columns: {', '.join(names)}; use --{which}-field)"
                )

    def _convert(self, table, where: str, first_row: int) -> RecordBatch:
        def col(field):
            c = table.column(field)
            if pa.types.is_string(c.type) or pa.types.is_large_string(c.type):
                return c.to_pylist()
            if pa.types.is_binary(c.type) or pa.types.is_large_binary(c.type):
                vals = c.to_pylist()
                out = []
                for i, v in enumerate(vals):
                    try:
                        out.append(None if v is None else v.decode("utf-8"))
                    except UnicodeDecodeError as exc:
                        raise UserError(
                            f"{where}:row {first_row + i}: field {field!r} is invalid UTF-8 ({exc.reason})"
                        ) from None
                return out
            return c.to_pylist()

        n = table.num_rows
        raw_users = col(self.user_field)
        users = [
            u if type(u) is str and u.strip() else _user_value(u, f"{where}:row {first_row + i}", self.user_field)
            for i, u in enumerate(raw_users)
        ]
        raw_texts = col(self.text_field)
        texts = [
            t if t is None or type(t) is str else _text_value(t, f"{where}:row {first_row + i}", self.text_field)
            for i, t in enumerate(raw_texts)
        ]
        dates = None
        if self.date_field:
            dates = [None if d is None else str(d) for d in col(self.date_field)]
        return RecordBatch(users, texts, dates, list(range(first_row, first_row + n)), where, "row")


class ParquetSource(_ArrowSource):
    """A Parquet file, or a folder of them (read in name order)."""

    kind = "parquet"

    def batches(self, batch_size: int = 50_000) -> Iterator[RecordBatch]:
        files = sorted(self.path.glob("*.parquet")) if self.path.is_dir() else [self.path]
        for path in files:
            try:
                pf = pq.ParquetFile(path)
            except (pa.ArrowInvalid, OSError) as exc:
                raise UserError(f"{path}: not a readable Parquet file ({exc})") from None
            self._check_columns(pf.schema_arrow.names, str(path))
            cols = [f for _, f in self._fields()]
            row = 0
            try:
                for b in pf.iter_batches(batch_size=batch_size, columns=cols):
                    yield self._convert(pa.Table.from_batches([b]), str(path), row)
                    row += b.num_rows
            except pa.ArrowInvalid as exc:
                raise UserError(f"{path}: after row {row}: {exc}") from None


class HfDiskSource(_ArrowSource):
    """A Hugging Face dataset saved with ``save_to_disk`` (never the hub)."""

    kind = "hf"

    def __init__(self, path: Path, fields: Fields, split: str | None = None):
        super().__init__(path, fields)
        self.split = split

    def _dataset(self):
        import datasets

        try:
            ds = datasets.load_from_disk(str(self.path))
        except Exception as exc:  # datasets raises FileNotFoundError or its own errors
            raise UserError(f"{self.path}: not a dataset saved with save_to_disk ({exc})") from None
        if isinstance(ds, datasets.DatasetDict):
            splits = list(ds)
            split = self.split or ("train" if "train" in ds else (splits[0] if len(splits) == 1 else None))
            if split not in ds:
                raise UserError(f"{self.path}: pick a split with --split (splits: {', '.join(splits)})")
            ds = ds[split]
        return ds

    def batches(self, batch_size: int = 50_000) -> Iterator[RecordBatch]:
        ds = self._dataset()
        self._check_columns(list(ds.column_names), str(self.path))
        cols = [f for _, f in self._fields()]
        ds = ds.select_columns(cols)
        row = 0
        for table in ds.with_format("arrow").iter(batch_size=batch_size):
            yield self._convert(table, str(self.path), row)
            row += table.num_rows
