"""The ledger's journal: one fsynced, hash-chained line per step begun, so a crash never makes a
run look as if it had spent less (:class:`Journal`; :class:`~userdp.engine.ledger.PrivacyLedger`
writes it before a step's effects are visible), and the readers that check it (:func:`read_chain`,
:func:`check_cited`, :func:`steps_begun`, :func:`journal_header`).

The journal is a hash chain. Its first line (the header) names the run (a random nonce), the
step event and a context the caller supplies (e.g. the config's and the data's fingerprints);
line i holds ``{"spent": k, "hash": sha256(hash_{i-1} ":" k)}``. A checkpoint stores how many
lines the journal had and the hash of the last one, so on resume a journal that is missing,
truncated below the checkpoint, edited, from another run or from another config is refused
with one line naming the file — it is never read as "fewer steps". The only defect repaired
is a torn final line (a crash while writing it: that step had not begun, since a step runs
only after its line is fsynced).

The journal's length is also bound outside it. After every line is fsynced, the head of the
chain (run, line count, hash) is written atomically to ``ledger_head.json`` beside it, and a
caller may cite the head in its own records (the LM job writes it into every ``metrics.jsonl``
line; a checkpoint stores it). A journal shorter than any record that cites it — cut back to a
valid prefix of its own chain, or an older copy restored — is refused, whichever record caught
it. What remains out of scope, and says so in docs/threat_model.md: a rollback of *every* file
that cites the journal to one earlier moment (indistinguishable from a crash at that moment),
and forging the chain by recomputing its hashes.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets

from userdp import accounting
from userdp.errors import UserError
from userdp.fileio import fsync_path, write_atomic

JOURNAL = "ledger_journal.jsonl"
HEAD = "ledger_head.json"
_MAGIC = "userdp-ledger-journal"


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _header_hash(header: dict) -> str:
    body = {k: v for k, v in header.items() if k != "hash"}
    return _sha(json.dumps(body, sort_keys=True))


def _line_hash(prev: str, spent: int) -> str:
    return _sha(f"{prev}:{int(spent)}")


def steps_begun(path: str | os.PathLike) -> int:
    """Most steps a journal file records as begun: a quick read for cross-checks, without
    verifying the chain (:meth:`Journal.load` does that). 0 for a file without entries."""
    best = 0
    with open(path, "rb") as f:
        for line in f:
            try:
                best = max(best, int(json.loads(line).get("spent", 0)))
            except (ValueError, AttributeError, TypeError):
                continue
    return best


def journal_header(path: str | os.PathLike) -> dict:
    """The header of a journal file (its run nonce, step event and context).

    Raises:
        UserError: the file is missing or its first line is not a journal header (naming it)."""
    try:
        with open(path) as f:
            header = json.loads(f.readline())
        assert isinstance(header, dict) and header.get("journal") == _MAGIC and isinstance(header.get("context"), dict)
    except (OSError, ValueError, AssertionError):
        raise UserError(f"{path}: missing, or not a userdp ledger journal") from None
    return header


def journal_event(text: str) -> tuple:
    """(the step event, b) a journal header's ``event`` names (:meth:`PrivacyLedger.event_json`): b
    is the cycle of cyclic sampling, 1 for a header that names the step event alone.

    Raises:
        ValueError, KeyError, TypeError: the text names no step event."""
    obj = json.loads(text)
    if isinstance(obj, dict) and set(obj) == {"bands", "step"}:
        bands = obj["bands"]
        if not isinstance(bands, int) or isinstance(bands, bool) or bands < 1:
            raise ValueError(f"bands {bands!r}")
        return accounting.event_from_dict(obj["step"]), bands
    return accounting.event_from_dict(obj), 1


def read_chain(path: str | os.PathLike, bad=None) -> tuple[dict, dict[int, str], int]:
    """Read and verify a journal's hash chain without changing the file: (header, line number ->
    hash, most steps recorded as begun). A torn final line (a crash while writing it) is ignored.
    ``bad``: why -> the UserError to raise (default: one naming the file).

    Raises:
        UserError: naming the file, when it is missing, unreadable, headerless or the chain breaks."""
    if bad is None:

        def bad(why):
            return UserError(f"{path}: {why}; the ledger cannot be trusted")

    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError:
        raise bad("the ledger journal is missing or unreadable") from None
    raw = raw[: raw.rfind(b"\n") + 1]
    try:
        rows = [json.loads(x) for x in raw.decode("utf-8").splitlines()]
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad(f"unreadable line ({exc})") from None
    if not rows or not isinstance(rows[0], dict) or rows[0].get("journal") != _MAGIC:
        raise bad("no journal header (the file was replaced or truncated)")
    header = rows[0]
    if header.get("hash") != _header_hash(header):
        raise bad("the header was edited (hash mismatch)")
    prev, best, hashes = header["hash"], 0, {0: header["hash"]}
    for i, row in enumerate(rows[1:], 1):
        try:
            k, h = int(row["spent"]), str(row["hash"])
        except (KeyError, TypeError, ValueError):
            raise bad(f"line {i + 1} is not a ledger entry") from None
        if h != _line_hash(prev, k):
            raise bad(f"line {i + 1} breaks the hash chain (edited, reordered or spliced)")
        prev, best, hashes[i] = h, max(best, k), h
    return header, hashes, best


def check_cited(path: str | os.PathLike, hashes: dict[int, str], run: str | None, cited: dict, by: str) -> None:
    """A record (``by``) cited the journal at ``cited`` = {"run", "lines", "head"}: the journal must
    still hold that line with that hash.

    Raises:
        UserError: naming the journal and the record, when it was cut short, replaced by an older
            copy, or belongs to another run."""
    try:
        c_run, c_lines, c_head = cited.get("run"), int(cited["lines"]), str(cited["head"])
    except (AttributeError, KeyError, TypeError, ValueError):
        raise UserError(f"{by}: malformed reference to the ledger journal ({cited!r})") from None
    if c_run is not None and run is not None and c_run != run:
        raise UserError(f"{path}: it belongs to another run than {by}; the ledger cannot be trusted")
    have = max(hashes)
    if c_lines > have:
        raise UserError(
            f"{path}: it holds {have} steps but {by} saw {c_lines}: the journal was truncated or "
            "replaced by an older copy; the ledger cannot be trusted"
        )
    if hashes.get(c_lines) != c_head:
        raise UserError(
            f"{path}: line {c_lines + 1} differs from what {by} saw (edited or replaced); the ledger cannot be trusted"
        )


class Journal:
    """The append-only, hash-chained record of steps begun (see the module docstring).

    Args:
        path: the journal file.
        event_json: the step event as JSON (or ``"non-private"``).
        context: caller-defined facts the journal is bound to (JSON-serialisable); a resume
            whose context differs is refused.
    """

    def __init__(self, path: str, event_json: str, context: dict | None = None):
        self.path = path
        self.event_json = event_json
        self.context = context or {}
        self.run: str | None = None
        self.lines = 0  # lines after the header
        self.head: str | None = None
        self.max_spent = 0
        self._hashes: dict[int, str] = {}  # line number -> hash

    # ---------------------------------------------------------------- creating / reading
    def create(self) -> None:
        header: dict[str, str | int | dict] = {
            "journal": _MAGIC,
            "version": 2,
            "run": secrets.token_hex(16),
            "event": self.event_json,
            "context": self.context,
        }
        header["hash"] = _header_hash(header)
        with open(self.path, "x") as f:
            f.write(json.dumps(header, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        fsync_path(os.path.dirname(self.path) or ".")
        run, head = header["run"], header["hash"]
        assert isinstance(run, str) and isinstance(head, str)
        self.run, self.head, self.lines, self.max_spent = run, head, 0, 0
        self._hashes = {0: head}
        self._write_head()

    @property
    def head_path(self) -> str:
        return os.path.join(os.path.dirname(self.path) or ".", HEAD)

    def cite(self) -> dict:
        """The journal's head, for a record that wants to bind the journal's length."""
        return {"run": self.run, "lines": self.lines, "head": self.head}

    def _write_head(self) -> None:
        # after the journal line is fsynced, so the head file is never ahead of the journal; a
        # lost rename (power loss) leaves an older head, which is never a false refusal
        write_atomic(self.head_path, json.dumps(self.cite()))

    def _bad(self, why: str) -> UserError:
        return UserError(
            f"{self.path}: {why}; the ledger cannot be trusted, so the run cannot be "
            "resumed (restore the run directory from a backup, or start a new run)"
        )

    def load(self) -> None:
        """Read and verify the whole chain (and that it is not shorter than its head file);
        repair only a torn final line."""
        if not os.path.isfile(self.path):
            raise self._bad("the ledger journal is missing")
        with open(self.path, "rb") as f:
            raw = f.read()
        cut = raw.rfind(b"\n") + 1
        if cut < len(raw):  # a torn final line: the step it would record never began
            with open(self.path, "r+b") as f:
                f.truncate(cut)
                f.flush()
                os.fsync(f.fileno())
        header, hashes, best = read_chain(self.path, bad=self._bad)
        if header.get("event") != self.event_json:
            raise self._bad(
                "it records a different step event than this configuration "
                f"({header.get('event')} != {self.event_json})"
            )
        if header.get("context") != self.context:
            diff = sorted(
                k
                for k in set(header.get("context") or {}) | set(self.context)
                if (header.get("context") or {}).get(k) != self.context.get(k)
            )
            raise self._bad(
                f"it was written for a different {', '.join(diff) or 'context'} "
                "(the configuration or the data changed since the run began)"
            )
        if not os.path.isfile(self.head_path):
            raise self._bad(f"{HEAD} beside it is missing (deleted), so the journal's length cannot be checked")
        try:
            with open(self.head_path) as f:
                cited = json.load(f)
        except (OSError, ValueError):
            raise self._bad(f"{HEAD} beside it is unreadable") from None
        check_cited(self.path, hashes, header["run"], cited, self.head_path)
        self.run, self.head, self.lines, self.max_spent, self._hashes = (
            header["run"],
            hashes[max(hashes)],
            max(hashes),
            best,
            hashes,
        )

    def verify_checkpoint(self, run: str | None, lines: int | None, head: str | None) -> None:
        """The checkpoint saw ``lines`` lines ending in ``head``: the journal must still hold them."""
        if run is None:
            raise self._bad("the checkpoint carries no journal reference (written by an older userdp)")
        if run != self.run:
            raise self._bad("it belongs to another run than the checkpoint")
        if lines is None:
            raise self._bad("the checkpoint carries no journal line count (damaged)")
        if lines > self.lines:
            raise self._bad(f"it holds {self.lines} steps but the checkpoint saw {lines}: it was truncated")
        if self._hashes.get(lines) != head:
            raise self._bad(f"line {lines + 1} differs from what the checkpoint saw")

    def append(self, spent: int) -> None:
        if self.head is None:
            raise RuntimeError("Journal.append: create() or read the journal first")  # pragma: no cover
        h = _line_hash(self.head, spent)
        with open(self.path, "a") as f:
            f.write(json.dumps({"spent": int(spent), "hash": h}) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.lines += 1
        self.head = h
        self._hashes[self.lines] = h
        self.max_spent = max(self.max_spent, int(spent))
        self._write_head()
