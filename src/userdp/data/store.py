"""The user-grouped store: each user's records contiguous on disk, an offsets index, memory-mapped.

Layout of a store folder::

    records.arrow   Arrow IPC *file* (memory-mapped on open): columns text, seq [, date];
                    user u's records are rows offsets[u]:offsets[u+1], in dataset order (seq)
    users.arrow     one column user_id (string), row u = user u
    offsets.npy     int64 [num_users + 1]
    meta.json       counts, drop report, source description, content fingerprint

Build (:func:`build_store`) is out of core, in two passes:

1. stream the source in batches; each record gets its dataset-order number ``seq`` and goes to
   shard ``crc32(user) % S`` (an Arrow IPC stream file per shard). Memory: one input batch.
2. for each shard in turn: read it, drop empty records (counting them and the users left with
   none), sort by (user, seq), append to ``records.arrow``. Memory: one shard; S is chosen from
   the input size so that a shard is about ``shard_bytes`` (default 128 MB).

Users are ordered by (shard, user id): deterministic for a given input and shard count.
Opening a store maps ``records.arrow``; reading one user's or a cohort's records touches only
the pages holding them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import shutil
import time
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from userdp import progress
from userdp.data.records import EMPTY_TEXT, USERS_WITHOUT_RECORDS, DropReport
from userdp.errors import UserError
from userdp.fileio import OWNED_MARK, owned_dir, path_within, remove_owned

FORMAT_VERSION = 1
CHUNK_ROWS = 65_536


class PrivateTexts(list):
    """A list of texts read from a private store (a marker: public-text APIs refuse it)."""


@dataclasses.dataclass
class BuildResult:
    store: UserStore
    drops: DropReport
    seconds: float


def _shard_schema(has_dates: bool) -> pa.Schema:
    fields = [pa.field("user", pa.string()), pa.field("text", pa.string()), pa.field("seq", pa.int64())]
    if has_dates:
        fields.append(pa.field("date", pa.string()))
    return pa.schema(fields)


def _record_schema(has_dates: bool) -> pa.Schema:
    fields = [pa.field("text", pa.string()), pa.field("seq", pa.int64())]
    if has_dates:
        fields.append(pa.field("date", pa.string()))
    return pa.schema(fields)


def build_store(
    source,
    out_dir,
    *,
    batch_size: int = 50_000,
    num_shards: int | None = None,
    shard_bytes: int = 128 << 20,
    overwrite: bool = False,
) -> BuildResult:
    """Stream ``source`` into a user-grouped store at ``out_dir``; return it with its drop report."""
    t0 = time.perf_counter()
    out = Path(out_dir)
    src = getattr(source, "path", None)
    if src is not None and (path_within(src, out) or path_within(out, src)):  # never (in) its own source
        raise UserError(f"{out}: the store folder would hold (or be) its source {src}; choose another folder")
    if out.exists() and (out.is_symlink() or not out.is_dir()):
        raise UserError(f"{out}: exists and is not a folder; nothing was removed")
    if out.exists() and any(p.name != OWNED_MARK for p in out.iterdir()):
        if not overwrite:
            raise UserError(f"{out}: the store folder exists and is not empty (pass overwrite=True / --overwrite)")
        # only a folder userdp marked as a store it built is replaced: never the user's own files
        remove_owned(out, "the store folder")
    owned_dir(out)
    has_dates = bool(getattr(source, "has_dates", False))
    if num_shards is None:
        hint = int(getattr(source, "size_hint", 0) or 0)
        num_shards = int(min(4096, max(4, math.ceil(1.5 * hint / shard_bytes))))
    tmp = out / "_shards"
    tmp.mkdir()
    schema = _shard_schema(has_dates)
    writers: list = [None] * num_shards
    shard_of: dict[str, int] = {}
    drops = DropReport()
    seq = 0
    reading = progress.bar(None, "reading records", "rec")  # closed after pass 1, or in `finally`
    try:
        # pass 1: hash-partition by user
        for batch in source.batches(batch_size):
            n = len(batch)
            reading.update(n)
            if n == 0:
                continue
            shards = np.empty(n, dtype=np.int32)
            for i, u in enumerate(batch.users):
                s = shard_of.get(u)
                if s is None:
                    if len(shard_of) >= 4_000_000:  # bound the memo (many-user corpora)
                        shard_of.clear()
                    s = shard_of[u] = zlib.crc32(u.encode("utf-8")) % num_shards
                shards[i] = s
            text = pa.array(batch.texts, type=pa.string())
            # empty / whitespace-only / null text: kept as null so the user is still seen
            empty = pc.fill_null(pc.equal(pc.utf8_length(pc.utf8_trim_whitespace(text)), 0), True)
            n_empty = int(pc.sum(empty).as_py() or 0)
            if n_empty:
                first = int(np.flatnonzero(empty.to_numpy(zero_copy_only=False))[0])
                drops.add(EMPTY_TEXT, n_empty, example=batch.where(first))
                text = pc.if_else(empty, pa.scalar(None, pa.string()), text)
            cols = [pa.array(batch.users, type=pa.string()), text, pa.array(np.arange(seq, seq + n, dtype=np.int64))]
            if has_dates:
                cols.append(pa.array(batch.dates, type=pa.string()))
            rb = pa.RecordBatch.from_arrays(cols, schema=schema)
            seq += n
            order = np.argsort(shards, kind="stable")
            sorted_shards = shards[order]
            bounds = np.flatnonzero(np.diff(sorted_shards)) + 1
            starts = np.concatenate([[0], bounds])
            ends = np.concatenate([bounds, [n]])
            taken = rb.take(pa.array(order))
            for a, b in zip(starts, ends, strict=True):
                s = int(sorted_shards[a])
                if writers[s] is None:
                    writers[s] = pa.ipc.new_stream(str(tmp / f"shard-{s:05d}.arrows"), schema)
                writers[s].write_batch(taken.slice(int(a), int(b - a)))
        reading.close()
        for w in writers:
            if w is not None:
                w.close()
        writers = [None] * num_shards
        drops.merge(getattr(source, "drops", DropReport()))
        del shard_of

        # pass 2: per shard, drop empties, sort by (user, seq), append
        rschema = _record_schema(has_dates)
        user_ids: list[pa.Array] = []
        sizes: list[np.ndarray] = []
        n_no_records = 0
        no_rec_example = None
        with pa.OSFile(str(out / "records.arrow"), "wb") as sink, pa.ipc.new_file(sink, rschema) as writer:
            for s in range(num_shards):
                path = tmp / f"shard-{s:05d}.arrows"
                if not path.exists():
                    continue
                with pa.memory_map(str(path)) as src:
                    table = pa.ipc.open_stream(src).read_all()
                all_users = pc.unique(table.column("user"))
                table = table.filter(pc.is_valid(table.column("text")))
                if table.num_rows:
                    table = table.sort_by([("user", "ascending"), ("seq", "ascending")])
                    ucol = table.column("user").combine_chunks()
                    change = pc.not_equal(ucol.slice(1), ucol.slice(0, len(ucol) - 1))
                    bounds = np.flatnonzero(change.to_numpy(zero_copy_only=False)) + 1
                    starts = np.concatenate([[0], bounds]).astype(np.int64)
                    counts = np.diff(np.concatenate([starts, [len(ucol)]]))
                    kept_users = ucol.take(pa.array(starts))
                    user_ids.append(kept_users)
                    sizes.append(counts)
                    writer.write_table(table.select(rschema.names), max_chunksize=CHUNK_ROWS)
                    n_kept = len(kept_users)
                else:
                    kept_users = pa.array([], pa.string())
                    n_kept = 0
                lost = len(all_users) - n_kept
                if lost:
                    n_no_records += lost
                    if no_rec_example is None:
                        missing = pc.filter(all_users, pc.invert(pc.is_in(all_users, value_set=kept_users)))
                        no_rec_example = f"user {missing[0].as_py()!r}"
                del table
                path.unlink()
        if n_no_records:
            drops.add(USERS_WITHOUT_RECORDS, n_no_records, example=no_rec_example)
        sizes_arr = np.concatenate(sizes) if sizes else np.zeros(0, np.int64)
        offsets = np.concatenate([[0], np.cumsum(sizes_arr)]).astype(np.int64)
        ids = pa.concat_arrays(user_ids) if user_ids else pa.array([], pa.string())
        with (
            pa.OSFile(str(out / "users.arrow"), "wb") as sink,
            pa.ipc.new_file(sink, pa.schema([("user_id", pa.string())])) as w,
        ):
            w.write_table(pa.table({"user_id": ids}), max_chunksize=CHUNK_ROWS)
        np.save(out / "offsets.npy", offsets)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)  # no half-built store left behind
        raise
    finally:
        reading.close()
        for w in writers:
            if w is not None:
                w.close()
        shutil.rmtree(tmp, ignore_errors=True)
    if len(ids) == 0:
        shutil.rmtree(out, ignore_errors=True)
        raise UserError(f"{getattr(source, 'description', source)}: no records left (" + "; ".join(drops.lines()) + ")")
    meta = {
        "format_version": FORMAT_VERSION,
        "source": getattr(source, "description", str(source)),
        "num_users": int(len(ids)),
        "num_records": int(offsets[-1]),
        "input_records": int(seq),
        "has_dates": has_dates,
        "num_shards": int(num_shards),
        "drops": drops.to_dict(),
        "fingerprint": _fingerprint(out),
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    return BuildResult(UserStore(out), drops, time.perf_counter() - t0)


def _fingerprint(folder: Path) -> str:
    """Content hash of the store files (the Arrow writer is deterministic for the same rows)."""
    h = hashlib.blake2b(digest_size=16)
    for name in ("records.arrow", "users.arrow", "offsets.npy"):
        h.update(name.encode())
        with open(folder / name, "rb") as f:
            while chunk := f.read(8 << 20):
                h.update(chunk)
    return h.hexdigest()


class UserStore:
    """A built store, opened read-only; records are memory-mapped, never loaded whole."""

    def __init__(self, path, verify: bool = True):
        """Open the store at ``path``; ``verify`` re-hashes its files against meta.json's fingerprint.

        Raises:
            UserError: not a store, another format version, or damaged/inconsistent files."""
        self.path = Path(path)
        meta_path = self.path / "meta.json"
        if not meta_path.is_file():
            raise UserError(f"{self.path}: not a userdp data store (no meta.json; build one with `userdp data build`)")
        try:
            self.meta = json.loads(meta_path.read_text())
            assert isinstance(self.meta, dict)
        except (OSError, UnicodeDecodeError, ValueError, AssertionError):
            raise UserError(f"{meta_path}: unreadable store metadata (damaged); rebuild the store") from None
        if self.meta.get("format_version") != FORMAT_VERSION:
            raise UserError(
                f"{self.path}: store format {self.meta.get('format_version')} is not {FORMAT_VERSION}; rebuild it"
            )
        try:
            self._open(verify)
        except UserError:
            raise
        except (OSError, ValueError, KeyError, TypeError, IndexError, pa.ArrowException) as exc:
            raise UserError(
                f"{self.path}: damaged data store ({type(exc).__name__}: {str(exc)[:120]}); rebuild it"
            ) from None

    def _open(self, verify: bool) -> None:
        if verify and _fingerprint(self.path) != self.meta.get("fingerprint"):
            raise UserError(
                f"{self.path}: the store's files do not match the fingerprint in meta.json "
                "(damaged or edited); rebuild it"
            )
        self._mmap = pa.memory_map(str(self.path / "records.arrow"))
        self._reader = pa.ipc.open_file(self._mmap)
        self._batches = [self._reader.get_batch(i) for i in range(self._reader.num_record_batches)]
        self._batch_starts = np.cumsum([0] + [b.num_rows for b in self._batches]).astype(np.int64)
        with pa.memory_map(str(self.path / "users.arrow")) as f:
            self._user_ids = pa.ipc.open_file(f).read_all().column("user_id").combine_chunks()
        self.offsets = np.load(self.path / "offsets.npy")
        self._sizes = np.diff(self.offsets)
        self.num_users = int(len(self._sizes))
        self.num_records = int(self.offsets[-1])
        self.has_dates = bool(self.meta["has_dates"])
        self.fingerprint: str = self.meta["fingerprint"]
        self.drops = DropReport.from_dict(self.meta.get("drops", {}))
        rows = int(self._batch_starts[-1])
        if (
            self.meta.get("num_users") != self.num_users
            or self.meta.get("num_records") != self.num_records
            or rows != self.num_records
            or len(self._user_ids) != self.num_users
            or (self.num_users and np.any(self._sizes < 1))
        ):
            raise UserError(
                f"{self.path}: inconsistent store (meta.json says {self.meta.get('num_users')} users / "
                f"{self.meta.get('num_records')} records, the files hold {self.num_users} / {rows}); "
                "rebuild it"
            )

    def __repr__(self) -> str:
        return f"UserStore({str(self.path)!r}, users={self.num_users:,}, records={self.num_records:,})"

    @property
    def user_ids(self) -> list[str]:
        return self._user_ids.to_pylist()

    def user_id(self, u: int) -> str:
        return self._user_ids[int(u)].as_py()

    def user_index(self) -> dict[str, int]:
        return {u: i for i, u in enumerate(self._user_ids.to_pylist())}

    def sizes(self) -> np.ndarray:
        """int64 [num_users]: records per user (every entry >= 1)."""
        return self._sizes

    # -- reading ---------------------------------------------------------------------------
    def _column_rows(self, column: str, rows: np.ndarray) -> list:
        """Values of ``column`` at global ``rows`` (any order), touching only their batches."""
        rows = np.asarray(rows, dtype=np.int64)
        if len(rows) == 0:
            return []
        if rows.min() < 0 or rows.max() >= self.num_records:
            raise IndexError("record row out of range")
        order = np.argsort(rows, kind="stable")
        srt = rows[order]
        bidx = np.searchsorted(self._batch_starts, srt, side="right") - 1
        out: list = [None] * len(rows)
        cuts = np.flatnonzero(np.diff(bidx)) + 1
        for seg in np.split(np.arange(len(srt)), cuts):
            b = int(bidx[seg[0]])
            local = srt[seg] - self._batch_starts[b]
            col = self._batches[b].column(column)
            lo, hi = int(local[0]), int(local[-1]) + 1
            if hi - lo == len(local):  # contiguous: a zero-copy slice
                vals = col.slice(lo, hi - lo).to_pylist()
            else:
                vals = col.take(pa.array(local)).to_pylist()
            for j, v in zip(order[seg], vals, strict=True):
                out[j] = v
        return out

    def _rows(self, user: int, record_indices=None) -> np.ndarray:
        u = int(user)
        if not 0 <= u < self.num_users:
            raise IndexError(f"user index {u} out of range [0, {self.num_users})")
        a, b = int(self.offsets[u]), int(self.offsets[u + 1])
        if record_indices is None:
            return np.arange(a, b, dtype=np.int64)
        r = np.asarray(record_indices, dtype=np.int64)
        if len(r) and (r.min() < 0 or r.max() >= b - a):
            raise IndexError(f"record index out of range for user {u} with {b - a} records")
        return a + r

    def texts(self, user_index: int, record_indices=None) -> PrivateTexts:
        """Texts of one user's records (all, or the given indices within the user)."""
        return PrivateTexts(self._column_rows("text", self._rows(user_index, record_indices)))

    def dates(self, user_index: int, record_indices=None) -> list:
        if not self.has_dates:
            raise UserError(f"{self.path}: this store has no dates (build it with --date-field)")
        return self._column_rows("date", self._rows(user_index, record_indices))

    def gather_texts(self, users: np.ndarray, records: np.ndarray) -> PrivateTexts:
        """Texts of the pairs (users[i], records[i]) (record index within the user)."""
        users = np.asarray(users, dtype=np.int64)
        records = np.asarray(records, dtype=np.int64)
        if np.any(records >= self._sizes[users]) or np.any(records < 0):
            raise IndexError("record index out of range")
        return PrivateTexts(self._column_rows("text", self.offsets[users] + records))

    def iter_text_batches(self, column: str = "text"):
        """(first row, list of values) for each stored batch, in store order."""
        for start, b in zip(self._batch_starts[:-1], self._batches, strict=True):
            yield int(start), b.column(column).to_pylist()

    def column(self, name: str) -> pa.ChunkedArray:
        """A whole column as a (memory-mapped) chunked array."""
        return pa.chunked_array([b.column(name) for b in self._batches], type=self._reader.schema.field(name).type)

    def record_chars(self) -> np.ndarray:
        """int64 [num_records]: characters per record (Unicode code points)."""
        parts = [pc.utf8_length(b.column("text")).to_numpy(zero_copy_only=False) for b in self._batches]
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


def open_store(path, verify: bool = True) -> UserStore:
    """The store at ``path`` (see :class:`UserStore`)."""
    return UserStore(path, verify=verify)
