"""A saved plan (``userdp plan --save``, ``plan.json`` in a run directory) read back as input.

A plan file is input like any other: it may only choose what ``plan: auto`` may choose
(ULS or ELS, the group size G, the cohort size), every number is range-checked, a conflict with an
explicit ``--set`` is refused naming both, and the epsilon its DP median spent is re-derived from
its recorded pure-DP event (``dp_median_event``), never read as a number.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from userdp.accounting import MAX_ELS_GROUP, event_from_dict, event_to_dict, pure_dp_epsilon, pure_dp_event
from userdp.errors import UserError
from userdp.fileio import read_input
from userdp.lm.config import PLANNED_ALGORITHMS

#: the only keys a plan may set, and what ``plan: auto`` may choose for them
PLAN_CHOICES = ("training.algorithm", "training.group_size", "training.cohort_size")
PLAN_ALGORITHMS = PLANNED_ALGORITHMS
REQUIRED = (
    "applied",
    "overrides",
    "els",
    "uls",
    "inputs",
    "data_touches",
    "dp_median_epsilon_spent",
    "data_fingerprint",
)


def dp_median_event(epsilon: float) -> dict:
    """The DpEvent of an epsilon-DP median (a pure-DP exponential mechanism), as saved: the
    pure-DP stand-in :func:`userdp.accounting.events.pure_dp_event`, which the accountants compose
    with training's steps."""
    return event_to_dict(pure_dp_event(epsilon))


def median_events(plan: dict | None, source: str) -> tuple:
    """The DpEvents a plan released before training (its DP median; none for an exact median or no
    plan), re-derived from the plan's recorded event, never from its number."""
    eps = plan_median_epsilon(plan, source) if plan else 0.0
    return (pure_dp_event(eps),) if eps > 0 else ()


def read_plan(path: str | Path, source: str) -> dict:
    """The JSON object in ``path`` (no tracebacks: a missing, unreadable, non-UTF-8, too deeply
    nested or non-object file is one line naming ``source``)."""
    text = read_input(path, source)
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise UserError(f"{source}: cannot read it ({type(exc).__name__})") from None
    if not isinstance(obj, dict):
        raise UserError(f"{source}: not a userdp plan (expected a JSON object)")
    return obj


def plan_median_epsilon(plan: dict, source: str) -> float:
    """The epsilon the plan's DP median spent, from its event (0 when the median was exact).

    Raises:
        UserError: the figure is missing, negative, non-finite, or disagrees with the event."""
    method = (plan.get("els") or {}).get("group_size_method") if isinstance(plan.get("els"), dict) else None
    claimed = plan.get("dp_median_epsilon_spent", 0.0)
    if isinstance(claimed, bool) or not isinstance(claimed, (int, float)) or not math.isfinite(claimed) or claimed < 0:
        raise UserError(f"{source}: dp_median_epsilon_spent must be a finite number >= 0, got {claimed!r}")
    if method != "dp_median":
        if claimed != 0:
            raise UserError(
                f"{source}: dp_median_epsilon_spent is {claimed} but the plan's median was not a DP "
                "median (els.group_size_method)"
            )
        return 0.0
    ev = plan.get("dp_median_event")
    try:
        eps = pure_dp_epsilon(event_from_dict(ev))
        assert eps is not None and math.isfinite(eps) and eps > 0
    except (AssertionError, KeyError, TypeError, ValueError, ZeroDivisionError, UserError):
        raise UserError(
            f"{source}: the DP median's event (dp_median_event) is missing or malformed; make the "
            "plan again with `userdp plan`"
        ) from None
    if not math.isclose(eps, float(claimed), rel_tol=1e-9, abs_tol=0.0):
        raise UserError(f"{source}: dp_median_epsilon_spent {claimed} differs from its event's epsilon {eps:g}")
    return eps


def plan_choices(plan: dict, source: str) -> dict:
    """The plan's choices (algorithm, group size, cohort size), validated.

    Raises:
        UserError: a missing key, a key ``plan: auto`` may not set, or a value out of range."""
    missing = [k for k in REQUIRED if k not in plan]
    if missing:
        raise UserError(f"{source}: not a userdp plan (missing {', '.join(missing)}); make one with `userdp plan`")
    over = plan["overrides"]
    if not isinstance(over, dict):
        raise UserError(f"{source}: overrides must be an object of {', '.join(PLAN_CHOICES)}")
    extra = sorted(set(over) - set(PLAN_CHOICES))
    if extra or set(over) != set(PLAN_CHOICES):
        raise UserError(
            f"{source}: overrides may set exactly {', '.join(PLAN_CHOICES)} (what plan: auto chooses)"
            + (f"; it also sets {', '.join(extra)}" if extra else "")
        )
    algo, g, cohort = (over[k] for k in PLAN_CHOICES)
    if algo not in PLAN_ALGORITHMS:
        raise UserError(
            f"{source}: training.algorithm must be one of {', '.join(PLAN_ALGORITHMS)} (lower case), got {algo!r}"
        )
    if isinstance(g, bool) or not isinstance(g, int) or not 1 <= g <= MAX_ELS_GROUP:
        raise UserError(f"{source}: training.group_size must be an integer in [1, {MAX_ELS_GROUP}], got {g!r}")
    if isinstance(cohort, bool) or not isinstance(cohort, (int, float)) or not math.isfinite(cohort) or not cohort > 0:
        raise UserError(f"{source}: training.cohort_size must be a finite number > 0, got {cohort!r}")
    if plan["applied"] != algo:
        raise UserError(f"{source}: applied is {plan['applied']!r} but overrides choose {algo!r}")
    plan_median_epsilon(plan, source)
    return {"training.algorithm": algo, "training.group_size": int(g), "training.cohort_size": float(cohort)}


def _same(text: str, value) -> bool:
    if isinstance(value, str):
        return text == value
    try:
        return float(text) == float(value)
    except ValueError:
        return False


def refuse_conflicts(choices: dict, explicit: list[str], source: str) -> None:
    """An explicit ``--set`` of a key the plan chooses, to another value, is refused naming both."""
    for item in explicit or []:
        key, _, value = item.partition("=")
        key = key.strip()
        if key in choices and not _same(value.strip().strip("'\""), choices[key]):
            raise UserError(
                f"--set {item} conflicts with {source}, which sets {key} = {choices[key]}; give one or the other"
            )
