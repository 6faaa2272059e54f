"""The privacy record of a run as of now (:func:`run_record`): what
:meth:`userdp.engine.run.step.EngineRun.record` returns, built from the run's plan, ledger and state."""

from __future__ import annotations

from dataclasses import asdict, is_dataclass
from typing import Any

import torch

from userdp import accounting
from userdp.engine.noise.chacha import tail_delta
from userdp.engine.noise.gaussian import ENTROPY_BITS, GaussianNoise, source_class
from userdp.engine.privacy_record import PrivacyRecord


def _cfg_dict(obj) -> Any:
    """A config dataclass as the record's JSON: its type's name, then its fields."""
    if is_dataclass(obj):
        d = {"type": type(obj).__name__}
        d.update({k: _cfg_dict(v) for k, v in asdict(obj).items()})
        return d
    if isinstance(obj, (list, tuple)):
        return [_cfg_dict(v) for v in obj]
    return obj


def _optimizer_record(optimizer: torch.optim.Optimizer) -> dict:
    """The privacy record's description of a caller's optimizer: its class and hyperparameters
    (post-processing of the released gradient; listed so that the record says what stepped)."""
    groups = [
        {k: v if isinstance(v, (int, float, bool, str, type(None))) else repr(v) for k, v in g.items() if k != "params"}
        for g in optimizer.param_groups
    ]
    return {
        "type": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}",
        "param_groups": groups,
        "source": "the caller's own (make_private)",
    }


def run_record(run) -> PrivacyRecord:
    """The privacy record of ``run`` (an :class:`~userdp.engine.run.step.EngineRun`) as of now."""
    cfg, plan = run.cfg, run.plan
    eps = run.ledger.epsilon()
    total = run.ledger.total_event()
    return PrivacyRecord(
        **_sampling_and_noise(run),
        clipping=_cfg_dict(cfg.clipping),
        final_clip_norm=float(run.clip_state["clip_norm"]),
        optimizer=_optimizer_record(run.optimizer) if run.external_optimizer else _cfg_dict(cfg.optimizer),
        accountant=cfg.accountant,
        steps_applied=run.step,
        steps_accounted=run.ledger.spent,
        steps_lost_to_crashes=run.ledger.lost_steps,
        epsilon=eps,
        delta=run.delta,
        delta_rule=plan.delta_rule,
        target_epsilon=cfg.target_epsilon,
        calibrated=cfg.noise_multiplier is None,
        step_event=accounting.event_to_dict(plan.step_event) if plan.private else None,
        adjacency=plan.mechanism.adjacency if plan.private else None,
        dp_event_total=accounting.event_to_dict(total) if total is not None else None,
        journal=run.ledger.journal.cite() if run.ledger.journal is not None else None,
        **_how_run(run),
        counts_treated_as_public=_public_counts(run),
        broken_build=plan.broken_build,
        **_when(run, eps),
    )


def _when(run, eps: float) -> dict:
    """The record's fields that apply to some runs only: the noise's tail, a warning, the
    comparison epsilons of a sampling that is not Poisson, the cycle, a correlated noise's state."""
    cfg, plan = run.cfg, run.plan
    when = {}
    when["noise_tail"] = _noise_tail(run, eps)
    if not plan.private:
        when["warning"] = "noise_multiplier = 0: this run is NOT differentially private (epsilon = inf)"
    elif plan.accounted_sampling == "shuffle":
        when["epsilon_no_amplification"] = eps
        when["epsilon_assuming_poisson"] = _epsilon_under(run, "poisson", cfg.accountant)
        when["sampling_warning"] = (
            "training used shuffled fixed batches, which have no proven amplification: "
            "epsilon is the guarantee WITHOUT amplification (each step accounted as the "
            "Gaussian mechanism with the user's whole sensitivity); "
            "epsilon_assuming_poisson is a comparison only, not a guarantee"
        )
    elif plan.accounted_sampling == "cyclic_poisson":
        when["cycle"] = _cycle(run)
    elif plan.accounted_sampling != "poisson":
        when["epsilon_no_amplification"] = _epsilon_under(run, "shuffle", "pld")
        when["sampling_warning"] = (
            "fixed-size cohorts without replacement: epsilon is under replace-one "
            "adjacency (RDP); epsilon_no_amplification holds without amplification"
        )
    when["correlated_noise"] = getattr(run.noise, "to_record", lambda: None)()
    return when


def _sampling_and_noise(run) -> dict:
    """The record's unit, sampler and noise fields."""
    cfg, plan = run.cfg, run.plan
    return dict(
        algorithm=_cfg_dict(run.algo),
        unit=plan.unit,
        num_users=int(run.data.num_users),
        num_units=int(run.n_units),
        expected_units_per_step=run.expected_units,
        denominator=run.expected_weight,
        denominator_kind=cfg.denominator.name,
        sampler_mode=plan.sampler_mode,
        sampler={
            "name": cfg.sampling,
            "mode": getattr(run.sampler, "mode", cfg.sampling),
            "accounted_as": plan.accounted_sampling,
        },
        noise_mechanism=cfg.noise,
        noise_multiplier=run.noise_multiplier,
        update_noise_multiplier=run.update_z,
        count_noise_stddev=plan.count_stddev,
    )


def _how_run(run) -> dict:
    """The record's fields on how the run was computed: its keying, noise generator, precision,
    per-unit strategy and the units whose update was not finite."""
    cfg = run.cfg
    return dict(
        seeded=run.seeded,
        randomness=(
            "seeded by the user (seed given): sampling and noise are reproducible by whoever "
            "holds the seed; the guarantee holds only against parties who do not know it"
        )
        if run.seeded
        else f"sampling and noise keyed by {ENTROPY_BITS} bits of operating-system entropy (os.urandom), never stored",
        noise_generator=source_class(run.device).algorithm + "; " + GaussianNoise.keying_text(run.seeded),
        noise_kernel=run.noise_kernel,
        precision=run.precision,
        per_unit={
            "strategy": run.per_unit.name,
            "requested": cfg.performance.per_unit,
            "fallback_reason": getattr(run.per_unit, "fallback_reason", None),
            "device": str(run.device),
        },
        nonfinite_units=run.nonfinite_units,
        nonfinite_units_note=(
            "units whose update was Inf/NaN contributed zero (sensitivity stays <= C); "
            "this count is computed on the private data and is NOT privatized"
        ),
    )


def _noise_tail(run, eps: float) -> dict | None:
    """A sampler with a bounded tail: the mass it drops, which goes into delta (None for others)."""
    tail_pair = getattr(source_class(run.device), "tail_mass_per_pair", None)
    if not (run.plan.private and tail_pair):
        return None
    d = int(sum(p.numel() for p in run.master))
    return {
        "coordinates": d,
        "mass_per_pair": tail_pair,
        "steps": int(run.ledger.spent),
        "delta": tail_delta(d, run.ledger.spent, eps, tail_pair),
        "rule": "steps * ceil(d/2) * mass_per_pair * (1 + e^epsilon), added to delta",
    }


def _cycle(run) -> dict:
    """What the record says of cyclic sampling: b, the group's rate and the compositions so far."""
    plan = run.plan
    return {
        "bands": plan.cycle,
        "group_rate": plan.mechanism.group_rate if plan.private else plan.sampling_rate * plan.cycle,
        "compositions": plan.compositions(run.ledger.spent),
        "rule": "users in b groups by a keyed hash of each user's id; step t samples group t mod b at q·b; "
        "a user takes part in at most ceil(t / b) of t steps, so they compose the step event ceil(t / b) times",
    }


def _epsilon_under(run, sampling: str, accountant: str) -> float:
    """epsilon of the steps ``run`` spent had they been sampled by ``sampling`` (a labelled comparison)."""
    if not run.ledger.spent:
        return 0.0
    return run.plan.mechanism_for(sampling).replace(steps=run.ledger.spent).epsilon(run.delta, accountant)


def _public_counts(run) -> list[str]:
    """Counts computed from the private data and used without noise (listed in the report)."""
    out = [f"the number of users N = {int(run.data.num_users)} (in delta's default rule and the sampling rate)"]
    if run.plan.unit == "record":
        out.append(
            f"the number of records after capping at G, |D'| = {run.n_units} (fixes the record "
            "sampling rate p = cohort/|D'| and the denominator p*|D'|)"
        )
    elif run.table.weights is not None:
        out.append("the total user weight W (FedAvg's fixed denominator q*W)")
    return out
