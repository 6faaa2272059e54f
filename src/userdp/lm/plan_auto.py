"""The plan's choices for ``plan: auto`` and ``userdp train --plan PLAN.json``: which algorithm,
group size and cohort size (``userdp.planning.plan_for_training``), saved as plan.json with the
data touches the report must list and the epsilon a DP median spent."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from userdp import planning
from userdp.engine.algorithms import ALGORITHMS
from userdp.errors import UserError
from userdp.fileio import write_atomic, write_json
from userdp.lm import config as C
from userdp.lm import models
from userdp.lm.job_context import JobContext
from userdp.lm.plan_file import dp_median_event, plan_choices, read_plan
from userdp.lm.prepare import Log, stderr_log


def plan_touches(plan: dict) -> list[str]:
    """The plan's non-private touches of the training data, one line each (for not_accounted)."""
    e, i = plan["els"], plan["inputs"]
    gs = sorted(int(g) for g in (plan.get("l_of_g_evaluated") or []))
    k = i.get("l_of_g_sample_users")
    median = (
        "released by an epsilon-DP median (its epsilon is counted above)"
        if e.get("group_size_method") == "dp_median"
        else "the exact median, not private"
    )
    who = plan.get("source") or "plan: auto"
    return [
        f"{who} — the per-user record counts of all {i['num_users']} training users were read "
        f"to choose the ELS group size G = {e['group_size']} as their median ({median})",
        f"{who} — {k} training users were sampled (without noise) to estimate L(G), and the "
        f"norms of their mean gradients at the pretrained model were computed"
        + (f" for G in {gs}" if gs else "")
        + "; these norms chose the cohort and group size "
        "(not private, not accounted)",
    ]


def plan_record(plan, algo: str, choice: str, *, seed, data_fingerprint: str) -> dict:
    """The saved form of a plan (plan.json): ``Plan.to_dict()`` plus what was applied, the DP
    median's epsilon, whether the plan was seeded, and the data it was made on."""
    out = plan.to_dict()
    out["applied"] = algo
    out["choice"] = choice
    out["overrides"] = plan.training_overrides(algo)
    out["dp_median_epsilon_spent"] = float(plan.els.get("dp_median_epsilon") or 0.0)
    if out["dp_median_epsilon_spent"]:  # the event the epsilon is re-derived from wherever it is read
        out["dp_median_event"] = dp_median_event(out["dp_median_epsilon_spent"])
    out["seeded"] = seed is not None
    out["data_fingerprint"] = data_fingerprint
    gs = {1, int(plan.uls["group_size"])}
    for d in plan.uls["estimate_and_double"]["trace"]:
        gs.update((int(d["group_size"]), 2 * int(d["group_size"])))
    out["l_of_g_evaluated"] = sorted(gs)  # the G at which the sampled users' gradient norms were read
    return out


def apply_plan(cfg: C.RunConfig, record: dict, *, source: str, data_fingerprint: str) -> C.RunConfig:
    """The config with a saved plan's choice applied (algorithm, group size, cohort size).

    Raises:
        UserError: the record is not a valid plan, or was made on other data (naming ``source``).
    """
    if not isinstance(record, dict):
        raise UserError(f"{source}: not a userdp plan (expected a JSON object)")
    over = plan_choices(record, source)
    if record["data_fingerprint"] != data_fingerprint:
        raise UserError(f"{source}: the plan was made on other data or another split than this config's")
    resolved = dataclasses.replace(
        cfg,
        training=dataclasses.replace(
            cfg.training,
            algorithm=over["training.algorithm"],
            group_size=over["training.group_size"],
            cohort_size=over["training.cohort_size"],
        ),
    )
    C.validate(resolved, source)
    return resolved


def plan_auto(
    cfg: C.RunConfig, train_data, model, log: Log = stderr_log, data_fingerprint: str = ""
) -> tuple[C.RunConfig, dict]:
    """Run ``plan_for_training`` for a ``plan: auto`` config; returns (resolved config, plan dict).

    The resolved config has the chosen ``training.algorithm``, ``group_size`` and ``cohort_size``;
    the plan dict is :func:`plan_record`'s."""

    pl, p, t = cfg.planning, cfg.privacy, cfg.training
    k = min(pl.sample_users, int(train_data.num_users))
    log(
        f"plan: auto — estimating L(G) on {k} sampled users and calibrating sigma(M) "
        f"(compute budget {pl.compute_budget} gradients/step) ..."
    )
    budget = planning.PlanBudget(
        pl.compute_budget,
        p.epsilon,
        t.steps,
        delta=p.delta,
        accountant=p.accountant,
        dp_median_epsilon=pl.dp_median_epsilon,
    )
    sample = planning.NormSample(pl.sample_users, chunk_size=t.chunk_size or 8, seed=pl.seed)
    plan = planning.plan_for_training(train_data, model, models.causal_lm_loss, budget, sample)
    algo = plan.recommended if pl.algorithm == "recommended" else pl.algorithm
    out = plan_record(
        plan,
        algo,
        "recommended" if pl.algorithm == "recommended" else "planning.algorithm",
        seed=pl.seed,
        data_fingerprint=data_fingerprint,
    )
    resolved = apply_plan(cfg, out, source="plan: auto", data_fingerprint=data_fingerprint)
    over = out["overrides"]
    ch = getattr(plan, algo)  # the planner's figures for the algorithm it chose (uls or els)
    unit = ALGORITHMS.lookup(algo).units_label
    log(
        f"plan: auto chose {algo.upper()}{' (recommended)' if algo == plan.recommended else ''}: "
        f"group_size {over['training.group_size']}, cohort_size {over['training.cohort_size']:g} "
        f"expected {unit}/step, sigma {ch['noise_multiplier']:.3g}; noise std proxy ULS "
        f"{plan.uls['noise_std_proxy']:.3g} vs ELS {plan.els['noise_std_proxy']:.3g} "
        f"(B = {pl.compute_budget}; the plan's data touches are listed in the privacy report)"
    )
    return resolved, out


def planned_config(cfg: C.RunConfig, ctx: JobContext, prep, train_data, model):
    """(config, plan record or None): the config with a plan's choices applied — a plan file given
    by ``--plan``, the plan a resumed run saved, or ``plan: auto`` planned now (once, on rank 0:
    its DP median is spent once) — and the plan saved in the run directory with the config.

    A new run's ``config.yaml`` is written here, once, with the plan's choices (a resumed run keeps
    its own).

    Raises:
        UserError: ``--plan`` with ``plan: auto``, a plan made on other data, or a resumed ``plan:
            auto`` run without its plan.json."""
    rd, world, log, plan_file, resume_dir = ctx.rd, ctx.world, ctx.log, ctx.plan_file, ctx.resume_dir
    main = world.is_main
    saved_path = rd.root / "plan.json"
    if plan_file is not None:
        if cfg.plan == "auto":
            raise UserError("--plan: the config already says plan: auto; give one or the other")
        saved = read_plan(plan_file, f"--plan {plan_file}")
        cfg = apply_plan(cfg, saved, source=f"--plan {plan_file}", data_fingerprint=prep.data_fingerprint)
        plan = dict(saved, source=f"userdp plan (applied by --plan {Path(plan_file).name})")
        header = "# training.algorithm, group_size and cohort_size come from the plan in plan.json\n"
        if main:
            write_json(saved_path, plan)
    elif resume_dir is not None and saved_path.is_file():
        # applied by --plan or planned by plan: auto when the run began: the saved config.yaml
        # already holds the planned values, so nothing is planned again
        plan = read_plan(saved_path, str(saved_path))
        plan_choices(plan, str(saved_path))
        if cfg.plan != "auto":
            return cfg, plan
        log(
            f"plan: auto — resuming with the saved plan ({plan.get('applied', '?').upper()}, "
            f"group_size {cfg.training.group_size}, cohort_size {cfg.training.cohort_size:g})"
        )
    elif cfg.plan != "auto":
        plan, header = None, ""
    elif resume_dir is not None:
        raise UserError(
            f"--resume {resume_dir}: the config says plan: auto but the run "
            "directory has no plan.json (start the run again instead)"
        )
    else:
        with world.main_first("planning"):  # once, on rank 0 (its DP median is spent once)
            if main:
                cfg, plan = plan_auto(cfg, train_data, model, log, data_fingerprint=prep.data_fingerprint)
                write_json(saved_path, plan)
            else:
                plan = read_plan(saved_path, str(saved_path))
                cfg = apply_plan(cfg, plan, source=str(saved_path), data_fingerprint=prep.data_fingerprint)
        header = (
            "# plan: auto chose training.algorithm, group_size and cohort_size below (see plan.json);\n"
            "# `userdp train --resume` keeps them, a new run plans again\n"
        )
    if main and (resume_dir is None or plan_file is not None):
        # a new run's config, written once, as planned (the budget is checked when the job is resolved);
        # a resumed run keeps its own
        write_atomic(rd.config, header + C.dump_yaml(cfg))
    return cfg, plan
