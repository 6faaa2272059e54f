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

The released model's guarantee is the smaller of the two; :func:`derive` also returns both.
"""

from __future__ import annotations

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
        raise UserError(f"{source}: malformed trial-count distribution {dict(d) if isinstance(d, Mapping) else d!r}") from None
    if not all(math.isfinite(v) for v in vals.values()):
        raise UserError(f"{source}: the trial-count distribution has a non-finite parameter")
    return TrialCount(kind, **vals)


def derive(mechanism_events: Mapping[str, object], trials_run: Sequence[str], count: TrialCount,
           delta: float, source: str = "tuning") -> dict:
    """Both bounds for the released model, and the smaller, from the mechanisms' run events.

    Args:
        mechanism_events: each mechanism of the search space -> the DpEvent of one whole run of
            it (a dict as saved, or a DpEvent).
        trials_run: the mechanism key of each of the K trials drawn.
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
    unknown = sorted({k for k in trials_run if k not in curves})
    if unknown:
        raise UserError(f"{source}: trials name mechanisms with no event: {', '.join(unknown)}")
    selection = total_epsilon(list(curves.values()), count, float(delta))
    if trials_run:
        composed = epsilon_from_rdp(ORDERS, np.sum([curves[k] for k in trials_run], axis=0), float(delta))
    else:
        composed = 0.0
    return {"epsilon_selection_bound": selection, "epsilon_trials_run_composed": composed,
            "epsilon_released_model": min(selection, composed),
            "released_bound": "composition of the trials run" if composed < selection else "private selection"}
