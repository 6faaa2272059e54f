"""The privacy ledger: every step's event is recorded BEFORE the step's effects are visible.

One run repeats one step event (the engine keeps sigma fixed; with adaptive clipping the event
uses the effective multiplier), so the ledger holds that event and a count:

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
"""

from __future__ import annotations

import json
import math
import os
from typing import Optional

from userdp import accounting
from userdp.errors import BudgetExceededError

JOURNAL = "ledger_journal.jsonl"


class PrivacyLedger:
    def __init__(self, step_event, delta: float, *, target_epsilon: Optional[float] = None,
                 accountant: str = "pld", safe_steps: Optional[int] = None,
                 journal_dir: Optional[str] = None, grid_ratio: float = 1.5):
        self.step_event = step_event
        self.delta = float(delta)
        self.target_epsilon = target_epsilon
        self.accountant = accountant
        self.spent = 0  # steps whose release may have happened (includes lost_steps)
        self.lost_steps = 0  # begun before a crash and not replayed (counted in spent)
        self._safe = safe_steps
        self._max_steps: Optional[int] = None
        self._grid_ratio = grid_ratio
        self._grid: dict[int, float] = {}
        self._rdp1 = None
        self._journal = os.path.join(journal_dir, JOURNAL) if journal_dir else None
        self.private = step_event is not None

    # ---------------------------------------------------------------- budget
    def max_steps(self) -> Optional[int]:
        """Largest step count within the target (None: no target)."""
        if self.target_epsilon is None or not self.private:
            return None
        if self._max_steps is None:
            self._max_steps = accounting.max_steps(self.step_event, self.target_epsilon, self.delta, self.accountant)
        return self._max_steps

    def allows(self, n: int = 1) -> bool:
        if self.target_epsilon is None or not self.private:
            return True
        want = self.spent + n
        if self._safe is not None and want <= self._safe:
            return True
        return want <= self.max_steps()

    def record_step(self) -> int:
        """Record one step (before it runs); raises BudgetExceededError past the target."""
        if not self.allows(1):
            raise BudgetExceededError(
                f"step {self.spent + 1} would exceed the privacy budget epsilon={self.target_epsilon:g} "
                f"at delta={self.delta:g} ({self.max_steps()} steps fit)"
            )
        self.spent += 1
        if self._journal:
            with open(self._journal, "a") as f:
                f.write(json.dumps({"spent": self.spent}) + "\n")
                f.flush()
                os.fsync(f.fileno())
        return self.spent

    # ---------------------------------------------------------------- epsilon
    def epsilon(self, steps: Optional[int] = None) -> float:
        """Exact (pessimistic PLD/RDP) epsilon after ``steps`` (default: all spent)."""
        t = self.spent if steps is None else steps
        if t == 0:
            return 0.0
        if not self.private:
            return math.inf
        return accounting.epsilon(accounting.compose(self.step_event, t), self.delta, self.accountant)

    def epsilon_upper_bound(self) -> float:
        """Cheap upper bound on epsilon spent: epsilon at the next grid point >= spent."""
        t = self.spent
        if t == 0:
            return 0.0
        if not self.private:
            return math.inf
        g = 1
        while g < t:
            g = max(g + 1, int(math.ceil(g * self._grid_ratio)))
        if g not in self._grid:
            self._grid[g] = self._cheap_epsilon(g)
        eps = self._grid[g]
        if self.target_epsilon is not None and self._safe is not None and t <= self._safe:
            eps = min(eps, self.target_epsilon)
        return eps

    def _cheap_epsilon(self, t: int) -> float:
        if self.accountant == "rdp":
            # RDP composes additively: one step's RDP vector, computed once, scaled by t
            if self._rdp1 is None:
                try:
                    self._rdp1 = (accounting.rdp_orders(), accounting.step_rdp(self.step_event))
                except AttributeError:  # accounting changed: fall back to the public path
                    self._rdp1 = False
            if self._rdp1 is not False:
                from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib
                orders, rdp = self._rdp1
                return float(rdp_lib.compute_epsilon(orders, t * rdp, self.delta)[0])
            return accounting.epsilon(accounting.compose(self.step_event, t), self.delta, "rdp")
        return accounting.epsilon(accounting.compose(self.step_event, t), self.delta, "pld",
                                  value_discretization_interval=1e-3)

    # ---------------------------------------------------------------- persistence
    def state_dict(self) -> dict:
        return {"spent": self.spent, "lost_steps": self.lost_steps,
                "step_event": accounting.event_to_json(self.step_event) if self.private else "non-private",
                "delta": self.delta, "target_epsilon": self.target_epsilon, "accountant": self.accountant}

    def load_state_dict(self, state: dict, *, replayable: bool) -> None:
        mine = accounting.event_to_json(self.step_event) if self.private else "non-private"
        if state["step_event"] != mine:
            from userdp.errors import UserError
            raise UserError("cannot resume: the checkpoint's step event differs from this config's "
                            f"({state['step_event']} != {mine})")
        self.spent = int(state["spent"])
        self.lost_steps = int(state["lost_steps"])
        journal_max = self.journal_max()
        if journal_max > self.spent and not replayable:
            self.lost_steps += journal_max - self.spent
            self.spent = journal_max

    def journal_max(self) -> int:
        if not self._journal or not os.path.exists(self._journal):
            return 0
        best = 0
        with open(self._journal) as f:
            for line in f:
                try:
                    best = max(best, int(json.loads(line)["spent"]))
                except (ValueError, KeyError):  # a torn last line from a crash mid-write
                    continue
        return best
