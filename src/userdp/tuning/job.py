"""The `userdp tune` job: calibrate, draw the trial count once, run the trials, release the best.

The tuning directory holds:

* ``tune.json`` — the plan, written before the first trial (like the ledger, before any effect):
  the trial-count distribution, the drawn count K, every trial's hyperparameters (drawn up front
  from 128 bits of OS entropy), sigma per mechanism, the guarantee. A resume reads it and never
  draws again.
* ``trials/<random name>/`` — one ``userdp train`` run directory per trial (resumable), named by 64
  random bits drawn when the plan is made: the winner's folder name, which its released files never
  print, still tells nothing of its position or of how many trials ran.
* ``results.csv``, ``results.json``, ``scores.png`` — every trial's held-out score. NOT covered by
  the tuning guarantee (which covers the best trial only): publishing them is the composition of
  all K runs, stated in ``tuning.json``.
* ``best`` — a link to the winning trial, whose report gains both guarantees.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
import re
import secrets
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from userdp.accounting import event_to_dict
from userdp.accounting import private_selection as TG
from userdp.accounting.selection import TrialCount
from userdp.caches import shared_run_cache
from userdp.data.splits import user_ids_of
from userdp.errors import UserError
from userdp.fileio import write_atomic, write_json
from userdp.lm import config as C
from userdp.lm.finetune import run
from userdp.lm.job_plan import check_cohort, mechanism_plan, num_units
from userdp.lm.prepare import prepare_data
from userdp.lm.report import epsilon_tier, write_report
from userdp.lm.run_dir import RunDir, read_json
from userdp.tuning import accounting as TA
from userdp.tuning.space import Space, mechanism_key, validate_space

Log = Callable[[str], None]
STATE = "tune.json"


def trial_dir_name() -> str:
    """A trial's folder name: 64 random bits, nothing of the trial's index (a folder named by its
    index would tell whoever sees the winner's path that at least that many trials ran, and the
    private-selection bound needs their number kept secret)."""
    return "trial-" + secrets.token_hex(8)


def _overrides(params: dict) -> list[str]:
    return [f"{k}={json.dumps(v) if isinstance(v, str) else v}" for k, v in params.items()]


def _trial_config(base: dict, params: dict, extra: list[str]) -> C.RunConfig:
    raw = C.apply_overrides(json.loads(json.dumps(base)), _overrides(params) + extra)
    return C.from_dict(raw, "tuning trial")


def _plan_for(cfg: C.RunConfig, prep, tau: float | None):
    """The trial's RunPlan (calibrated to tau, or at the config's fixed sigma when tau is None)."""
    n_units = num_units(cfg, prep.train_subset)
    check_cohort(cfg, n_units)
    if tau is not None:
        cfg = dataclasses.replace(cfg, privacy=dataclasses.replace(cfg.privacy, epsilon=tau, noise_multiplier=None))
    return mechanism_plan(cfg, prep.train_subset.num_users, n_units)


def _check_public_is_not_private(cfg: C.RunConfig, public_cfg: C.RunConfig | None) -> None:
    """``--on public`` trains every trial on the public config's data: refuse one whose data is the
    private data (the run would say the private data was touched once).

    Raises:
        UserError: naming --public-config."""
    if public_cfg is None:
        raise UserError("--on public needs --public-config (a config whose data is declared public)")
    priv, pub = cfg.data, public_cfg.data
    same = priv == pub
    p1, p2 = getattr(priv, "path", None), getattr(pub, "path", None)
    if not same and p1 and p2:
        try:
            same = Path(str(p1)).resolve() == Path(str(p2)).resolve() or os.path.samefile(str(p1), str(p2))
        except OSError:
            same = False
    if same:
        raise UserError(
            "--public-config: its data is the private data of the tuned config "
            f"({p1 or 'the same data section'}); --on public needs data declared public"
        )


def _check_public_content(private, public) -> None:
    """``--on public``: the public config's data must not be the private data under another name —
    not the same content (the stores' content fingerprints), and not mostly the same people (a copy
    with a few records changed): half or more of either side's users in both is refused.

    Raises:
        UserError: naming --public-config."""
    if public.store.fingerprint == private.store.fingerprint:
        raise UserError(
            "--public-config: its data has the same content as the private data of the tuned config "
            "(a copy under another name); --on public needs data declared public"
        )
    mine, theirs = (
        set(map(str, user_ids_of(private.store, private.store.num_users))),
        set(map(str, user_ids_of(public.store, public.store.num_users))),
    )
    both = len(mine & theirs)
    if both and both >= 0.5 * min(len(mine), len(theirs)):
        raise UserError(
            f"--public-config: {both} of its {len(theirs)} users are users of the private data "
            f"({len(mine)} users); --on public needs data declared public, not a copy of the private data"
        )


def new_tuning(
    cfg: C.RunConfig,
    space: Space,
    *,
    epsilon: float,
    count: TrialCount,
    out: Path,
    on: str = "private",
    public_cfg: C.RunConfig | None = None,
    seed: int | None = None,
    log: Log,
) -> dict:
    """Calibrate and draw; write ``tune.json`` (before any trial). Returns the state.

    Raises:
        UserError: an unusable space, a budget that cannot cover tuning, an existing directory.
    """
    if (out / STATE).exists():
        raise UserError(f"{out}: a tuning run is already there (continue it with --resume {out})")
    base = C.to_dict(cfg)
    trial_raw = C.to_dict(public_cfg) if on == "public" else base
    if on == "public":
        _check_public_is_not_private(cfg, public_cfg)
    # every point the space can draw must be a valid config, before anything is spent or written
    validate_space(space, lambda params: _trial_config(base, params, []), "--search")
    if on == "public":
        validate_space(space, lambda params: _trial_config(trial_raw, params, []), "--search (on --public-config)")
    mechs = space.mechanisms()
    prep = prepare_data(cfg.data, log)
    if on == "public":
        _check_public_content(prep, prepare_data(public_cfg.data, log))
    delta = cfg.privacy.delta or float(prep.train_subset.num_users) ** -1.1
    delta_extra = [f"privacy.delta={delta!r}"]
    keys = {mechanism_key(m): m for m in mechs}
    if on == "private":

        def make(key, tau):
            return _plan_for(_trial_config(base, keys[key], delta_extra), prep, tau)

        log(
            f"tune: calibrating {len(keys)} mechanism(s) so that tuning + the released model meet epsilon "
            f"{epsilon:g} at delta {delta:.3g} ({count.kind}, mean {count.mean():.3g} trials) ..."
        )
        cal = TA.calibrate(make, list(keys), count, delta, epsilon)
        sigma = {k: p.noise_multiplier for k, p in cal.plans.items()}
        # each mechanism's whole-run DpEvent: every guarantee below is re-derived from these
        guarantee = {
            "epsilon_selection_bound": cal.epsilon_total,
            "per_trial_target": cal.tau,
            "epsilon_one_trial_by_mechanism": cal.epsilon_trial,
            "run_events": {k: event_to_dict(p.mechanism.event()) for k, p in cal.plans.items()},
        }
        # what the released statement rests on, fixed now: each trial's config carries its digest,
        # so the released run's journal is bound to it before its first step
        guarantee["contract_sha256"] = TG.contract_digest(on, count.to_dict(), delta, guarantee["run_events"])
    else:
        sigma, guarantee = {}, {}
    rng = np.random.default_rng(np.random.SeedSequence(secrets.randbits(128) if seed is None else seed))
    k = count.sample(rng)
    trials = [space.draw(rng) for _ in range(k)]
    state = {
        "format": "userdp-tune-1",
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "on": on,
        "epsilon": epsilon,
        "delta": delta,
        "count": count.to_dict(),
        "trials_planned": k,
        "seeded": seed is not None,
        "space": [dataclasses.asdict(d) for d in space.dims],
        "base_config": base,
        "trial_config": trial_raw,
        "sigma": sigma,
        "trials": [
            {"index": i, "params": p, "mechanism": mechanism_key(p), "dir": trial_dir_name()}
            for i, p in enumerate(trials)
        ],
        **guarantee,
        "status": "running",
    }
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / STATE, state)
    log(f"tune: {k} trials drawn (recorded in {out / STATE} before the first one)")
    return state


def check_state(state, path: Path) -> dict:
    """A tune.json read back for ``--resume``: its structure, and that every trial names a
    mechanism it holds an event for (the guarantee is re-derived from those events).

    Raises:
        UserError: naming the file, for a damaged or foreign plan."""

    def bad(why):
        return UserError(f"{path}: {why}; the tuning plan is damaged (start a new tuning run)")

    if not isinstance(state, dict) or state.get("format") != "userdp-tune-1":
        raise UserError(f"{path}: not a tuning plan written by userdp")
    need = {
        "on": str,
        "epsilon": (int, float),
        "delta": (int, float),
        "count": dict,
        "trials_planned": int,
        "space": list,
        "base_config": dict,
        "trial_config": dict,
        "sigma": dict,
        "trials": list,
    }
    for k, t in need.items():
        if not isinstance(state.get(k), t) or isinstance(state.get(k), bool):
            raise bad(f"{k} is missing or has the wrong type")
    if state["on"] not in ("private", "public"):
        raise bad(f"on is {state['on']!r}")
    if len(state["trials"]) != state["trials_planned"]:
        raise bad("the trials do not match trials_planned")
    for i, t in enumerate(state["trials"]):
        if (
            not isinstance(t, dict)
            or t.get("index") != i
            or not isinstance(t.get("params"), dict)
            or not isinstance(t.get("mechanism"), str)
        ):
            raise bad(f"trial {i + 1} is malformed")
        if "dir" in t and not (isinstance(t["dir"], str) and re.fullmatch(r"trial-[0-9a-f]{16}", t["dir"])):
            raise bad(f"trial {i + 1}'s folder name is not one userdp draws")
    if state["on"] == "private":
        events = state.get("run_events")
        if not isinstance(events, dict) or not isinstance(state.get("epsilon_one_trial_by_mechanism"), dict):
            raise bad("the mechanisms' events are missing (written by an older userdp?)")
        for t in state["trials"]:
            if t["mechanism"] not in events or t["mechanism"] not in state["sigma"]:
                raise bad(f"trial {t['index'] + 1} names a mechanism without an event")
        TG.derive(
            events,
            [t["mechanism"] for t in state["trials"]],
            TG.trial_count_from_dict(state["count"], str(path)),
            float(state["delta"]),
            source=str(path),
        )
    return state


def run_trials(state: dict, out: Path, *, progress: bool, log: Log) -> dict:
    """Run (or continue) every trial, then release the best (with ``on: public``, train once on the
    private data with the best trial's hyperparameters). Returns the summary. Trials with
    ``output.cache: run`` share one private cache in the tuning directory (``cache/``): the data
    is read and tokenized once, not once a trial."""
    with shared_run_cache(out / "cache"):
        _trials(state, out, progress=progress, log=log)
        if state["on"] == "public":
            _final_private_run(state, out, progress=progress, log=log)
    return release(state, out, log)


def _final_private_run(state: dict, out: Path, *, progress: bool, log: Log) -> None:
    """The one touch of the private data: the best public trial's hyperparameters, at the budget."""

    done = [t for t in state["trials"] if t.get("score") is not None]
    if not done:
        return
    best = min(done, key=lambda t: t["score"])
    d = out / "final"
    log(f"tune: training once on the private data with trial {best['index'] + 1}'s hyperparameters ...")
    s = _run_or_resume(
        d,
        lambda: _trial_config(state["base_config"], best["params"], [f"privacy.epsilon={state['epsilon']!r}"]),
        progress,
        log,
    )
    state["final"] = {
        "index": best["index"],
        "params": best["params"],
        "run_dir": str(d),
        "score": s["loss_after"],
        "perplexity": s["perplexity_after"],
        "epsilon": s["epsilon"],
    }
    write_json(out / STATE, state)


def _run_or_resume(d: Path, make_cfg: Callable[[], C.RunConfig], progress: bool, log: Log) -> dict:
    """The summary of the training run in ``d``: read when it finished, resumed when it began
    (its own ledger decides what is left), started from ``make_cfg()`` otherwise."""
    if d.is_dir() and (d / "config.yaml").is_file():
        st = RunDir(d).read_state()
        if st.get("status") == "done":
            return st["summary"]
        return run(C.load_config(d / "config.yaml"), resume_dir=str(d), progress=progress, log=log)
    return run(make_cfg(), output=str(d), progress=progress, log=log)


def _trials(state: dict, out: Path, *, progress: bool, log: Log) -> None:
    """Run (or continue) every trial, then release the best. Returns the summary."""

    trials_dir = out / "trials"
    trials_dir.mkdir(exist_ok=True)
    base = state["trial_config"]
    for t in state["trials"]:
        if t.get("score") is not None:
            continue
        d = trials_dir / t.get("dir", f"trial-{t['index']:03d}")  # (tune.json of 0.x: by index)
        extra = [f"privacy.delta={state['delta']!r}"]
        if state["on"] == "private":
            sig = state["sigma"][t["mechanism"]]
            eps_t = state["epsilon_one_trial_by_mechanism"][t["mechanism"]]
            extra += [f"privacy.noise_multiplier={sig!r}", f"privacy.epsilon={eps_t * (1 + 1e-9) + 1e-9!r}"]
            if state.get("contract_sha256"):
                extra.append(f"privacy.tuning_contract={state['contract_sha256']}")
        log(
            f"tune: trial {t['index'] + 1} of {state['trials_planned']}: "
            + ", ".join(f"{k} = {v:.4g}" if isinstance(v, float) else f"{k} = {v}" for k, v in t["params"].items())
        )
        s = _run_or_resume(d, lambda t=t, extra=extra: _trial_config(base, t["params"], extra), progress, log)
        t.update(run_dir=str(d), score=s["loss_after"], perplexity=s["perplexity_after"], epsilon=s["epsilon"])
        write_json(out / STATE, state)
        log(
            f"tune: trial {t['index'] + 1}: held-out loss {s['loss_after']:.4f} "
            f"(perplexity {s['perplexity_after']:.2f})"
        )


def release(state: dict, out: Path, log: Log) -> dict:
    """Pick the best trial (lowest held-out loss), write the table, the plot and the guarantees."""
    done = [t for t in state["trials"] if t.get("score") is not None]
    if not done:
        state["status"] = "done"
        write_json(out / STATE, state)
        raise UserError(
            f"{out}: the trial count drawn was 0 (Poisson): nothing is released; the budget is spent all the same"
        )
    best = min(done, key=lambda t: t["score"])
    if state["on"] == "public":
        best = state["final"]
    _write_table(state, out)
    _plot(state, out)
    link = out / "best"
    if link.is_symlink() or link.exists():
        link.unlink()
    os.symlink(os.path.relpath(best["run_dir"], out), link)
    summary = _guarantee(state, best)
    _annotate_best(summary, best)
    state.update(status="done", best=best["index"])
    write_json(out / STATE, state)
    write_json(out / "tuning.json", summary)
    log(f"tune: best trial {best['index'] + 1} (held-out loss {best['score']:.4f}): {best['run_dir']}")
    return summary


def _guarantee(state: dict, best: dict) -> dict:
    """The released statement (``tuning.json`` and the winner's privacy.json): nothing in it depends
    on the number of trials K. What K and the other trials would cost if published
    goes into tune.json, the tuning directory's own record, which is not released."""
    s = {
        "on": state["on"],
        "delta": state["delta"],
        "trial_count": state["count"],
        "seeded": state["seeded"],
        "best": {
            "params": best["params"],
            "mechanism": best.get("mechanism"),
            "heldout_loss": best["score"],
            "heldout_perplexity": best["perplexity"],
        },
        "scoring": (
            "held-out loss per token on the held-out users (data.heldout_users): those users are "
            "excluded from training and declared outside the guarantee; selecting on their loss "
            "is a non-private use of their records"
        ),
    }
    if state["on"] == "private":
        if "run_events" not in state or "contract_sha256" not in state:
            raise UserError(
                "tune.json was written by an older userdp (no tuning contract to derive the "
                "guarantee from); start the tuning run again"
            )
        g = TG.derive(
            state["run_events"],
            [t["mechanism"] for t in state["trials"]],
            TG.trial_count_from_dict(state["count"], STATE),
            state["delta"],
            source=STATE,
        )
        s.update(
            epsilon_total=g["epsilon_released_model"],
            epsilon_budget=state["epsilon"],
            epsilon_selection_bound=g["epsilon_selection_bound"],
            epsilon_one_trial=best["epsilon"],
            epsilon_one_trial_note=(
                "the epsilon of the winning trial's own run: NOT a guarantee for the "
                "released model, which was selected among the trials"
            ),
            run_events=state["run_events"],
            contract_sha256=state["contract_sha256"],
            method=(
                "private selection (Papernot & Steinke 2022): the number of trials K was drawn from "
                f"{state['count']['kind']} (mean {state['count']['mean']:.3g}) before any trial and is "
                "kept secret; only the best trial is released; per-trial RDP curves (the max over the "
                "space's mechanisms) -> their theorem -> (epsilon, delta). Publishing K, another trial's "
                "score or model, or the tuning directory voids this bound: the composition of the K "
                "trials run applies instead (tune.json, epsilon_if_trials_published)"
            ),
        )
        # the workspace's own record: what publishing the trials would cost (never in released files)
        state["epsilon_if_trials_published"] = g["epsilon_if_trials_published"]
    else:  # trials on public data: their number and folders reveal nothing private
        s["best"].update(run_dir=best["run_dir"], index=best["index"])
        s.update(
            trials_run=len(state["trials"]),
            epsilon_total=best["epsilon"],
            epsilon_final_model=best["epsilon"],
            method="trials on data declared public; the private data was touched once (the final run)",
        )
    return s


def _annotate_best(summary: dict, best: dict) -> None:
    """The winning run's privacy.json and report gain both guarantees."""
    p = Path(best["run_dir"]) / "privacy.json"
    rec = read_json(p)
    if summary["on"] == "private":
        rec["tuning_guarantee"] = (
            f"the released model was selected by private tuning (the number of trials is secret): epsilon = "
            f"{summary['epsilon_total']:.4g} at delta = {summary['delta']:.3g} ({summary['method']}); "
            f"the epsilon of this trial alone, {summary['epsilon_one_trial']:.4g}, is not a guarantee for the "
            "selected model; trials were scored on held-out users declared outside the guarantee"
        )
        rec["epsilon_tuning_total"] = summary["epsilon_total"]
        rec["epsilon_total"] = summary["epsilon_total"]  # the headline: the released model's guarantee
        rec["tier"] = epsilon_tier(summary["epsilon_total"])
        rec["not_accounted"] = [n for n in rec.get("not_accounted", []) if not n.startswith("hyperparameter tuning")]
        rec["not_accounted"].append(
            "the held-out users' records scored each trial (selection used them; they are outside the guarantee)"
        )
    else:
        # the tuning line stays: a public tuning section is not bound to the journal, so it cannot
        # take a disclosure away (userdp report would refuse the record)
        rec["tuning_guarantee"] = (
            "hyperparameters tuned on data declared public; the private data was "
            "touched once, by this run (its epsilon is the whole guarantee)"
        )
    rec["tuning"] = summary
    write_json(p, rec)
    write_report(best["run_dir"])


def _write_table(state: dict, out: Path) -> None:
    keys = [d["key"] for d in state["space"]]
    rows = [
        {
            "trial": t["index"] + 1,
            **{k: t["params"].get(k) for k in keys},
            "mechanism": t["mechanism"],
            "heldout_loss": t.get("score"),
            "heldout_perplexity": t.get("perplexity"),
            "epsilon_trial": t.get("epsilon"),
            "run_dir": t.get("run_dir"),
        }
        for t in state["trials"]
    ]
    text = io.StringIO(newline="")
    w = csv.DictWriter(text, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)
    write_atomic(out / "results.csv", text.getvalue())
    write_json(out / "results.json", rows)


def _plot(state: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dims = state["space"]
    done = [t for t in state["trials"] if t.get("score") is not None]
    fig, axes = plt.subplots(1, len(dims), figsize=(4 * len(dims), 3.2), squeeze=False)
    for ax, d in zip(axes[0], dims, strict=True):
        xs = [t["params"][d["key"]] for t in done]
        ys = [t["score"] for t in done]
        if all(isinstance(x, (int, float)) for x in xs):
            ax.scatter(xs, ys)
            if d["kind"] == "log_uniform":
                ax.set_xscale("log")
        else:
            cats = sorted({str(x) for x in xs})
            ax.scatter([cats.index(str(x)) for x in xs], ys)
            ax.set_xticks(range(len(cats)), cats)
        ax.set_xlabel(d["key"])
        ax.set_ylabel("held-out loss")
    fig.suptitle(f"{len(done)} trials")
    fig.tight_layout()
    write_atomic(out / "scores.png", lambda p: fig.savefig(p, dpi=90, format="png"))
    plt.close(fig)
