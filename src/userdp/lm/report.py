"""The privacy statement of a run (Ponomareva et al. 2023, §5.3.3), as JSON (``privacy.json``) and Markdown.

The training job saves ``privacy.json`` (:mod:`userdp.lm.statement` fills it from the engine's
:class:`~userdp.engine.privacy_record.PrivacyRecord`); ``build_report(run_dir)`` reads it back with the
resolved config and metrics, re-derives and verifies it, and returns the full statement;
``render_markdown`` prints it.
Every field of the §8.3 checklist is present and non-empty; values that do not apply say so.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from userdp import accounting as A
from userdp.accounting import event_to_dict
from userdp.accounting import private_selection as TG
from userdp.accounting.rdp import step_rdp
from userdp.engine.journal import JOURNAL, check_cited, journal_event, read_chain, steps_begun
from userdp.engine.noise.bandmf import bsr_coefficients
from userdp.engine.noise.chacha import ChaChaNoise, tail_delta
from userdp.errors import UserError
from userdp.fileio import write_atomic, write_json
from userdp.lm import config as C
from userdp.lm.plan_file import plan_median_epsilon
from userdp.lm.run_dir import RunDir, check_metrics_cite_journal, existing_run_dir, read_json, verify_files
from userdp.lm.statement_text import ADJACENCY, COVERAGE, SETTING

TIERS = [
    (1.0, 1, "Tier 1 (epsilon <= 1): strong protection"),
    (10.0, 2, "Tier 2 (epsilon <= 10): reasonable; the common target for ML models"),
    (
        math.inf,
        3,
        "Tier 3 (epsilon > 10): weak; release needs additional measures (empirical "
        "auditing, demonstrated robustness to attacks, or removal of sensitive data)",
    ),
]


def epsilon_tier(eps: float | None) -> dict:
    """Ponomareva et al. 2023, §5.2.1 tier of an epsilon (user-level unit, add/remove adjacency assumed)."""
    if eps is None or not math.isfinite(eps):
        return {
            "tier": None,
            "meaning": "no differential-privacy guarantee (non-private training)",
            "context": "e^10 = 22,026",
        }
    for bound, tier, meaning in TIERS:
        if eps <= bound:
            return {
                "tier": tier,
                "meaning": meaning,
                "context": (
                    f"an adversary's odds about any one user's participation change by "
                    f"at most a factor e^{eps:.3g} = {math.exp(min(eps, 700)):.4g} "
                    "(except with probability delta); for comparison e^10 = 22,026"
                ),
            }
    raise AssertionError  # pragma: no cover


def event_to_json(event: Any) -> Any:
    """A DpEvent as JSON (dp_accounting's named-tuple form, via userdp.accounting); dicts pass."""
    if event is None or isinstance(event, dict):
        return event

    return event_to_dict(event)


def median_composed(dp_event: dict | None) -> bool:
    """Whether a run's saved DpEvent has the plan's DP median composed in it (spent through the
    ledger); a run written before that was so states the median beside it (basic composition)."""
    return dp_event is not None and A.has_pure_dp(A.event_from_dict(dp_event))


REQUIRED = [
    "setting",
    "data_accesses_covered",
    "mechanism_output",
    "unit",
    "adjacency",
    "accountant",
    "assumptions",
    "sampler_used",
    "assumptions_met",
    "epsilon",
    "delta",
    "delta_rule",
    "tuning_guarantee",
    "noise_multiplier",
    "sampling_rate",
    "steps_taken",
    "clip_norm",
    "group_size",
    "not_accounted",
    "library_versions",
    "dp_event",
    "tier",
    "transparency",
]


def verify_epsilon(rec: dict, path: Path) -> None:
    """Re-derive epsilon from the record's DpEvent and refuse a record whose epsilon differs.

    Raises:
        UserError: naming ``path``, when the saved epsilon, event or step count disagree.
    """
    if not rec.get("private", True):
        return
    ev = rec.get("dp_event")
    if ev is None:
        if rec.get("epsilon") not in (None, 0, 0.0):
            raise UserError(f"{path}: epsilon {rec.get('epsilon')} is given without the DpEvent that earned it")
        return
    try:
        event = A.event_from_dict(ev)
        acc = rec.get("engine_record", {}).get("accountant", "pld")
        eps = A.epsilon(event, float(rec["delta"]), acc)
    except (KeyError, TypeError, ValueError, UserError) as exc:
        raise UserError(f"{path}: the saved DpEvent or delta is malformed ({exc})") from None
    claimed = rec.get("epsilon")
    if not isinstance(claimed, (int, float)) or not math.isclose(eps, float(claimed), rel_tol=1e-9, abs_tol=1e-12):
        raise UserError(
            f"{path}: epsilon {claimed} does not match the epsilon of its own DpEvent "
            f"({eps:.6g}): the file was edited or damaged"
        )
    steps = getattr(event, "count", None)
    taken = rec.get("steps_taken")
    if steps is not None and taken is not None and int(steps) != A.cycle_compositions(taken, _bands(rec, path)):
        raise UserError(f"{path}: the DpEvent composes {steps} steps but steps_taken says {taken}")


def check_correlated_noise(rec: dict, bands: int, path: Path) -> None:
    """A record's banded noise is the strategy its bands make (re-derived, not read), and the noise
    of a cyclic run whose noise is banded has the journal's bands. A plugin's banded mechanism brings
    its own coefficients, which the code cannot re-derive: what the accounting assumes of them is
    checked instead (b of them, the first not 0, so C is b-banded and invertible, with column norm
    at most 1); the statement says userdp does not verify a plugin's claim.

    Raises:
        UserError: naming the file, when its strategy or coefficients are not the ones the code uses."""
    engine = rec.get("engine_record") or {}
    noise = engine.get("correlated_noise")
    if noise is None:
        return
    try:
        c = np.asarray(noise["coefficients"], dtype=np.float64)
        if engine.get("noise_mechanism") == "bandmf":
            ok = int(noise["bands"]) == bands and np.allclose(c, bsr_coefficients(bands), rtol=0, atol=1e-15)
        else:
            ok = int(noise["bands"]) == bands == c.size and c[0] != 0 and float(np.linalg.norm(c)) <= 1 + 1e-12
    except (KeyError, TypeError, ValueError, IndexError):
        ok = False
    if not ok:
        raise UserError(
            f"{path}: engine_record.correlated_noise is not the banded strategy of the {bands} bands the ledger "
            "journal records (the file was edited)"
        )


def _bands(rec: dict, path: Path) -> int:
    """b of a cyclic run as its record states it (1 without a cycle); bound to the journal's
    header by :func:`verify_against_journal`."""
    cycle = (rec.get("engine_record") or {}).get("cycle")
    if cycle is None:
        return 1
    bands = cycle.get("bands") if isinstance(cycle, dict) else None
    if not isinstance(bands, int) or isinstance(bands, bool) or bands < 1:
        raise UserError(f"{path}: engine_record.cycle.bands is not a positive integer ({bands!r})")
    return bands


#: how the "Not accounted" line on hyperparameter tuning begins (a verified private tuning guarantee replaces it)
TUNING_LINE_PREFIX = "hyperparameter tuning"


def _ledger_steps(rd: RunDir) -> int | None:
    p = rd.checkpoints / JOURNAL
    return steps_begun(p) if p.is_file() else None


def verify_against_journal(rec: dict, rd: RunDir) -> tuple[dict, int]:
    """The ledger journal is the source of truth: privacy.json must belong to this run (the
    journal's run id and a line of its chain), config.yaml must be the one the journal was bound
    to, and the saved DpEvent must be the journal's step event composed over exactly the steps it
    records as begun, at the delta and with the accountant it was bound to. Every metrics.jsonl
    line's citation of the journal must still hold.

    Returns the journal's header and the steps it records as begun (for the statement's checks).

    Raises:
        UserError: naming the file that disagrees with the journal."""
    journal = rd.checkpoints / JOURNAL
    if not journal.is_file():
        raise UserError(f"{journal}: missing, so {rd.privacy} cannot be checked against the steps the run began")
    header, hashes, begun = read_chain(journal)
    ctx = header.get("context") or {}
    bound = ("config_sha256", "config_privacy_sha256", "engine_privacy_config_sha256")
    if any(k in ctx for k in bound) and not rd.matches_journal(ctx):
        raise UserError(
            f"{rd.config}: not the configuration this run's ledger journal was bound to (edited, or "
            "copied in from another run)"
        )
    check_metrics_cite_journal(rd)
    if not rec.get("private", True):
        if header.get("event") != "non-private":
            raise UserError(f"{rd.privacy}: it says non-private but the ledger journal records a private step event")
        return header, begun
    cited = (rec.get("engine_record") or {}).get("journal")
    if not isinstance(cited, dict):
        raise UserError(
            f"{rd.privacy}: it carries no reference to this run's ledger journal (written by an "
            "older userdp, or copied in from elsewhere)"
        )
    if cited.get("run") != header.get("run"):
        raise UserError(f"{rd.privacy}: it belongs to another run (its ledger journal id differs from {journal}'s)")
    check_cited(journal, hashes, header.get("run"), cited, str(rd.privacy))
    step_event, composed = _journal_steps(rec, header, begun, rd)
    try:
        median = float(ctx.get("plan_dp_median_epsilon") or 0.0)
        prior = (A.pure_dp_event(median),) if median > 0 else ()
    except (TypeError, ValueError, UserError):
        raise UserError(f"{journal}: its plan_dp_median_epsilon is not a number") from None
    # the plan's DP median composed before the steps (spent through the ledger); without it, a run
    # written before the median was so spent (its total then adds the median by basic composition)
    wants = [
        A.event_to_dict(A.compose_after(p, step_event, composed)) if (begun or p) else None
        for p in ((prior, ()) if prior else ((),))
    ]
    if rec.get("dp_event") not in wants:
        raise UserError(
            f"{rd.privacy}: its DpEvent is not the ledger journal's step event composed over the "
            f"{begun} steps the journal records as begun (the file was edited, or is stale)"
        )
    if "delta" in ctx and ctx["delta"] != rec.get("delta"):
        raise UserError(
            f"{rd.privacy}: delta {rec.get('delta')} is not the delta {ctx['delta']} the ledger journal was bound to"
        )
    if "plan_dp_median_epsilon" in ctx:  # a plan's DP median spent before the first step: it must be stated
        bound = float(ctx["plan_dp_median_epsilon"])
        if not rec.get("plan"):
            raise UserError(
                f"{rd.privacy}: the ledger journal records a plan whose DP median spent epsilon = "
                f"{bound:.6g}, but the record carries no plan section (deleted?)"
            )
        got = plan_median_epsilon(rec["plan"], str(rd.privacy))
        if not math.isclose(got, bound, rel_tol=1e-9, abs_tol=1e-12):
            raise UserError(
                f"{rd.privacy}: its plan's DP median spent epsilon = {got:.6g}, not the {bound:.6g} the "
                "ledger journal was bound to (the plan section was edited)"
            )
    acc = (rec.get("engine_record") or {}).get("accountant")
    if "accountant" in ctx and ctx["accountant"] != acc:
        raise UserError(
            f"{rd.privacy}: accountant {acc!r} is not the accountant {ctx['accountant']!r} the "
            "ledger journal was bound to"
        )
    return header, begun


def _journal_steps(rec: dict, header: dict, begun: int, rd: RunDir) -> tuple:
    """(the journal's step event, how many times its ``begun`` steps compose it): ceil(begun / b)
    for a cyclic run over b groups, whose record must state the journal's b and the banded strategy
    those bands make (:func:`check_correlated_noise`).

    Raises:
        UserError: a header that names no step event, or a record whose cycle differs from it."""
    try:
        step_event, bands = journal_event(header["event"])
    except (KeyError, TypeError, ValueError):
        raise UserError(f"{rd.checkpoints / JOURNAL}: its header names no step event") from None
    stated = _bands(rec, rd.privacy)
    if stated != bands:
        raise UserError(f"{rd.privacy}: its cycle of {stated} bands is not the {bands} the ledger journal records")
    check_correlated_noise(rec, bands, rd.privacy)
    return step_event, A.cycle_compositions(begun, bands)


def _event_numbers(event: object, key: str) -> list[float]:
    """Every value of ``key`` anywhere in a DpEvent's dict."""
    if isinstance(event, dict):
        own = [float(event[key])] if isinstance(event.get(key), (int, float)) else []
        return own + [x for v in event.values() for x in _event_numbers(v, key)]
    if isinstance(event, list):
        return [x for v in event for x in _event_numbers(v, key)]
    return []


def verify_mechanism_facts(rec: dict, rd: RunDir, path: Path, header: dict, begun: int) -> None:
    """The figures and sentences the statement prints beside its verified DpEvent are that event's
    own, not the file's: the noise multiplier and the sampling rate (where the journal's step event
    carries them), the steps taken (the steps the journal records as begun), ELS's group size (the
    mixture's largest sensitivity), and the fixed sentences of the setting, the adjacency and what
    is covered.

    Raises:
        UserError: naming the file and the first figure or sentence that differs."""
    try:
        event = json.loads(header["event"])
        _, bands = journal_event(header["event"])
    except (KeyError, TypeError, ValueError):
        raise UserError(f"{rd.checkpoints / JOURNAL}: its header names no step event") from None
    event = event["step"] if bands > 1 else event  # a cyclic run's group rate is q·b

    def close(a, b) -> bool:
        return isinstance(a, (int, float)) and math.isclose(float(a), b, rel_tol=1e-9, abs_tol=1e-12)

    sigmas = _event_numbers(event, "noise_multiplier") + _event_numbers(event, "standard_deviation")
    if sigmas and not any(close(rec.get("noise_multiplier"), s) for s in sigmas):
        raise UserError(
            f"{path}: noise_multiplier {rec.get('noise_multiplier')} is not the ledger journal's step "
            "event's (the file was edited)"
        )
    rates = _event_numbers(event, "sampling_probability")
    rate = rec.get("sampling_rate")
    if rates and not any(close(rate * bands if isinstance(rate, (int, float)) else rate, q) for q in rates):
        raise UserError(
            f"{path}: sampling_rate {rec.get('sampling_rate')} is not the ledger journal's step event's "
            "(the file was edited)"
        )
    if rec.get("steps_taken") != begun:
        raise UserError(
            f"{path}: steps_taken {rec.get('steps_taken')} is not the {begun} steps the ledger journal "
            "records as begun (the file was edited)"
        )
    if event.get("class_name") == "MixtureOfGaussiansDpEvent":
        sens = [float(x) for x in event.get("sensitivities") or []]
        if sens and rec.get("group_size") != int(max(sens)):
            raise UserError(
                f"{path}: group_size {rec.get('group_size')} is not the step event's G = {int(max(sens))} "
                "(the file was edited)"
            )
    for key, text in (("setting", SETTING), ("adjacency", ADJACENCY), ("mechanism_output", COVERAGE)):
        if rec.get(key) != text:
            raise UserError(f"{path}: its {key} is not the statement userdp writes (the file was edited)")
    seeded = _seeded_by_config(rd)
    if seeded is not None and bool(rec.get("seeded")) != seeded:
        raise UserError(
            f"{path}: seeded is {rec.get('seeded')!r}, but the configuration the ledger journal was bound "
            f"to {'gives' if seeded else 'gives no'} seed (the file was edited)"
        )
    if seeded and not any(str(a).startswith("SEEDED RUN") for a in rec.get("assumptions") or []):
        raise UserError(f"{path}: the run was seeded but its assumptions do not say so (the file was edited)")


def _seeded_by_config(rd: RunDir) -> bool | None:
    """Whether the journal-bound config.yaml gives the run a seed (`userdp train`'s training.seed, or
    the Trainer's privacy config); None where it cannot be read from it."""
    raw = C.load_yaml(rd.config) if rd.config.is_file() else None
    if not isinstance(raw, dict):
        return None
    training = raw.get("training")
    if isinstance(training, dict) and "seed" in training:
        return training["seed"] is not None
    hf = raw.get("hf_trainer")
    if isinstance(hf, dict) and isinstance(hf.get("privacy"), str):
        m = re.search(r"\bseed=(None|\d+)", hf["privacy"])
        return None if m is None else m.group(1) != "None"
    return None


def verify_scope(rec: dict, ctx: dict, path: Path, tuned: bool) -> None:
    """The statement's scope is the one its ledger journal was bound to before the first step: the
    number of users N (bound by the engine) and of training records it prints, and every "Not
    accounted" line the job's facts gave (a file may add lines, never drop one; the tuning line
    only for a run whose private tuning guarantee verified, ``tuned``).

    Raises:
        UserError: naming the file and the first figure or line that differs."""
    if "num_users" in ctx and rec.get("num_users") != ctx["num_users"]:
        raise UserError(
            f"{path}: num_users {rec.get('num_users')} is not the {ctx['num_users']} users the ledger "
            "journal was bound to (the file was edited)"
        )
    scope = ctx.get("statement")
    if not isinstance(scope, dict):  # a run written before the journal bound its statement's scope
        return
    if rec.get("num_records") != scope.get("num_records"):
        raise UserError(
            f"{path}: num_records {rec.get('num_records')} is not the {scope.get('num_records')} "
            "training records the ledger journal was bound to (the file was edited)"
        )
    have = rec.get("not_accounted")
    have = set(have) if isinstance(have, list) and all(isinstance(x, str) for x in have) else set()
    for line in scope.get("not_accounted") or []:
        if line not in have and not (tuned and line.startswith(TUNING_LINE_PREFIX)):
            raise UserError(
                f"{path}: its not_accounted list lacks a line the ledger journal was bound to "
                f"({line[:60]!r}...): a disclosure was removed"
            )


def verify_tuning(rec: dict, path: Path, contract: str | None) -> float | None:
    """A run released by `userdp tune --on private`: the tuning section must be the contract the
    run's configuration — and so its ledger journal, bound to it before the first step — names
    (``privacy.tuning_contract``); the released model's guarantee is re-derived from the contract's
    mechanism events and trial-count distribution (private selection, K secret), this run's own
    event must lie within its mechanism's, and a stored figure that differs is refused. Returns the
    re-derived epsilon (None for a run that was not selected by private tuning).

    Raises:
        UserError: naming the file, for a section the journal was not bound to, or an edited one."""
    t = rec.get("tuning")
    if t is None:  # a trial's own report (written as it ends, before any selection): see build_report
        return None
    src = f"{path} (tuning)"
    if not isinstance(t, dict) or t.get("on") not in ("private", "public"):
        raise UserError(f"{src}: not a tuning section written by userdp")
    if t.get("on") != "private":
        return None
    if contract is None:
        raise UserError(
            f"{src}: a private tuning section, but this run's configuration (bound to its ledger "
            "journal) names no tuning contract: the section was added after the run"
        )
    try:
        events, best_mech = t["run_events"], t["best"]["mechanism"]
        delta = float(t["delta"])
        digest = TG.contract_digest("private", t["trial_count"], delta, events)
    except (KeyError, TypeError, ValueError, AttributeError):
        raise UserError(f"{src}: the tuning section lacks the contract its guarantee is derived from") from None
    if digest != contract:
        raise UserError(
            f"{src}: the tuning section is not the contract this run's journal was bound to "
            "(edited, or copied from another tuning run)"
        )
    if delta != rec.get("delta"):
        raise UserError(f"{src}: the tuning guarantee's delta {delta} is not the run's {rec.get('delta')}")
    g = TG.derive(events, None, TG.trial_count_from_dict(t.get("trial_count") or {}, src), delta, source=src)
    if best_mech not in events:
        raise UserError(f"{src}: the released trial's mechanism {best_mech!r} has no event")
    own = step_rdp(A.event_from_dict(rec["dp_event"]), TG.ORDERS)
    allowed = step_rdp(A.event_from_dict(events[best_mech]), TG.ORDERS)
    if np.any(own > allowed * (1 + 1e-9) + 1e-12):
        raise UserError(f"{src}: this run spent more than its mechanism's event in the tuning guarantee")
    eps = g["epsilon_released_model"]
    claimed = t.get("epsilon_total")
    if not isinstance(claimed, (int, float)) or not math.isclose(claimed, eps, rel_tol=1e-9, abs_tol=1e-12):
        raise UserError(
            f"{src}: epsilon_total {claimed} is not the guarantee its events give ({eps:.6g}): the "
            "file was edited or damaged"
        )
    return eps


def tuning_contract(rd: RunDir) -> str | None:
    """The tuning contract config.yaml names (``privacy.tuning_contract``), None without one."""
    raw = C.load_yaml(rd.config) if rd.config.is_file() else {}
    priv = raw.get("privacy") if isinstance(raw, dict) else None
    value = priv.get("tuning_contract") if isinstance(priv, dict) else None
    return value if isinstance(value, str) else None


#: the small delta at which the report and the model card also state epsilon (when the run's own is larger)
REFERENCE_DELTA = 1e-6


def _at_delta(rec: dict, delta: float, path: Path) -> dict:
    """Epsilon at another delta (what Opacus users call ``get_epsilon(delta)``), from the verified
    event: the run's own, plus a plan's pure-DP median, or the tuning guarantee re-derived."""
    if not rec.get("private", True) or rec.get("dp_event") is None:
        return {"delta": delta, "epsilon": None, "note": "no guarantee (non-private)"}
    acc = (rec.get("engine_record") or {}).get("accountant", "pld")
    own = A.epsilon(A.event_from_dict(rec["dp_event"]), delta, acc)
    out = {"delta": delta, "epsilon_run": own}
    t = rec.get("tuning") if isinstance(rec.get("tuning"), dict) else {}
    if t.get("on") == "private":
        g = TG.derive(
            t["run_events"],
            None,
            TG.trial_count_from_dict(t.get("trial_count") or {}, str(path)),
            delta,
            source=str(path),
        )
        out["epsilon"] = g["epsilon_released_model"]
        out["note"] = "the released (selected) model's guarantee at this delta"
    else:
        inside = median_composed(rec["dp_event"])
        out["epsilon"] = own + (0.0 if inside else float(rec.get("epsilon_plan") or 0.0))
        out["note"] = "re-derived from the run's DpEvent" + (
            (" (the plan's DP median composed in it)" if inside else " plus the plan's DP median")
            if rec.get("epsilon_plan")
            else ""
        )
    nt = (rec.get("engine_record") or {}).get("noise_tail")
    if nt:  # the sampler's tail term grows with epsilon: stated beside the requested delta
        out["delta_noise_tail"] = tail_delta(
            int(nt["coordinates"]), int(rec["steps_taken"]), out["epsilon"], ChaChaNoise.tail_mass_per_pair
        )
    return out


def _plan_epsilon(rec: dict, path: Path) -> float:
    """The epsilon a plan's DP median spent, re-derived from its pure-DP event (0 without one)."""
    plan = rec.get("plan")
    if not plan:
        return 0.0
    return plan_median_epsilon(plan, str(path))


def build_report(run_dir: str | Path, delta: float | None = None) -> dict:
    """The verified statement of ``run_dir``; with ``delta``, also epsilon at that delta,
    re-derived from the verified DpEvent (``at_delta``).

    Raises:
        UserError: a missing, damaged or edited file (naming it), or a delta outside (0, 1)."""
    if delta is not None and not (isinstance(delta, float) and 0.0 < delta < 1.0):
        raise UserError(f"--delta must be in (0, 1), got {delta}")
    rd = existing_run_dir(run_dir)
    if not rd.privacy.is_file():
        begun = _ledger_steps(rd)
        if begun:
            raise UserError(
                f"{run_dir}: no privacy.json yet, but the ledger journal records {begun} steps "
                "begun (the run stopped before it could write its statement); "
                f"`userdp train --resume {run_dir}` completes the accounting"
            )
        raise UserError(f"{run_dir}: no privacy.json yet (the run has not taken a step)")
    rec = read_json(rd.privacy)
    if not isinstance(rec, dict):
        raise UserError(f"{rd.privacy}: not a privacy record (expected a JSON object)")
    verify_epsilon(rec, rd.privacy)
    header, begun = verify_against_journal(
        rec, rd
    )  # the verified chain: its event must compose exactly the steps begun
    verify_files(rd)
    rec = dict(rec)
    nt = (rec.get("engine_record") or {}).get("noise_tail")
    if rec.get("private", True) and nt:  # re-derived: the sampler's dropped tail, added to delta
        try:
            tail = tail_delta(
                int(nt["coordinates"]), int(rec["steps_taken"]), float(rec["epsilon"]), ChaChaNoise.tail_mass_per_pair
            )
        except (KeyError, TypeError, ValueError):
            raise UserError(f"{rd.privacy}: the noise sampler's tail record is malformed") from None
        rec["delta_noise_tail"] = tail
        rec["delta_stated"] = float(rec["delta"]) + tail
    # every headline figure is re-derived here, never read from the file
    if rec.get("private", True):
        plan_eps = _plan_epsilon(rec, rd.privacy)
        contract = tuning_contract(rd)
        tuned = verify_tuning(rec, rd.privacy, contract)
        verify_scope(rec, header.get("context") or {}, rd.privacy, tuned is not None)
        verify_mechanism_facts(rec, rd, rd.privacy, header, begun)
        if contract is not None and tuned is None:  # one trial of a private tuning run, not (yet) selected
            rec["not_accounted"] = list(rec.get("not_accounted") or []) + [
                "this run is one trial of a private tuning run: its epsilon covers this run on its own; if it is "
                "released as the selected trial, the guarantee is the tuning guarantee (userdp tune writes it "
                "into the selected run), never this trial's epsilon"
            ]
        inside = median_composed(rec.get("dp_event"))
        total = tuned if tuned is not None else float(rec["epsilon"]) + (0.0 if inside else plan_eps)
        rec["epsilon_plan"] = plan_eps if rec.get("plan") is not None else None
        rec["epsilon_total"] = total
        rec["tier"] = epsilon_tier(total)
    if delta is not None:
        rec["at_delta"] = _at_delta(rec, delta, rd.privacy)
    stated = rec.get("delta_stated", rec.get("delta"))
    if rec.get("private", True) and isinstance(stated, float) and stated > REFERENCE_DELTA and delta != REFERENCE_DELTA:
        # epsilon at a small delta that does not move with N, beside the run's own: how a
        # reviewer compares runs of different sizes
        rec["at_reference_delta"] = _at_delta(rec, REFERENCE_DELTA, rd.privacy)
    # one key, one meaning, in every file and --json: "epsilon" is the released model's
    # guarantee; the training run's own figure is "epsilon_run"
    rec["epsilon_run"] = rec.get("epsilon")
    if rec.get("private", True) and rec.get("epsilon_total") is not None:
        rec["epsilon"] = rec["epsilon_total"]
    state = rd.read_state()
    ev = read_json(rd.eval) if rd.eval.is_file() else {}
    rec["status"] = state.get("status", "unknown")
    rec["evaluation"] = ev
    return rec


def _fmt(v: Any) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _render_evaluation(L: list, ev: dict, private: bool = True) -> None:
    if not ev:
        return
    L.append(
        "## 7. Held-out-user evaluation (not a DP release)"
        if private
        else "## Held-out-user evaluation (not a DP release)"
    )
    L.append(
        "- computed without noise on held-out users' records; those users are outside the "
        "training data, and these numbers are not covered by the guarantee above"
        if private
        else "- computed on held-out users' records (users outside the training data)"
    )
    for k in ("before", "after"):
        if k in ev and ev[k]:
            L.append(
                f"- {k}: loss {_fmt(ev[k].get('loss'))}, perplexity "
                f"{_fmt(ev[k].get('perplexity'))} (token-weighted); per-user mean loss "
                f"{_fmt(ev[k].get('user_loss'))} over {ev[k].get('num_users')} users"
            )


def _render_audit(L: list, a: dict) -> None:
    """The "Empirical audit" section (docs/audit.md), when the run was audited."""
    if not a:
        return
    L.append("## 8. Empirical audit (a lower bound, beside the accounted upper bound)")
    L.append(f"- **{a.get('statement', '')}**")
    if a.get("mechanism_caught"):
        L.append(
            "- **The audited lower bound exceeds the accounted epsilon: the implementation or its "
            "accounting is broken, and the guarantee above must not be relied on.**"
        )
    L.append(f"- design: {a.get('design')}")
    L.append(f"- score: {a.get('score')}")
    L.append(
        f"- bound: Steinke et al. (2023), Thm 5.2, at delta = {_fmt(a.get('delta'))} and confidence "
        f"{_fmt(a.get('confidence'))}; {a.get('correct')} of {a.get('guesses')} guesses correct "
        f'({a.get("k_plus")} "in", {a.get("k_minus")} "out"; the best of {a.get("guess_grid")} guess '
        f"counts fixed in advance, paid for by a union bound); canary ROC AUC {_fmt(a.get('canary_auc'))}"
    )
    ui = a.get("user_inference")
    if ui:
        L.append(
            f"- user inference on real users (diagnostic): ROC AUC {_fmt(ui.get('auc'))}, TPR at 1% FPR "
            f"{_fmt(ui.get('tpr_at_1pct_fpr'))}; {ui.get('note')}"
        )
    L.append(f"- what it shows: {a.get('shows')}")
    L.append(f"- what it does not show: {a.get('does_not_show')}")


def render_markdown(rep: dict) -> str:
    L = []
    private = rep.get("private", True)
    # no folder name, path or trial number: a tuned run's folder would tell how many trials ran
    L.append(f"# Privacy statement: {'user-level differential privacy' if private else 'no privacy guarantee'}")
    L.append("")
    if not private:
        L.append(
            "**No differential-privacy guarantee.** This run trained without noise "
            "(`training.algorithm: nonprivate`): its model and checkpoints may reveal any training "
            "user's data. Nothing here is a privacy statement."
        )
        L.append("")
        _render_evaluation(L, rep.get("evaluation") or {}, private=False)
        _render_audit(L, rep.get("audit") or {})
        return "\n".join(L) + "\n"
    if rep.get("status") == "interrupted" or rep.get("stopped") == "interrupted":
        L.append(
            f"**Interrupted** after {rep.get('steps_applied', rep.get('steps_taken'))} of "
            f"{rep.get('steps_planned')} planned steps (Ctrl-C); the statement below covers every step "
            f"begun ({rep.get('steps_taken')}). `userdp train --resume` continues the run."
        )
        L.append("")
    plan = rep.get("plan")
    plan_eps = rep.get("epsilon_plan") or 0.0
    composed = median_composed(rep.get("dp_event"))
    tuning = rep.get("tuning") if isinstance(rep.get("tuning"), dict) else {}
    if private and tuning.get("on") == "private":
        L.append(
            f"**Guarantee.** This model was selected by `userdp tune` among trials whose number was drawn "
            f"in secret; the released model (and every checkpoint of this run) satisfies user-level "
            f"({_fmt(rep['epsilon_total'])}, {_fmt(rep.get('delta_stated', rep['delta']))})-differential "
            f"privacy under add/remove-one-user adjacency — {rep['tier']['meaning']} — by private selection "
            "(Papernot & Steinke 2022), which holds while the number of trials stays secret: publishing it, "
            "or any other trial's score or model, voids this bound (the tuning directory's tune.json states "
            "what that would cost). This trial's own epsilon, "
            f"{_fmt(rep.get('epsilon_run', rep.get('epsilon')))}, is the epsilon of one "
            "trial, not a guarantee for the selected model."
        )
    elif private and plan_eps and composed:
        L.append(
            f"**Guarantee.** The final model (and every checkpoint) satisfies user-level "
            f"({_fmt(rep['epsilon_total'])}, {_fmt(rep.get('delta_stated', rep['delta']))})-differential privacy "
            f"under add/remove-one-user adjacency in total: the plan's DP median of records per user "
            f"(epsilon = {_fmt(plan_eps)} on its own) and training, composed by the accountant (the median's "
            f"pure-DP event before the steps, counted by the ledger against the target) — "
            f"{rep['tier']['meaning']}. The plan's other data touches are not accounted (section 3)."
        )
    elif private and plan_eps:
        L.append(
            f"**Guarantee.** The final model (and every checkpoint) satisfies user-level "
            f"({_fmt(rep['epsilon_total'])}, {_fmt(rep.get('delta_stated', rep['delta']))})-differential privacy "
            f"under add/remove-one-user adjacency in total: training spent epsilon = "
            f"{_fmt(rep.get('epsilon_run', rep.get('epsilon')))} and the plan's DP median of records per user spent "
            f"epsilon = {_fmt(plan_eps)} (basic composition) — {rep['tier']['meaning']}. "
            "The plan's other data touches are not accounted (section 3)."
        )
    elif private:
        L.append(
            f"**Guarantee.** The final model (and every checkpoint) satisfies user-level "
            f"({_fmt(rep['epsilon'])}, {_fmt(rep.get('delta_stated', rep['delta']))})-differential privacy "
            f"under add/remove-one-user adjacency — {rep['tier']['meaning']}."
        )
    else:
        L.append("**No differential-privacy guarantee**: this run trained without noise.")
    for ad in (rep.get("at_reference_delta"), rep.get("at_delta")):
        if private and ad and ad.get("epsilon") is not None:
            L.append("")
            L.append(
                f"**At delta = {_fmt(ad['delta'])}:** epsilon = {_fmt(ad['epsilon'])} ({ad['note']})"
                + (
                    f"; the noise sampler's tail adds {_fmt(ad['delta_noise_tail'])} to that delta"
                    if ad.get("delta_noise_tail")
                    else ""
                )
                + "."
            )
    if private and rep.get("sampler_used") == "shuffle_fixed_batches":
        L.append("")
        L.append(
            "**Shuffled batches.** Training used shuffled fixed-size batches, which have no proven "
            "privacy amplification, so the epsilon above is the guarantee WITHOUT amplification"
            + (
                f"; assuming Poisson sampling would have given epsilon = "
                f"{_fmt(rep.get('epsilon_assuming_poisson'))}, a comparison only, not a guarantee"
                if rep.get("epsilon_assuming_poisson") is not None
                else ""
            )
            + "."
        )
    if private and rep.get("seeded"):
        L.append("")
        L.append(
            "**Seeded run.** The sampling and the noise derive from the seed in the configuration: "
            "whoever holds the seed can recompute the noise and remove it, so the guarantee holds "
            "only against parties who do not know the seed."
        )
    L.append("")
    L.append("## 1. Setting")
    L.append(f"- {rep['setting']}")
    L.append("## 2. Instantiation of the definition")
    L.append(f"- (a) data accesses covered: {rep['data_accesses_covered']}")
    L.append(f"- (b) mechanism output: {rep['mechanism_output']}")
    L.append(f"- (c) unit of privacy: {rep['unit']}")
    L.append(f"- (d) adjacency: {rep['adjacency']}")
    L.append("## 3. Accounting")
    L.append(f"- (a) accountant: {rep['accountant']}")
    L.append("- (b) assumptions:")
    for a in rep["assumptions"]:
        L.append(f"  - {a}")
    met = rep.get("assumptions_met")
    L.append(
        f"  - sampler assumed: `{rep.get('sampler_assumed')}`; sampler used: "
        f"`{rep['sampler_used']}` — assumptions met: "
        f"{'yes' if met else ('n/a' if met is None else 'NO')}"
    )
    if met is False:
        L.append(
            f"  - **Mismatch**: the accountant assumed Poisson sampling but training used "
            f"`{rep['sampler_used']}`. Guarantee without amplification: epsilon = "
            f"{_fmt(rep.get('epsilon_no_amplification'))}."
        )
    if tuning.get("on") == "private":
        L.append(
            f"- (c) this trial alone: epsilon = {_fmt(rep.get('epsilon_run', rep.get('epsilon')))} "
            "(the epsilon of one trial, not a "
            f"guarantee for the selected model); the released model: epsilon = {_fmt(rep['epsilon_total'])}, "
            f"delta = {_fmt(rep['delta'])} ({rep['delta_rule']})"
        )
    else:
        L.append(
            f"- (c) final model: epsilon = {_fmt(rep.get('epsilon_run', rep.get('epsilon')))} (target "
            f"{_fmt(rep.get('epsilon_target'))}), delta = {_fmt(rep['delta'])} "
            f"({rep['delta_rule']})"
        )
    if plan_eps and composed:
        L.append(
            f"- (c) extra spend: the plan's epsilon-DP median (ELS group size), epsilon = {_fmt(plan_eps)} on "
            f"its own, is inside the final model's epsilon = {_fmt(rep.get('epsilon_total'))}: the ledger "
            "counted its event before the first step, and sigma was calibrated to leave room for it"
        )
    elif plan_eps:
        L.append(
            f"- (c) extra spend: the plan's epsilon-DP median (ELS group size) spent epsilon = "
            f"{_fmt(plan_eps)}; total epsilon = {_fmt(rep.get('epsilon_total'))} (basic "
            "composition with the training run)"
        )
    L.append(f"- (c) tuning process: {rep['tuning_guarantee']}")
    L.append("- Not accounted:")
    for n in rep["not_accounted"]:
        L.append(f"  - {n}")
    L.append("## 4. Parameters")
    L.append("| quantity | value |")
    L.append("|---|---|")
    for key, label in [
        ("algorithm", "algorithm"),
        ("noise_multiplier", "noise multiplier sigma"),
        ("sampling_rate", "sampling rate q"),
        ("expected_cohort", "expected units per step"),
        ("steps_taken", "steps T taken"),
        ("steps_planned", "steps planned"),
        ("clip_norm", "clip norm C"),
        ("clipping", "clipping"),
        ("group_size", "group size G"),
        ("selection", "record selection"),
        ("num_users", "training users N"),
        ("num_records", "training records"),
    ]:
        L.append(f"| {label} | {_fmt(rep.get(key))} |")
    if plan:
        ov = plan.get("overrides") or {}
        i = plan.get("inputs") or {}
        L.append(f"## 4b. Plan ({plan.get('source') or '`plan: auto`'}, docs/plan.md)")
        L.append(
            f"- applied: {str(plan.get('applied', '')).upper()} ({plan.get('choice', '')}; "
            f"recommended {str(plan.get('recommended', '')).upper()}) for a compute budget of "
            f"{_fmt(i.get('compute_budget'))} gradients/step: " + ", ".join(f"{k} = {_fmt(v)}" for k, v in ov.items())
        )
        for name in ("uls", "els"):
            d = plan.get(name) or {}
            L.append(
                f"- {name.upper()}: group size {_fmt(d.get('group_size'))}, "
                + (
                    f"cohort {_fmt(d.get('cohort_size'))}"
                    if name == "uls"
                    else f"expected batch {_fmt(d.get('expected_batch_size'))}"
                )
                + f", sigma {_fmt(d.get('noise_multiplier'))}, noise std proxy "
                f"{_fmt(d.get('noise_std_proxy'))}"
            )
        L.append("- its non-private data touches are listed under Not accounted (section 3)")
    L.append("## 5. Tier (Ponomareva et al. 2023)")
    t = rep["tier"]
    L.append(f"- {t['meaning']}. {t['context']}.")
    L.append("## 6. Transparency")
    L.append(f"- {rep['transparency']}")
    L.append("- library versions: " + ", ".join(f"{k} {v}" for k, v in rep["library_versions"].items()))
    L.append("- DpEvent of the whole run (dp_accounting):")
    L.append("```json")
    L.append(json.dumps(rep["dp_event"]))
    L.append("```")
    _render_evaluation(L, rep.get("evaluation") or {})
    _render_audit(L, rep.get("audit") or {})
    return "\n".join(L) + "\n"


MODEL_CARD = "README.md"


def card_facts(rd: RunDir) -> dict:
    """What the card says of the model beside the statement: its base (``base_model``: a Hub id the
    starting folder's config names, else None), whether a LoRA adapter was trained, and the preset."""
    raw = C.load_yaml(rd.config) if rd.config.is_file() else {}
    model = raw.get("model") if isinstance(raw, dict) else None
    model = model if isinstance(model, dict) else {}
    base = None
    path = model.get("path")
    if isinstance(path, str) and (Path(path) / "config.json").is_file():
        try:
            named = json.loads((Path(path) / "config.json").read_text()).get("_name_or_path")
        except (OSError, ValueError, AttributeError):
            named = None
        # a Hub id ("org/name"), not a local path: the folder was downloaded from the Hub
        base = named if isinstance(named, str) and named.count("/") == 1 and not Path(named).exists() else None
    lora = model.get("lora") if isinstance(model.get("lora"), dict) else {}
    return {"base_model": base, "lora": bool(lora.get("enabled")), "preset": model.get("preset"), "path": path}


def model_card(rep: dict, facts: dict | None = None) -> str:
    """A Hugging Face model card (``README.md`` with YAML metadata, as the Hub's model-card
    conventions have it: ``pipeline_tag``, ``library_name``, ``tags``, ``base_model`` where the
    starting model is a Hub id, ``model-index`` with the held-out-user perplexity) stating the
    verified guarantee, the unit, the data touches outside it, the tier and the intended use, so that
    whoever publishes the model folder publishes the statement with it. ``facts``: :func:`card_facts`."""
    facts = facts or {}
    private = rep.get("private", True)
    eps = rep.get("epsilon_total") if private else None
    delta = rep.get("delta_stated", rep.get("delta")) if private else None
    tier = rep.get("tier") or {}
    after = (rep.get("evaluation") or {}).get("after") or {}
    meta = _card_meta(rep, facts, eps, delta)
    lines = ["---", yaml.safe_dump(meta, sort_keys=False).strip(), "---", ""]
    # the title names nothing of the run's folder (a tuned run's would tell which trial won)
    base = facts.get("base_model") or (
        f"a `{facts['preset']}` GPT" if facts.get("preset") and not facts.get("path") else ""
    )
    what = f"{base} fine-tuned" if base else "Fine-tuned"
    what += " (LoRA adapter)" if facts.get("lora") else ""
    lines.append(
        f"# {what[0].upper() + what[1:]} with user-level differential privacy by userdp"
        if private
        else f"# {what[0].upper() + what[1:]} without differential privacy by userdp (a non-private baseline)"
    )
    lines.append("")
    if private:
        lines.append(
            f"**Guarantee.** This model (and every checkpoint of its training run) satisfies user-level "
            f"({_fmt(eps)}, {_fmt(delta)})-differential privacy under add/remove-one-user adjacency: "
            f"it is almost the same whether or not any one person's data — all of it — was used. "
            f"{tier.get('meaning', '')}."
        )
        ref = rep.get("at_reference_delta") or {}
        if ref.get("epsilon") is not None:
            lines.append("")
            lines.append(
                f"At delta = {_fmt(ref['delta'])}, the same training satisfies epsilon = {_fmt(ref['epsilon'])}."
            )
        if isinstance(rep.get("tuning"), dict) and rep["tuning"].get("on") == "private":
            lines.append("")
            lines.append(
                "It was selected by `userdp tune` among trials whose number is kept secret (private "
                "selection); the epsilon above is the selected model's guarantee, not one trial's."
            )
    else:
        lines.append(
            "**No differential-privacy guarantee.** This model was trained without noise: it may "
            "reveal any training user's data."
        )
    lines += [
        "",
        "## Unit of privacy",
        "",
        f"- {rep.get('unit', 'n/a')}",
        "",
        "## Not covered by the guarantee (non-private touches of the data, and what is assumed)",
        "",
    ]
    lines += [f"- {n}" for n in rep.get("not_accounted") or []]
    lines += [f"- assumed: {a}" for a in rep.get("assumptions") or [] if a != "none"]
    lines += _card_use_and_evaluation(rep, private, after)
    return "\n".join(lines)


def _card_meta(rep: dict, facts: dict, eps, delta) -> dict:
    """The card's YAML metadata (the Hub's keys, and userdp's statement under ``userdp``)."""
    private = rep.get("private", True)
    tier = rep.get("tier") or {}
    # a hub search for differential privacy must not find the non-private baseline
    tags = (
        ["differential-privacy", "user-level-differential-privacy", "userdp"]
        if private
        else ["userdp", "non-private-baseline"]
    )
    if facts.get("lora"):
        tags = [*tags, "lora", "peft"]
    after = (rep.get("evaluation") or {}).get("after") or {}
    meta: dict = {
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        **({"base_model": facts["base_model"]} if facts.get("base_model") else {}),
        "tags": tags,
        "userdp": {
            "private": bool(private),
            "epsilon": eps,
            "delta": delta,
            "unit": "user" if private else None,
            "adjacency": "add/remove one user" if private else None,
            "algorithm": rep.get("algorithm"),
            "tier": tier.get("tier"),
            "epsilon_at_delta_1e-6": (rep.get("at_reference_delta") or {}).get("epsilon") if private else None,
        },
    }
    if after.get("perplexity") is not None:  # the Hub's eval results: the held-out users' perplexity
        meta["model-index"] = [
            {
                "name": "userdp fine-tune",
                "results": [
                    {
                        "task": {"type": "text-generation", "name": "causal language modeling"},
                        "dataset": {"name": "held-out users of the private data", "type": "private"},
                        "metrics": [{"type": "perplexity", "value": round(float(after["perplexity"]), 4)}],
                    }
                ],
            }
        ]
    return meta


def _card_use_and_evaluation(rep: dict, private: bool, after: dict) -> list[str]:
    """The card's intended use, evaluation and how to check it."""
    out = ["", "## Intended use", ""]
    out.append(
        "Text generation in the domain of the fine-tuning data, where the people who wrote that data must "
        "not be identifiable from the model. The guarantee covers the authors of the fine-tuning data only: "
        "not the base model's training data, nor people mentioned in someone else's text. Add the licenses of "
        "the base model and of the data before publishing."
        if private
        else "A baseline for comparison only: do not publish it where the training authors' privacy matters."
    )
    if after.get("perplexity") is not None:
        out += [
            "",
            "## Evaluation",
            "",
            f"- held-out-user perplexity {float(after['perplexity']):.4g} (token-weighted; users not in the training "
            "data, computed without noise, not a DP release)",
        ]
    out += [
        "",
        "## Check it",
        "",
        "The evidence (the ledger journal, the DpEvent, checksums) is in the run directory, or under `userdp/` "
        "in a release bundle (`userdp export`): `userdp report <run directory or bundle>` re-derives every figure "
        "above and refuses edited files.",
        "",
    ]
    return out


def write_report(run_dir: str | Path, delta: float | None = None) -> tuple[dict, str]:
    rep = build_report(run_dir, delta)
    md = render_markdown(rep)
    rd = existing_run_dir(run_dir)
    write_atomic(rd.report_md, md)
    write_json(rd.report_json, rep)
    if rd.model.is_dir():  # the released folder carries the verified statement
        write_atomic(rd.model / MODEL_CARD, model_card(rep, card_facts(rd)))
    return rep, md
