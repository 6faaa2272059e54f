"""privacy.json's content: the engine's :class:`~userdp.engine.privacy_record.PrivacyRecord` and the LM
job's own facts (:class:`ReleaseFacts`), put into the statement's words once, at release.

The statement's checklist (Ponomareva et al. 2023, §5.3.3; SPEC §8.3) is filled here from typed
inputs: every engine figure is read from the record's fields (no key looked up with a default), the
job's facts from :class:`ReleaseFacts`. :mod:`userdp.lm.report` reads the file back, re-derives and
verifies it, and renders it; it builds nothing of its own.
"""

from __future__ import annotations

import importlib.metadata as md
import platform
from dataclasses import dataclass

from userdp.engine.algorithms import ALGORITHMS
from userdp.engine.noise.mechanism import NOISE_MECHANISMS
from userdp.engine.plugin_outputs import built_in, describe
from userdp.engine.privacy_record import PrivacyRecord
from userdp.engine.sampling import SAMPLERS
from userdp.errors import UserError
from userdp.lm.plan_file import plan_median_epsilon
from userdp.lm.report import REFERENCE_DELTA, epsilon_tier, median_composed
from userdp.lm.statement_text import ADJACENCY, COVERAGE, SETTING


def library_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("userdp", "torch", "dp-accounting", "transformers", "peft", "tokenizers", "numpy"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = "not installed"
    return out


#: the engine record's fields a released statement leaves out: un-noised counts of private events
#: (the data holder reads them in the run's private diagnostics.jsonl)
PRIVATE_RECORD_KEYS = frozenset({"nonfinite_units", "nonfinite_units_note"})

SAMPLER_TEXT = {
    "poisson_users": "Poisson sampling of users: each user joins each step independently with "
    "probability q (variable cohort size)",
    "poisson_examples": "Poisson sampling of records: each of a user's (at most G) records joins "
    "each step independently with probability q",
    "shuffle_fixed_batches": "shuffled fixed-size batches, which have no proven amplification: each "
    "step is accounted as the Gaussian mechanism with the user's whole "
    "sensitivity (the guarantee WITHOUT amplification)",
    "fixed_size_wor": "fixed-size cohorts drawn without replacement (replace-one adjacency, RDP)",
    "none": "no sampling (full participation)",
    "cyclic_poisson_users": "cyclic Poisson sampling of users: users split into b groups by a keyed hash of "
    "each user's id; step t samples each user of group t mod b independently with probability q·b, so a "
    "user takes part in at most ceil(T/b) steps, b apart, and T steps are accounted as ceil(T/b) "
    "compositions (Choquette-Choo et al. 2023)",
}


@dataclass(frozen=True)
class ReleaseFacts:
    """What the LM job knows beside the engine's record.

    Attributes:
        algorithm, accountant: the config's names (``training.algorithm``, ``privacy.accountant``).
        sampler_assumed: the sampler the accountant assumed (``poisson_users``, ...).
        epsilon_target: the config's target (None: none given).
        steps_planned, group_size, clipping, selection, seq_len: the config's training settings.
        num_records: the training records after capping (published in the report).
        tokenizer_note, pretraining_note: how the tokenizer and the starting model touched data.
        not_accounted: the job's disclosed non-private touches of the data, one line each.
        plan: the ``plan: auto`` plan as saved (None: no plan).
        plugins: the plugins that ran inside training.
        compute: where and how the run computed (device, chunk size, processes; no privacy role).
    """

    algorithm: str
    accountant: str
    sampler_assumed: str
    epsilon_target: float | None
    steps_planned: int
    group_size: int | None
    num_records: int
    clipping: str
    seq_len: int | None = None
    selection: str = "random"
    tokenizer_note: str = ""
    pretraining_note: str = ""
    not_accounted: tuple[str, ...] = ()
    plan: dict | None = None
    plugins: tuple[str, ...] = ()
    compute: dict | None = None


#: the line every statement carries until a verified tuning guarantee replaces it
TUNING_NOT_ACCOUNTED = (
    "hyperparameter tuning (learning rate, C, steps, cohort) — runs used to choose "
    "them are not accounted; tune on public data or account it with `userdp tune` "
    "(Papernot & Steinke 2022)"
)


def _registered(registry, name: str):
    """The implementation registered as ``name`` (None: no longer registered)."""
    try:
        return registry.lookup(name)
    except UserError:
        return None


def not_accounted(facts: ReleaseFacts) -> list[str]:
    """The statement's "Not accounted" lines that the job's facts give (known before the first step:
    the ledger journal is bound to them, :func:`statement_scope`)."""
    out = [*facts.not_accounted, TUNING_NOT_ACCOUNTED]
    if facts.tokenizer_note:
        out.append(facts.tokenizer_note)
    if facts.pretraining_note:
        out.append(facts.pretraining_note)
    if facts.selection in ("highest_ppl", "lowest_ppl"):
        out.append(
            "perplexity-based record selection used the pretrained model on the private "
            "records (a non-private data touch)"
        )
    return out


def statement_scope(facts: ReleaseFacts) -> dict:
    """What a run's ledger journal binds of its statement before the first step (its context's
    ``statement``): the number of training records the statement prints, and the "Not accounted"
    lines it must carry. ``userdp report`` refuses a privacy.json that prints another count or
    lacks one of the lines (a statement's scope is never read from the file it checks); the
    number of users is bound by the engine itself (``num_users``)."""
    return {"num_records": int(facts.num_records), "not_accounted": not_accounted(facts)}


def _built_in_noise_text(engine: PrivacyRecord) -> str:
    """The statement's noise assumption for userdp's own mechanisms: independent Gaussian noise, or
    banded matrix-factorization noise (``engine.correlated_noise``)."""
    caveat = (
        " (not a cryptographically secure generator; floating-point attacks on the Gaussian sampler are not accounted)"
    )
    noise = engine.correlated_noise
    if noise is None:
        return (
            "noise: Gaussian with standard deviation sigma*C on the sum of clipped unit updates, drawn once per "
            "step in float32 from " + engine.noise_generator + caveat
        )
    return (
        f"noise: banded matrix-factorization noise ({noise['bands']} bands; {noise['strategy']}): each step adds "
        "sigma*C times row t of C^-1 Z to the sum of clipped unit updates, Z i.i.d. Gaussian drawn in float32 from "
        + engine.noise_generator
        + caveat
        + f"; C's coefficients {', '.join(f'{c:.6g}' for c in noise['coefficients'])} give one participation a "
        f"sensitivity of at most {noise['max_column_norm']:.6g}·C; " + noise["state"]
    )


def privacy_record(engine: PrivacyRecord, facts: ReleaseFacts) -> dict:
    """The data behind the privacy statement; saved as ``privacy.json``.

    ``facts.plan`` is the ``plan: auto`` plan (``Plan.to_dict()`` plus what was applied): saved
    under ``plan``; its DP median is spent through the ledger (composed into ``engine``'s DpEvent,
    so inside ``epsilon``); a plan saved before that was so is added by basic composition into
    ``epsilon_total`` (the tier is that of the total)."""
    algo = ALGORITHMS.lookup(facts.algorithm)  # a plugin's algorithm speaks for itself too
    private = algo.private
    seq_len, num_users, group_size = facts.seq_len, engine.num_users, facts.group_size
    unit = algo.unit_text
    unit += (
        (f"; each record is at most {seq_len} tokens; features and labels (all text) are protected") if seq_len else ""
    )
    assumptions = []
    if private:
        assumptions.append(f"sampling: {SAMPLER_TEXT.get(facts.sampler_assumed, facts.sampler_assumed)}")
        sampler = (engine.sampler or {}).get("name")
        plugin_sampler = _registered(SAMPLERS, sampler) if sampler else None
        if sampler and (plugin_sampler is None or not built_in(plugin_sampler)):
            who = (
                describe("plugin sampler", plugin_sampler, sampler)
                if plugin_sampler is not None
                else f"the plugin sampler {sampler!r} (no longer registered)"
            )
            assumptions.append(
                f"sampling ran by {who}, "
                f"which declares that its draws follow {engine.sampler.get('accounted_as')!r} "
                "sampling: the accounting rests on that declaration, not on userdp's code"
            )
        mechanism = _registered(NOISE_MECHANISMS, engine.noise_mechanism)
        if mechanism is not None and built_in(mechanism):
            assumptions.append(_built_in_noise_text(engine))
        else:
            assumptions.append(
                "noise: added by "
                + (
                    describe("plugin mechanism", mechanism, engine.noise_mechanism)
                    if mechanism is not None
                    else f"the plugin mechanism {engine.noise_mechanism!r} (no longer registered)"
                )
                + "; the accounting takes its "
                "declaration that it adds Gaussian noise of standard deviation sigma*C to the sum "
                "once per step: that is the plugin's claim, which userdp does not verify"
            )
        prec = engine.precision
        assumptions.append(
            f"precision: model {', '.join(prec['model'])}; norms, clipped sums, "
            f"the denominator and the noise in {', '.join(prec['norms_sums_noise'])}; "
            f"master weights {prec['master_weights']}"
        )
        if engine.noise_tail is not None:
            nt = engine.noise_tail
            assumptions.append(
                f"the noise sampler bounds each Box-Muller pair's radius (ChaCha20, 85-bit uniforms): "
                f"the Gaussian mass it drops, {nt['mass_per_pair']:.3g} a pair over "
                f"{nt['coordinates']} coordinates and {nt['steps']} steps, adds "
                f"{nt['delta']:.3g} to delta (total variation; included in the stated delta)"
            )
        if engine.seeded:
            assumptions.append(
                "SEEDED RUN: the sampling and the noise derive from the seed in the "
                "configuration; whoever holds the seed can recompute the noise, and the "
                "guarantee holds only against parties who do not know it"
            )
        assumptions.extend(algo.assumptions(group_size))
        for c in engine.counts_treated_as_public:
            assumptions.append(f"treated as public (computed on the private data, not noised): {c}")
        assumptions.append(
            f"treated as public: the number of training records, {facts.num_records} (published in this report)"
        )
        assumptions.append(
            "a sampled unit whose update is not finite contributes zero (sensitivity unchanged); "
            "how many there were is an un-noised count of private events (a user with a NaN "
            "record would count its own participations), kept in the run's private "
            "diagnostics.jsonl and never released"
        )
        assumptions.append(
            "the unit is the author: people *mentioned* in other users' text are not "
            "protected by a user-level guarantee"
        )
    if facts.plugins:
        assumptions.append(
            f"plugin code ran inside training ({', '.join(facts.plugins)}): the guarantee assumes "
            "it is correct, as it assumes of userdp's own code"
        )
    not_acc = not_accounted(facts)
    plan = facts.plan
    plan_eps = plan_median_epsilon(plan, "the plan") if plan else 0.0
    if plan_eps and plan.get("seeded"):
        assumptions.append(
            "SEEDED DP MEDIAN: the plan's epsilon-DP median drew its noise from the plan's "
            "seed; whoever holds that seed can undo it"
        )
    dp_event = engine.dp_event_total if private else None
    epsilon = engine.epsilon if private else None
    # the plan's DP median is spent through the ledger (its event composed with the steps, inside
    # epsilon); a run written before that was so adds it by basic composition
    total = epsilon + (0.0 if median_composed(dp_event) else plan_eps) if epsilon is not None else None
    delta = engine.delta
    rec = {
        "private": private,
        "setting": SETTING if private else "none (non-private training)",
        "data_accesses_covered": (
            "training only (the sequence of noised aggregated updates); "
            "held-out-user evaluation uses users excluded from training"
        )
        if private
        else "none",
        "mechanism_output": COVERAGE if private else "none",
        "unit": unit,
        "adjacency": ADJACENCY if private else "none",
        "algorithm": facts.algorithm,
        "accountant": {
            "pld": "PLD (privacy-loss distributions, dp_accounting; add/remove)",
            "rdp": "RDP (Renyi DP, dp_accounting; add/remove)",
        }.get(facts.accountant, facts.accountant)
        + algo.event_text(facts.accountant),
        "assumptions": assumptions or ["none"],
        "sampler_assumed": facts.sampler_assumed,
        "sampler_used": engine.sampler_mode,
        "assumptions_met": facts.sampler_assumed == engine.sampler_mode if private else None,
        "epsilon": epsilon,
        "epsilon_target": facts.epsilon_target if private else None,
        "delta": delta,
        "delta_rule": (
            f"{engine.delta_rule}; delta = {delta:.3g} = {delta * num_users:.3g}/N for N = {num_users:,} "
            "training users (a mechanism that publishes one random user's data outright is "
            "(0, 1/N)-DP, so delta must be far below 1/N; the report also states epsilon at "
            f"delta = {REFERENCE_DELTA:g})"
            if private and delta and num_users
            else engine.delta_rule
        ),
        "epsilon_no_amplification": engine.epsilon_no_amplification,
        "tuning_guarantee": "not accounted (see not_accounted); the statement covers the final training run only",
        "noise_multiplier": engine.noise_multiplier,
        "sampling_rate": engine.algorithm.get("sampling_rate"),
        "expected_cohort": engine.expected_units_per_step,
        "steps_taken": engine.steps_accounted,
        "steps_planned": facts.steps_planned,
        "clip_norm": engine.final_clip_norm if private else None,
        "clipping": facts.clipping,
        "group_size": group_size,
        "selection": facts.selection,
        "num_users": num_users,
        "num_records": facts.num_records,
        "not_accounted": not_acc,
        "library_versions": library_versions(),
        "dp_event": dp_event,
        "tier": epsilon_tier(total if private else None),
        "plan": plan,
        "epsilon_plan": plan_eps if plan is not None else None,
        "epsilon_total": total,
        "transparency": transparency(engine),
        "plugins": list(facts.plugins),
        # the engine's own record, and the figures the report shows from it
        "engine_record": {k: v for k, v in engine.to_dict().items() if k not in PRIVATE_RECORD_KEYS},
        "steps_lost_to_crashes": engine.steps_lost_to_crashes,
        "steps_applied": engine.steps_applied,
        "randomness": engine.randomness,
        "seeded": engine.seeded,
        "epsilon_assuming_poisson": engine.epsilon_assuming_poisson,
        "sampling_warning": engine.sampling_warning,
        "precision": engine.precision,
        # where and how the run computed (no privacy role; for reproducing the cost)
        "compute": dict(facts.compute or {}, per_unit=engine.per_unit),
    }
    return rec


def transparency(engine: PrivacyRecord) -> str:
    """How the run computed what it clipped, from its own record (ghost or vmap)."""
    strategy = engine.per_unit.get("strategy")
    how = {
        "ghost": "per-unit gradient norms and the clipped sum by ghost clipping (from each layer's activations "
        "and output gradients, without per-unit gradient copies; userdp.engine.ghost)",
        "vmap": "per-unit gradients by torch.func (vmap)",
    }.get(strategy, f"per-unit strategy {strategy or 'n/a'}")
    return f"open-source userdp; accounting by Google's dp_accounting; {how}"
