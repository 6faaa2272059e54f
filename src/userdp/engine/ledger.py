"""The privacy ledger: every step's event is recorded BEFORE the step's effects are visible.

One run repeats one step event (the engine keeps sigma fixed; with adaptive clipping the event
uses the effective multiplier), so the ledger holds that event and a count. With cyclic sampling
over b groups (``bands``) a user takes part in one step of each cycle of b, so t steps compose the
event ceil(t / b) times (:meth:`PrivacyLedger.compositions`); the journal's header names b.

* :meth:`PrivacyLedger.record_step` refuses a step past the target with
  ``BudgetExceededError``. The check is an integer comparison against the largest safe step
  count, computed once (``safe_steps`` from calibration is trusted; beyond it
  ``userdp.accounting.max_steps`` is run once).
* :meth:`epsilon` is exact (PLD of the composed event); :meth:`epsilon_upper_bound` is cheap:
  epsilon at the next point of a geometric grid of step counts (epsilon grows with steps, so it
  is an upper bound), each grid point computed once, with a coarser pessimistic PLD.
* A journal (``ledger_journal.jsonl``, one fsynced line per recorded step) survives crashes:
  on resume, steps begun after the last checkpoint are counted as spent unless the run is
  seeded (then the resumed run replays them bit for bit, the same release, counted once).

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
import math
import os
import secrets

from userdp import accounting
from userdp.errors import BudgetExceededError, UserError
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
        header = {
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
        self.run, self.head, self.lines, self.max_spent = header["run"], header["hash"], 0, 0
        self._hashes = {0: self.head}
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
        if lines > self.lines:
            raise self._bad(f"it holds {self.lines} steps but the checkpoint saw {lines}: it was truncated")
        if self._hashes.get(lines) != head:
            raise self._bad(f"line {lines + 1} differs from what the checkpoint saw")

    def append(self, spent: int) -> None:
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


class PrivacyLedger:
    """Counts the steps begun, enforces the budget and gives epsilon (see the module docstring).

    Args:
        step_event: one step's DpEvent (None for a non-private run).
        delta: the delta of the guarantee.
        target_epsilon: the budget (None: no budget).
        accountant: a registered accountant name ("pld" or "rdp").
        safe_steps: a step count already known to fit the budget (from calibration).
        bands: b of cyclic sampling (t steps compose the step event ceil(t / b) times); 1 otherwise.

    Without :meth:`attach_journal` the ledger lives in memory only (nothing survives the process).
    """

    #: the budget check's step grid grows by this ratio (:meth:`max_steps`)
    GRID_RATIO = 1.01

    def __init__(
        self,
        step_event,
        delta: float,
        *,
        target_epsilon: float | None = None,
        accountant: str = "pld",
        safe_steps: int | None = None,
        bands: int = 1,
    ):
        self.step_event = step_event
        self.bands = int(bands)
        self.delta = float(delta)
        self.target_epsilon = target_epsilon
        self.accountant = accountant
        self.spent = 0  # steps whose release may have happened (includes lost_steps)
        self.lost_steps = 0  # begun before a crash and not replayed (counted in spent)
        self._safe = safe_steps
        self._max_steps: int | None = None
        self._grid: dict[int, float] = {}
        # events spent before this ledger's steps (a DP median, earlier trials, an earlier sigma):
        # composed heterogeneously with the steps; steps [0, segment_start) are inside them
        self.prior: list = []
        self.segment_start = 0
        self.private = step_event is not None
        self.journal: Journal | None = None

    def attach_journal(self, journal_dir: str, context: dict | None = None) -> PrivacyLedger:
        """Keep the ledger in ``journal_dir/ledger_journal.jsonl``, bound to the facts in ``context``
        (see :class:`Journal`); before any step is counted."""
        if self.spent or self.prior:
            raise RuntimeError("attach_journal: the ledger has already counted")  # pragma: no cover
        self.journal = Journal(os.path.join(journal_dir, JOURNAL), self.event_json(), context)
        return self

    def event_json(self) -> str:
        """The step event as the journal's header and a checkpoint name it (with the bands, b > 1)."""
        if not self.private:
            return "non-private"
        text = accounting.event_to_json(self.step_event)
        return text if self.bands == 1 else json.dumps({"bands": self.bands, "step": json.loads(text)}, sort_keys=True)

    def compositions(self, steps: int) -> int:
        """How many times the step event composes over ``steps`` steps: ceil(steps / b)."""
        return accounting.cycle_compositions(steps, self.bands)

    # ---------------------------------------------------------------- journal lifecycle
    def start_journal(self) -> None:
        """A new run: create the journal (refused if one exists: that run must be resumed)."""
        if self.journal is None:
            return
        if os.path.exists(self.journal.path):
            raise UserError(f"{self.journal.path} already exists: resume that run, or use an empty directory")
        self.journal.create()

    def resume_without_checkpoint(self, *, replayable: bool, replay_refused: str | None = None) -> None:
        """A run that crashed before its first checkpoint: the steps it began are spent (an
        unseeded run's lost steps cannot be replayed), a seeded run replays them."""
        if self.journal is None:
            raise UserError("resuming needs the run's ledger journal (no checkpoint directory given)")
        self.journal.load()
        if replayable and replay_refused and self.journal.max_spent > 0:
            raise UserError(replay_refused)
        if not replayable:
            self.spent = self.lost_steps = self.journal.max_spent

    def total_event(self, steps: int | None = None):
        """The DpEvent of everything the ledger counted (None before the first step or for a
        non-private run): recomputing epsilon from it gives :meth:`epsilon`. Extra events
        (:meth:`spend_event`, :meth:`rebase`) are composed with the steps by
        ``dp_accounting.DpEventBuilder``; without them it is ``compose(step_event, steps)``."""
        t = self.spent if steps is None else steps
        if not self.private or (t == 0 and not self.prior):
            return None
        return accounting.compose_after(
            self.prior, self.step_event, self.compositions(t) - self.compositions(self.segment_start)
        )

    def spend_event(self, event) -> None:
        """Count an extra DpEvent against this ledger's guarantee and budget (e.g. a DP median
        released to plan the run, or earlier tuning trials); it composes with the steps.

        Raises:
            UserError: the ledger is non-private, or the event would pass the target.
        """
        if not self.private:
            raise UserError("a non-private ledger cannot count DP events")
        self.prior.append(event)
        self._invalidate()
        if self.target_epsilon is not None and self.epsilon() > self.target_epsilon:
            self.prior.pop()
            self._invalidate()
            raise BudgetExceededError(
                f"spending {accounting.event_to_json(event)} would exceed the privacy "
                f"budget epsilon={self.target_epsilon:g} at delta={self.delta:g}"
            )

    def rebase(self, step_event) -> None:
        """From now on steps are ``step_event`` (e.g. a resumed run at another sigma): the steps
        counted so far keep their old event, composed before the new ones."""
        if not self.private or step_event is None:
            raise UserError("rebase needs a private ledger and a step event")
        if self.bands > 1:
            raise UserError("a cyclic run's steps keep one event (its noise multiplier cannot change mid-run)")
        if self.spent > self.segment_start:
            self.prior.append(accounting.compose(self.step_event, self.spent - self.segment_start))
        self.segment_start = self.spent
        self.step_event = step_event
        self._invalidate()

    def _invalidate(self) -> None:
        self._max_steps = None
        self._safe = None
        self._grid.clear()

    # ---------------------------------------------------------------- budget
    def max_steps(self) -> int | None:
        """Largest step count within the target (None: no target)."""
        if self.target_epsilon is None or not self.private:
            return None
        if self._max_steps is None:
            # with prior events, a pessimistic 1e-3 PLD grid (still an upper bound, ten times cheaper)
            how = accounting.StepSearch(self.accountant, interval=1e-3 if self.prior else None)
            # ceil(t / b) <= k exactly when t <= k·b: the most steps are b times the most compositions
            self._max_steps = self.segment_start + self.bands * accounting.max_steps(
                self.step_event, self.target_epsilon, self.delta, how, prior=self.prior
            )
        return self._max_steps

    def allows(self, n: int = 1) -> bool:
        if self.target_epsilon is None or not self.private:
            return True
        want = self.spent + n
        if self._safe is not None and want <= self._safe:
            return True
        if self._max_steps is None:
            # A run far inside its budget (a fixed sigma under a loose target) need not search for
            # the most steps that fit (seconds to a minute of PLD at large T): epsilon grows with
            # steps, so when twice the steps asked for fit, every count up to it does. Doubling
            # keeps the evaluations to a logarithm of the steps; near the budget the search runs once.
            probe = 2 * want
            if self.epsilon(steps=probe) <= self.target_epsilon:
                self._safe = probe
                return True
        return want <= self.max_steps()

    def record_step(self) -> int:
        """Record one step (before it runs); raises BudgetExceededError past the target."""
        if not self.allows(1):
            raise BudgetExceededError(
                f"step {self.spent + 1} would exceed the privacy budget epsilon={self.target_epsilon:g} "
                f"at delta={self.delta:g} ({self.max_steps()} steps fit)"
            )
        if self.journal is not None:
            self.journal.append(self.spent + 1)  # fsynced before the step can run
        self.spent += 1
        return self.spent

    # ---------------------------------------------------------------- epsilon
    def epsilon(self, steps: int | None = None) -> float:
        """Exact (pessimistic PLD/RDP) epsilon after ``steps`` (default: all spent)."""
        t = self.spent if steps is None else steps
        if t == 0 and not self.prior:
            return 0.0
        if not self.private:
            return math.inf
        return accounting.epsilon(self.total_event(t), self.delta, self.accountant)

    #: up to this many steps the curve is epsilon at the step itself (~15 ms a step at PLD 1e-3)
    EXACT_CURVE_STEPS = 1000

    def epsilon_upper_bound(self) -> float:
        """Epsilon spent so far, cheaply and never below the truth: the pessimistic PLD at a 1e-3
        grid (within ~1e-5 relative of the 1e-4 figure at these sizes) at the step count itself up
        to :attr:`EXACT_CURVE_STEPS`, beyond it at the next point of a 1% geometric grid of step
        counts (epsilon grows with steps, so it is an upper bound within ~1%)."""
        t = self.spent
        if t == 0 and not self.prior:
            return 0.0
        if not self.private:
            return math.inf
        g = t
        if t > self.EXACT_CURVE_STEPS:
            g = self.EXACT_CURVE_STEPS
            while g < t:
                g = max(g + 1, int(math.ceil(g * self.GRID_RATIO)))
        if g not in self._grid:
            self._grid[g] = self._cheap_epsilon(g)
        return self._grid[g]

    def _cheap_epsilon(self, t: int) -> float:
        if self.prior:
            return accounting.epsilon(
                self.total_event(t), self.delta, self.accountant, value_discretization_interval=1e-3
            )
        return accounting.get_accountant(self.accountant).epsilon_of_steps(
            self.step_event, self.compositions(t), self.delta
        )

    # ---------------------------------------------------------------- persistence
    def state_dict(self) -> dict:
        j = self.journal
        return {
            "spent": self.spent,
            "lost_steps": self.lost_steps,
            "step_event": self.event_json(),
            "delta": self.delta,
            "target_epsilon": self.target_epsilon,
            "accountant": self.accountant,
            "prior_events": [accounting.event_to_json(e) for e in self.prior],
            "segment_start": self.segment_start,
            "journal_run": j.run if j else None,
            "journal_lines": j.lines if j else None,
            "journal_head": j.head if j else None,
        }

    def load_state_dict(self, state: dict, *, replayable: bool, replay_refused: str | None = None) -> None:
        """Restore from a checkpoint; the journal must still hold what the checkpoint saw, and the
        steps begun after it are counted as spent (unless ``replayable``: a seeded run replays)."""
        mine = self.event_json()
        if state["step_event"] != mine:
            raise UserError(
                "cannot resume: the checkpoint's step event differs from this config's "
                f"({state['step_event']} != {mine})"
            )
        self.spent = int(state["spent"])
        self.lost_steps = int(state["lost_steps"])
        self.prior = [accounting.event_from_dict(json.loads(e)) for e in state.get("prior_events") or []]
        self.segment_start = int(state.get("segment_start") or 0)
        self._invalidate()
        if self.journal is None:
            return
        self.journal.load()
        self.journal.verify_checkpoint(state.get("journal_run"), state.get("journal_lines"), state.get("journal_head"))
        if self.journal.max_spent > self.spent and replayable and replay_refused:
            raise UserError(replay_refused)
        if self.journal.max_spent > self.spent and not replayable:
            self.lost_steps += self.journal.max_spent - self.spent
            self.spent = self.journal.max_spent
