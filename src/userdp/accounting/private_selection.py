"""The guarantees of a tuning run, re-derived from DpEvents (never from stored numbers).

A model released by ``userdp tune --on private`` was *selected* as the best of K trials, and
selection leaks: the trial's own epsilon is not a guarantee for it. Two bounds are valid for
the released model, and :func:`derive` computes both from the mechanisms' DpEvents:

* **private selection** (Papernot & Steinke 2022, Theorems 2/6): K drawn from the trial-count
  distribution before any trial, each trial the pointwise-max RDP curve of the space's
  mechanisms; an unconditional bound.
* **composition of the K trials run**: K and every trial's hyperparameters were drawn from OS
  entropy, independently of the data, so given the drawn K the K trials' outputs together are
  the adaptive composition of K runs; the released model is a post-processing of them. The
  same figure is the cost of publishing *every* trial (the results table, every model).

The released model's guarantee is the private-selection bound, with K kept secret: a statement that
took the smaller of the two would itself reveal K. The composition is what
publishing K or any other trial costs, and stays in the tuning directory.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence

import numpy as np

from userdp.accounting.events import event_from_dict
from userdp.accounting.rdp import RDP_ORDERS, step_rdp
from userdp.accounting.selection import TrialCount, epsilon_from_rdp, selection_rdp
from userdp.errors import UserError

ORDERS = np.asarray(RDP_ORDERS, dtype=np.float64)


def total_epsilon(curves: Sequence[np.ndarray], count: TrialCount, delta: float) -> float:
    """Epsilon of releasing the best trial, each trial's RDP the pointwise max of ``curves``."""
    rho = np.max(np.vstack(curves), axis=0)
    return epsilon_from_rdp(ORDERS, selection_rdp(ORDERS, rho, count), delta)


def trial_count_from_dict(d: Mapping, source: str) -> TrialCount:
    """The trial-count distribution saved by :meth:`TrialCount.to_dict` (validated).

    Raises:
        UserError: naming ``source``, when a field is missing or out of range."""
    try:
        kind = str(d["kind"])
        vals = {k: float(d[k]) for k in ("eta", "gamma", "mu")}
    except (KeyError, TypeError, ValueError):
        raise UserError(
            f"{source}: malformed trial-count distribution {dict(d) if isinstance(d, Mapping) else d!r}"
        ) from None
    if not all(math.isfinite(v) for v in vals.values()):
        raise UserError(f"{source}: the trial-count distribution has a non-finite parameter")
    return TrialCount(kind, **vals)


def contract_digest(on: str, trial_count: Mapping, delta: float, run_events: Mapping) -> str:
    """sha256 of what a tuning run's released statement rests on, all fixed before its first trial:
    the trial-count distribution, delta and every mechanism's whole-run DpEvent. Each trial's
    configuration carries it (``privacy.tuning_contract``), so the ledger journal of the released
    run is bound to it before its first step; the report re-computes it from the tuning section and
    refuses a section that is not the one the journal was bound to."""
    blob = json.dumps(
        {"on": on, "trial_count": dict(trial_count), "delta": float(delta), "run_events": dict(run_events)},
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def derive(
    mechanism_events: Mapping[str, object],
    trials_run: Sequence[str] | None,
    count: TrialCount,
    delta: float,
    source: str = "tuning",
) -> dict:
    """The released model's guarantee (private selection, K hidden) and, given the trials run, what
    publishing them would cost (their composition).

    The released statement is the private-selection bound alone: it holds only while the number of
    trials K stays secret (Papernot & Steinke 2022), and the statement must not depend on K — the
    smaller of the two bounds would reveal whether K was small. Publishing K, a trial's result or
    any other trial's model moves the guarantee to the composition of the K trials run
    (``epsilon_if_trials_published``, kept in the tuning directory, never in the released files).

    Args:
        mechanism_events: each mechanism of the search space -> the DpEvent of one whole run of
            it (a dict as saved, or a DpEvent).
        trials_run: the mechanism key of each of the K trials drawn, or None (the released files).
        count: the trial-count distribution K was drawn from.
        delta: the delta of both statements.

    Raises:
        UserError: naming ``source``, for a malformed event or an unknown mechanism key."""
    if not mechanism_events:
        raise UserError(f"{source}: no mechanism events to derive the tuning guarantee from")
    if not (isinstance(delta, (int, float)) and 0 < delta < 1):
        raise UserError(f"{source}: delta {delta!r} is not in (0, 1)")
    curves = {}
    for key, ev in mechanism_events.items():
        try:
            event = event_from_dict(ev) if isinstance(ev, dict) else ev
            curves[key] = step_rdp(event, ORDERS)
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(f"{source}: the DpEvent of mechanism {key!r} is malformed ({exc})") from None
    selection = total_epsilon(list(curves.values()), count, float(delta))
    out = {"epsilon_selection_bound": selection, "epsilon_released_model": selection}
    if trials_run is not None:
        unknown = sorted({k for k in trials_run if k not in curves})
        if unknown:
            raise UserError(f"{source}: trials name mechanisms with no event: {', '.join(unknown)}")
        out["epsilon_if_trials_published"] = (
            epsilon_from_rdp(ORDERS, np.sum([curves[k] for k in trials_run], axis=0), float(delta))
            if trials_run
            else 0.0
        )
    return out
