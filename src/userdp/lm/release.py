"""Phases 5-7 of ``userdp train``: evaluate, save, report. The held-out users are scored before and
after training; privacy.json states what the ledger counted (the published DpEvent is the
ledger's own); the model and its manifest are written atomically; the report and model card are
derived from the verified statement."""

from __future__ import annotations

import time
from collections.abc import Mapping

from userdp import plugins
from userdp.engine.privacy_record import PrivacyRecord
from userdp.fileio import atomic_dir, write_json, write_manifest
from userdp.lm import config as C
from userdp.lm import models
from userdp.lm.evaluate import Personalization, evaluate_lm, personalize
from userdp.lm.job_context import JobContext, JobData
from userdp.lm.job_plan import JobPlan
from userdp.lm.plan_auto import plan_touches
from userdp.lm.report import MODEL_CARD, write_report
from userdp.lm.run_dir import RunDir, plot_curves, read_json
from userdp.lm.statement import ReleaseFacts, privacy_record
from userdp.lm.tensorboard_log import Scalars


def privacy_json(job: JobPlan, record: PrivacyRecord, num_records: int, notes: Mapping) -> dict:
    """privacy.json's content: the engine's record and the job's facts (:mod:`userdp.lm.statement`).
    The published DpEvent is the ledger's own (every step counted, lost steps included), so that
    epsilon recomputed from it is the reported epsilon."""
    return privacy_record(record, release_facts(job, num_records, notes))


def release_facts(job: JobPlan, num_records: int, notes: Mapping) -> ReleaseFacts:
    """The job's facts for its statement (known once the model and the data are built, before the
    first step: the journal binds their scope, :func:`userdp.lm.statement.statement_scope`)."""
    t, p, plan = job.training, job.privacy, job.plan
    touches = (
        ([notes["data_touch"]] if notes.get("data_touch") else [])
        + ([notes["sample"]] if notes.get("sample") else [])
        + list(p.disclosed_touches or [])
        + (plan_touches(plan) if plan else [])
        + _monitoring(job.output)
    )
    facts = ReleaseFacts(
        algorithm=t.algorithm,
        accountant=p.accountant,
        sampler_assumed=job.sampler_assumed,
        epsilon_target=p.epsilon,
        steps_planned=t.steps,
        group_size=t.group_size,
        num_records=num_records,
        clipping=t.clipping,
        seq_len=job.seq_len,
        selection=t.selection,
        tokenizer_note=notes.get("tokenizer", ""),
        pretraining_note=notes.get("pretraining", ""),
        not_accounted=tuple(touches),
        plan=plan,
        plugins=tuple(plugins.loaded()),
        compute={
            "device": notes.get("device"),
            "chunk_size": notes.get("chunk_size"),
            "quantization": notes.get("quantization"),
            "processes": notes.get("processes", {"world_size": 1, "backend": None}),
            "sharding": t.sharding,
            **({"weights": notes["weights_widened"]} if notes.get("weights_widened") else {}),
        },
    )
    return facts


def save_released_model(rd: RunDir, model, tokenizer, **save_kwargs) -> None:
    """``rd.model``: the model as ``from_pretrained`` loads it (:func:`userdp.lm.models.save_model`,
    ``save_kwargs`` passed on), written atomically with its manifest. Evaluate, report and
    personalize verify the released files against it; the model card (README.md) is derived from
    the verified statement and rewritten by every `userdp report`."""
    with atomic_dir(rd.model, keep_existing=False) as tmp:
        models.save_model(model, tmp, tokenizer, **save_kwargs)
        write_manifest(tmp, exclude=(MODEL_CARD,))


def _monitoring(output: C.OutputConfig) -> list[str]:
    """The run's monitoring files, which hold statistics of the private data without noise."""
    where = (
        "diagnostics.jsonl, curves.png and tensorboard/" if output.tensorboard else "diagnostics.jsonl and curves.png"
    )
    return [
        f"monitoring: the training loss, fraction clipped and non-finite count per step in {where} are "
        "computed on the private data without noise (the data holder's private files; never released)"
    ]


def audit_disclosures(section: dict) -> list[str]:
    """The audit's non-private touches of real users' data, one line each (for not_accounted)."""
    out = [
        f"audit: {section['canaries_included']} synthetic canary users were added to the training data "
        "(they are counted in N; they are not people)"
    ]
    ui = section.get("user_inference")
    if ui:
        out.append(
            f"audit: the user-inference AUC and TPR were computed without noise on the records of "
            f"{ui['trained_users']} training users and {ui['heldout_users']} held-out users "
            "(a non-private statistic of the data)"
        )
    return out


def evaluate_before(ev: C.EvalConfig, model, data: JobData, ctx: JobContext) -> dict:
    """The held-out evaluation state (eval.json), with the starting model's figures when asked
    (the config's ``eval`` section) and not already there (a resumed run keeps its first ones);
    each rank scores a share."""
    rd, log, eval_data = ctx.rd, ctx.log, data.eval
    ev_state = read_json(rd.eval) if rd.eval.is_file() else {}
    if ev.before and "before" not in ev_state:
        log("evaluating the starting model on held-out users ...")
        ev_state["before"] = evaluate_lm(model, eval_data, batch_size=ev.batch_size, combiner=ctx.combiner)
        if ctx.main:
            write_json(rd.eval, ev_state)
        log(f"  before: loss {ev_state['before']['loss']:.4f}, perplexity {ev_state['before']['perplexity']:.2f}")
    model.train()
    return ev_state


def release(job: JobPlan, model, data: JobData, res, ev_state: dict, ctx: JobContext):
    """Evaluate the trained model, then (rank 0) write privacy.json, the model, the curves, the
    state's summary and the report; returns the summary (None on the other ranks)."""
    ev, plan = job.eval, job.plan
    rd, log, notes, audit, t_start = ctx.rd, ctx.log, ctx.notes, ctx.audit, ctx.t_start
    prep, tok, train_data, eval_data = data.prep, data.tok, data.train, data.eval
    model.eval()
    ev_state["after"] = evaluate_lm(model, eval_data, batch_size=ev.batch_size, combiner=ctx.combiner)
    if not ctx.main:
        return None
    if ev.personalize:
        log("personalization evaluation (docs/lm.md) ...")
        ev_state["personalization"] = personalize(
            models.merged(model), eval_data, how=Personalization(ev.personalize_lr, ev.personalize_epochs)
        )
    write_json(rd.eval, ev_state)
    priv = privacy_json(job, res.record, prep.train_subset.num_records, notes)
    priv["split"] = prep.split_rule
    priv["data_drops"] = prep.drops
    if audit is not None:
        log("audit: scoring the canaries under the trained model ...")
        delta = priv["delta"] or job.privacy.delta or float(train_data.num_users) ** -1.1
        priv["audit"] = audit.finish(model, train_data, eval_data, epsilon=priv["epsilon"], delta=delta)
        priv["not_accounted"] = list(priv.get("not_accounted") or []) + audit_disclosures(priv["audit"])
        log(f"audit: {priv['audit']['statement']}")
    write_json(rd.privacy, priv)
    save_released_model(
        rd,
        model,
        tok,
        quantize=job.lora.quantize,  # validate(): quantize needs LoRA
        tokenizer_folder=notes.get("tokenizer_folder"),
    )
    if job.lora.enabled and job.lora.save_adapter:
        with atomic_dir(rd.adapter, keep_existing=False) as tmp:
            models.save_model(model, tmp, None, adapter=True)
            write_manifest(tmp)
    if job.output.plot:
        by_step = {r["step"]: r for r in rd.read_diagnostics()}  # curves.png is private (it plots the loss)
        plot_curves([{**by_step.get(r["step"], {}), **r} for r in rd.read_metrics()], rd.curves)
    summary = {
        "algorithm": job.training.algorithm,
        "perplexity_before": (ev_state.get("before") or {}).get("perplexity"),
        "perplexity_after": ev_state["after"]["perplexity"],
        "loss_before": (ev_state.get("before") or {}).get("loss"),
        "loss_after": ev_state["after"]["loss"],
        "epsilon": priv["epsilon"],
        "delta": priv["delta"],
        "epsilon_target": priv["epsilon_target"],
        "epsilon_total": priv.get("epsilon_total", priv["epsilon"]),
        "epsilon_plan": priv.get("epsilon_plan"),
        "seeded": priv.get("seeded", False),
        "sampler": job.privacy.sampler,
        "epsilon_assuming_poisson": priv.get("epsilon_assuming_poisson"),
        "group_size": job.training.group_size,
        "cohort_size": job.training.cohort_size,
        "plan": (plan or {}).get("applied"),
        "noise_multiplier": priv["noise_multiplier"],
        "sampling_rate": priv["sampling_rate"],
        "steps": res.steps,
        "stopped": res.stopped,
        "train_users": prep.train_subset.num_users,
        "eval_users": prep.eval_subset.num_users,
        "seconds": round(time.time() - t_start, 1),
    }
    if audit is not None:
        a = priv["audit"]
        summary["audit"] = {
            k: a.get(k)
            for k in (
                "statement",
                "epsilon_lower_bound",
                "confidence",
                "canaries",
                "canaries_included",
                "mechanism_caught",
            )
        }
    rd.write_state(status="done", summary=summary)  # public: no path, no count of private events
    write_report(rd.root)  # report.md and report.json, as `userdp report` writes them
    if job.output.tensorboard:
        scalars = Scalars(rd.root, True)
        scalars.evaluation(ev_state, res.steps)
        scalars.text("privacy/statement", (rd.root / "report.md").read_text(), res.steps)
        scalars.close()
    # what the terminal (the data holder's) is told beyond the public summary
    return {**summary, "run_dir": str(rd.root), "nonfinite_units": res.record.nonfinite_units}
