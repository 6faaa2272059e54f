"""The privacy ledger: every step's event is recorded BEFORE the step's effects are visible.

One run repeats one step event (the engine keeps sigma fixed; with adaptive clipping the event
uses the effective multiplier), so the ledger holds that event and a count. With cyclic sampling
over b groups (``bands``) a user takes part in one step of each cycle of b, so t steps compose the
event ceil(t / b) times (:meth:`PrivacyLedger.compositions`); the journal's header names b.

* :meth:`PrivacyLedger.record_step` refuses a step past the target with
  ``BudgetExceededError``. The check is an integer comparison against the largest safe step
  count (``safe_steps`` from calibration is trusted; beyond it, while twice the steps asked for
  fit, that count; near the budget ``userdp.accounting.max_steps``, run once).
* :meth:`epsilon` is exact (PLD of the composed event); :meth:`epsilon_upper_bound` is cheap:
  epsilon at the next point of a geometric grid of step counts (epsilon grows with steps, so it
  is an upper bound), each grid point computed once, with a coarser pessimistic PLD.
* A journal (``ledger_journal.jsonl``, one fsynced line per recorded step) survives crashes:
  on resume, steps begun after the last checkpoint are counted as spent unless the run is
  seeded (then the resumed run replays them bit for bit, the same release, counted once). The
  journal and its checks are :mod:`userdp.engine.journal`.
"""

from __future__ import annotations

import json
import math
import os

from userdp import accounting
from userdp.engine.journal import JOURNAL, Journal
from userdp.errors import BudgetExceededError, UserError


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
        most = self.max_steps()
        return most is None or want <= most

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
