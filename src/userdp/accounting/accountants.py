"""Accountants behind one small interface, and their registry.

An accountant turns a composed ``DpEvent`` into (epsilon, delta). Two are registered:

* ``"pld"`` (default): dp_accounting's privacy-loss distributions with pessimistic
  discretization — the tightest upper bound; events outside its feasible range (see
  :data:`~userdp.accounting.pld.PLD_SIGMA_RANGE`) are answered by RDP and say so.
* ``"rdp"``: Rényi DP (dp_accounting's RdpAccountant plus our mixture-of-Gaussians RDP); fast,
  looser, the only one for fixed-size cohorts (replace-one) and very small delta.

Adding an accountant is one class with the four members of :class:`Accountant` and one
:func:`register_accountant` call (docs/ARCHITECTURE.md shows an example); every caller —
the ledger, calibration, the CLI, the planner, the report — looks accountants up here by name.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Protocol

import numpy as np
from dp_accounting import dp_event as dpe
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

from userdp.accounting import pld as _pld_mod
from userdp.accounting import rdp as _rdp_mod
from userdp.accounting.events import check_delta, check_event, check_target_epsilon, compose, compose_after
from userdp.accounting.pld import PLD_INTERVAL, pld_infeasible
from userdp.accounting.rdp import rdp_curve
from userdp.errors import UserError
from userdp.registry import Registry
from userdp.validation import check_int, check_positive


class Accountant(Protocol):
    """The contract of an accountant.

    Attributes:
        name: the registry key (``--accountant NAME``, ``privacy.accountant: NAME``).
        discretized: True when the answer depends on a discretization grid that calibration may
            coarsen for speed (PLD); calibration then checks the grid's pessimism at the answer.
    """

    name: str
    discretized: bool

    def epsilon(
        self,
        event: dpe.DpEvent,
        delta: float,
        *,
        interval: float | None = None,
        orders: Sequence[float] | None = None,
    ) -> tuple[float, str]:
        """(epsilon, which backend answered) of the composed event at delta: an upper bound.

        ``interval`` is a discretization grid (accountants without one ignore it)."""
        ...

    def delta(
        self,
        event: dpe.DpEvent,
        epsilon: float,
        *,
        interval: float | None = None,
        orders: Sequence[float] | None = None,
    ) -> float:
        """delta of the composed event at epsilon: an upper bound."""
        ...

    def epsilon_of_steps(self, step_event: dpe.DpEvent, steps: int, delta: float) -> float:
        """Cheap upper bound on epsilon after ``steps`` self-compositions of ``step_event`` (the
        ledger's running figure; may be looser than :meth:`epsilon`, never below the truth)."""
        ...

    # Optional: ``supports(event) -> str | None``: why the accountant cannot account ``event``
    # (None: it can). Without it, :func:`check_supports` asks for one step's epsilon.


class RDPAccountant:
    """Rényi DP: additive over steps; epsilon by dp_accounting's conversion."""

    name = "rdp"
    discretized = False

    def supports(self, event):
        return None  # every event userdp builds; dp_accounting refuses others at once

    def __init__(self) -> None:
        self._step_rdp: dict[str, np.ndarray] = {}

    def epsilon(self, event, delta, *, interval=None, orders=None):
        o, r = rdp_curve(event, orders)
        return float(rdp_lib.compute_epsilon(o, r, delta)[0]), "rdp"

    def delta(self, event, epsilon, *, interval=None, orders=None):
        o, r = rdp_curve(event, orders)
        return float(rdp_lib.compute_delta(o, r, epsilon)[0])

    def epsilon_of_steps(self, step_event, steps, delta):
        key = repr(step_event)
        if key not in self._step_rdp:  # one step's RDP vector, computed once, scaled by the steps
            if len(self._step_rdp) > 64:
                self._step_rdp.clear()
            self._step_rdp[key] = _rdp_mod.step_rdp(step_event)
        return float(rdp_lib.compute_epsilon(_rdp_mod.rdp_orders(), steps * self._step_rdp[key], delta)[0])


class PLDAccountant:
    """Privacy-loss distributions (pessimistic); RDP answers where the PLD cannot, and says why."""

    name = "pld"
    discretized = True

    def supports(self, event):
        return None  # where the PLD cannot, RDP answers (and says so)

    def epsilon(self, event, delta, *, interval=None, orders=None):
        # mixtures lose their improbable largest sensitivities first (a δ share of
        # MIXTURE_TAIL_SHARE; see truncate_mixture_tails): ε' at δ − S, plus η
        cut, slack, shift = _pld_mod.truncate_mixture_tails(event, _pld_mod.MIXTURE_TAIL_SHARE * delta)
        why = pld_infeasible(cut)
        if why is None:
            try:
                eps = float(_pld_mod.pld_distribution(cut, interval or PLD_INTERVAL).get_epsilon(delta - slack)) + shift
            except MemoryError:  # a loss range too wide for its grid (e.g. thousands of unamplified steps)
                eps, why = math.inf, "its grid would not fit in memory"
            if math.isfinite(eps):
                return eps, "pld"
            why = why or "it cannot resolve this delta (its tails are truncated)"
        return _RDP.epsilon(event, delta, orders=orders)[0], f"rdp (PLD infeasible: {why})"

    def delta(self, event, epsilon, *, interval=None, orders=None):
        # δ is unknown before it is computed: drop MIXTURE_TAIL_FLOOR first, then, with that
        # answer δ₁, the same δ share as epsilon() drops (the tighter of the two, both sound)
        best = None
        budget = _pld_mod.MIXTURE_TAIL_FLOOR
        for _ in range(2):
            cut, slack, shift = _pld_mod.truncate_mixture_tails(event, budget)
            if pld_infeasible(cut) is None:
                try:
                    pld = _pld_mod.pld_distribution(cut, interval or PLD_INTERVAL)
                    d = float(pld.get_delta(epsilon - shift)) + slack
                except MemoryError:  # its grid would not fit: RDP answers below
                    break
                best = d if best is None else min(best, d)
            if best is None or _pld_mod.MIXTURE_TAIL_SHARE * best <= budget:
                break
            budget = _pld_mod.MIXTURE_TAIL_SHARE * best
        return min(best, 1.0) if best is not None else _RDP.delta(event, epsilon, orders=orders)

    def epsilon_of_steps(self, step_event, steps, delta):
        # a 1e-3 grid: within ~1e-5 relative of the 1e-4 figure at ledger sizes, 10x cheaper
        return self.epsilon(compose(step_event, steps), delta, interval=1e-3)[0]


#: name -> accountant; ``privacy.accountant`` / ``TrainConfig.accountant`` pick one
ACCOUNTANTS: Registry = Registry("accountant")


def check_supports(name: str, step_event: dpe.DpEvent, delta: float) -> None:
    """Refuse, before any step, an accountant that cannot account a run's step event (e.g. a
    plugin without mixtures of Gaussians under ELS): its ``supports(event)`` when it has one, else
    one step's epsilon, which must be a number.

    Raises:
        UserError: naming the accountant and why."""
    acc = get_accountant(name)
    supports = getattr(acc, "supports", None)
    if supports is not None:
        why = supports(step_event)
    else:
        try:
            eps = acc.epsilon(step_event, delta)[0]
            why = None if isinstance(eps, (int, float)) and not math.isnan(eps) and eps >= 0 else f"it answered {eps!r}"
        except UserError as exc:
            why = str(exc)
        except Exception as exc:  # noqa: BLE001 - a plugin's failure, reported in one line
            why = f"{type(exc).__name__}: {exc}"
    if why:
        why = why if len(why) <= 240 else why[:240] + " ..."
        raise UserError(
            f"privacy.accountant {name}: it cannot account this run's step event "
            f"({type(step_event).__name__}): {why}; choose another accountant"
        )


def register_accountant(accountant: Accountant) -> Accountant:
    """Make ``accountant`` available by its ``name`` everywhere (CLI, configs, ledger, calibration).

    Raises:
        UserError: the name is taken.
    """
    return ACCOUNTANTS.register(accountant)


def get_accountant(name: str) -> Accountant:
    """The registered accountant called ``name``, behind :class:`CheckedAccountant`: every answer
    any caller gets from it (the ledger, calibration, ``userdp account``, the planner, the report)
    has passed the same check.

    Raises:
        UserError: no accountant has that name (the message lists the registered ones).
    """
    acc = ACCOUNTANTS.lookup(name)
    if isinstance(acc, CheckedAccountant):
        return acc
    held = _CHECKED.get(id(acc))
    if held is None or held._inner is not acc:
        held = _CHECKED[id(acc)] = CheckedAccountant(acc)
    return held


#: id(accountant) -> its checked form (one per accountant, so that its monotonicity record lasts)
_CHECKED: dict = {}


def _real(value) -> bool:
    """A real number an accountant may answer (not a bool, a string or None; nan is checked apart)."""
    return isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool)


def checked_epsilon(value, who: str) -> float:
    """The one check of an epsilon from any accountant: a real number, not nan, >= 0
    (``inf`` is an honest "no bound").

    Raises:
        UserError: naming the accountant and what it answered."""
    if not _real(value) or math.isnan(value) or value < 0:
        raise UserError(
            f"privacy.accountant {who}: it answered epsilon = {value!r}, which is not an epsilon "
            "(a number >= 0); nothing is stated from it"
        )
    return float(value)


def checked_delta(value, who: str) -> float:
    """The one check of a delta from any accountant: a number in [0, 1].

    Raises:
        UserError: naming the accountant and what it answered."""
    if not _real(value) or math.isnan(value) or not 0.0 <= value <= 1.0:
        raise UserError(
            f"privacy.accountant {who}: it answered delta = {value!r}, which is not a delta "
            "(a number in [0, 1]); nothing is stated from it"
        )
    return float(value)


class CheckedAccountant:
    """An accountant whose every answer passes :func:`checked_epsilon` / :func:`checked_delta`,
    and whose running figure never decreases with the steps (a bound that fell as steps were
    spent would let a run pass its target). Other members are the accountant's own."""

    def __init__(self, inner):
        self._inner = inner
        self._last_of_steps: dict = {}

    def __getattr__(self, item):
        return getattr(self._inner, item)

    def epsilon(self, event, delta, *, interval=None, orders=None):
        answer = self._inner.epsilon(event, delta, interval=interval, orders=orders)
        if not (isinstance(answer, tuple) and len(answer) == 2):
            raise UserError(
                f"privacy.accountant {self.name}: epsilon() answered {answer!r}, not (epsilon, backend name)"
            )
        return checked_epsilon(answer[0], self.name), str(answer[1])

    def delta(self, event, epsilon, *, interval=None, orders=None):
        return checked_delta(self._inner.delta(event, epsilon, interval=interval, orders=orders), self.name)

    def epsilon_of_steps(self, step_event, steps, delta):
        eps = checked_epsilon(self._inner.epsilon_of_steps(step_event, steps, delta), self.name)
        key = (repr(step_event), float(delta))
        prev = self._last_of_steps.get(key)
        if prev is not None and (
            (steps > prev[0] and eps < prev[1] - 1e-9 * max(1.0, prev[1]))
            or (steps < prev[0] and eps > prev[1] + 1e-9 * max(1.0, prev[1]))
        ):
            raise UserError(
                f"privacy.accountant {self.name}: epsilon after {steps} steps ({eps}) is not monotone "
                f"in the steps (after {prev[0]}: {prev[1]}); nothing is stated from it"
            )
        self._last_of_steps[key] = (steps, eps)
        return eps


_RDP = RDPAccountant()  # also the PLD's fallback where it cannot answer
register_accountant(_RDP)
register_accountant(PLDAccountant())


def clear_caches() -> None:
    """Forget every cached PLD and RDP (for cold-cache timing, or to free memory)."""
    _pld_mod.clear_caches()
    _rdp_mod.clear_caches()
    _RDP._step_rdp.clear()


def epsilon_and_accountant(
    event: dpe.DpEvent,
    delta: float,
    accountant: str = "pld",
    *,
    value_discretization_interval: float = PLD_INTERVAL,
    orders: Sequence[float] | None = None,
) -> tuple[float, str]:
    """ε of the event at δ — an upper bound — and which accountant gave it.

    With ``accountant="pld"``, events outside the PLD's feasible range (see
    :data:`~userdp.accounting.pld.PLD_SIGMA_RANGE`, :data:`~userdp.accounting.pld.PLD_MAX_STEPS`)
    and deltas it cannot resolve (it returns ∞) are answered by RDP instead, also a valid upper
    bound, looser. The second value is ``"pld"``, ``"rdp"``, or ``"rdp (…)"`` with the reason
    the PLD did not answer. ε may be ``inf`` (no order of RDP bounds the event).

    Raises:
        UserError: bad delta or accountant name, or an event the accountant cannot take.
    """
    check_delta(delta)
    check_event(event)
    return get_accountant(accountant).epsilon(event, delta, interval=value_discretization_interval, orders=orders)


def epsilon(
    event: dpe.DpEvent,
    delta: float,
    accountant: str = "pld",
    *,
    value_discretization_interval: float = PLD_INTERVAL,
    orders: Sequence[float] | None = None,
) -> float:
    """ε of the event at δ: an upper bound (see :func:`epsilon_and_accountant`, which also says
    whether the PLD or RDP answered).

    Raises:
        UserError: bad delta or accountant name, or an event the accountant cannot take.
    """
    return epsilon_and_accountant(
        event, delta, accountant, value_discretization_interval=value_discretization_interval, orders=orders
    )[0]


def delta(
    event: dpe.DpEvent,
    epsilon: float,
    accountant: str = "pld",
    *,
    value_discretization_interval: float = PLD_INTERVAL,
    orders: Sequence[float] | None = None,
) -> float:
    """δ of the event at ε: an upper bound.

    Raises:
        UserError: epsilon is not a positive number, or the accountant name is unknown.
    """
    eps = check_positive(epsilon, "epsilon")
    check_event(event)
    return get_accountant(accountant).delta(event, eps, interval=value_discretization_interval, orders=orders)


@dataclasses.dataclass(frozen=True)
class StepSearch:
    """How :func:`max_steps` searches: the accountant, the largest step count it tries (``limit``),
    the accountant's grid (``interval``; None: its default) and the seconds it may take."""

    accountant: str = "pld"
    limit: int = 10**7
    interval: float | None = None
    time_budget_s: float = 60.0


def max_steps(
    step_event: dpe.DpEvent,
    epsilon: float,
    delta: float,
    how: StepSearch | str = "pld",
    *,
    prior: Sequence[dpe.DpEvent] = (),
) -> int:
    """Largest T with ε(T steps) ≤ epsilon (0 if even one step exceeds; ``how.limit`` if reached).

    ``how``: the accountant's name, or a :class:`StepSearch`. ``prior``: events spent before the
    steps (composed with them by ``DpEventBuilder``). The search is bracketed by RDP's answer where
    RDP can take the event (RDP is additive over steps, so its search is cheap; the tighter
    accountant then searches upward from it), and bounded in time: a search that has not finished
    within ``how.time_budget_s`` is refused, never left to run on.

    Raises:
        UserError: epsilon or delta out of range, an unknown accountant, or a search that did not
            finish within its time budget (the message gives RDP's looser answer).
    """
    how = StepSearch(how) if isinstance(how, str) else how
    check_event(step_event, "step_event")
    accountant, value_discretization_interval = how.accountant, how.interval
    eps_target = check_target_epsilon(epsilon)
    check_delta(delta)
    limit = check_int(how.limit, "limit")
    budget = check_positive(how.time_budget_s, "time_budget_s")
    acc = get_accountant(accountant)
    deadline = time.monotonic() + budget
    rdp_answer = None

    def ok(t: int) -> bool:
        if time.monotonic() > deadline:
            hint = f"; RDP's (looser) answer is {rdp_answer} steps" if rdp_answer is not None else ""
            raise UserError(
                f"max_steps: the {accountant} search for the steps within epsilon = {eps_target:g} did "
                f"not finish within {budget:g} s{hint}; use accountant 'rdp', a smaller epsilon or "
                "a smaller limit"
            )
        return (
            acc.epsilon(compose_after(prior, step_event, t), delta, interval=value_discretization_interval)[0]
            <= eps_target
        )

    lo = 0
    if acc.name != "rdp":
        try:
            rdp_answer = max_steps(
                step_event, eps_target, delta, StepSearch("rdp", limit, time_budget_s=budget), prior=prior
            )
        except UserError:
            rdp_answer = None
        if rdp_answer and ok(rdp_answer):
            lo = rdp_answer  # RDP's T is a floor for a tighter accountant (checked, not assumed)
    if lo == 0:
        if not ok(1):
            return 0
        lo = 1
    if lo >= limit:
        return limit
    hi = min(max(lo + 1, lo * 2 if lo < 8 else lo + lo // 4), limit)
    while ok(hi):
        lo = hi
        if hi >= limit:
            return limit
        hi = min(hi * 2, limit)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo
