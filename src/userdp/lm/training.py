"""Phase 4 of ``userdp train``: training. The engine trains the model by the job's run plan; this
module adds what the LM job keeps beside it — metrics.jsonl (one row per step, citing the ledger
journal), the progress bar, the weights and ledger summary committed with each engine checkpoint,
and on Ctrl-C a privacy statement of the steps spent."""

from __future__ import annotations

import json
import time

from safetensors.torch import save_file

from userdp.engine import checkpoint as ckpt
from userdp.engine.run.loop import TrainingInterrupted, train
from userdp.engine.run.options import RunOptions
from userdp.engine.user_data import DelegatingUserData
from userdp.fileio import strict_dumps, write_atomic, write_json
from userdp.lm import models
from userdp.lm.job_context import JobContext, JobData
from userdp.lm.job_plan import JobPlan
from userdp.lm.plan_file import plan_median_epsilon
from userdp.lm.prepare import Log, Prepared
from userdp.lm.release import privacy_json, release_facts
from userdp.lm.report import write_report
from userdp.lm.run_dir import RunDir
from userdp.lm.statement import statement_scope
from userdp.lm.tensorboard_log import Scalars
from userdp.progress import LOOP_LINES
from userdp.progress import bar as progress_bar


class _TokenCounter:
    """Wraps a UserData and counts the target tokens the engine pulls (for tokens/s).

    The wrapper is a :class:`~userdp.engine.user_data.DelegatingUserData`: everything it does not
    count (``bounded_records`` above all — ELS's D' under ranked selection) goes to the data."""

    def __init__(self, inner):
        self.inner = inner
        self.tokens = 0

    def wrap(self):
        outer = self

        class Counted(DelegatingUserData):
            def gather(self, users, records):
                b = self.inner.gather(users, records)
                outer.tokens += int((b["labels"] != -100).sum())
                return b

            def draw_records(self, users, group_size, rng):
                b, mask = self.inner.draw_records(users, group_size, rng)
                real = (b["labels"] != -100).sum(-1).to(mask.dtype) * mask
                outer.tokens += int(real.sum())
                return b, mask

        return Counted(self.inner)


def journal_context(rd: RunDir, prep: Prepared) -> dict:
    """What a run's ledger journal is bound to: the saved config (less its performance settings,
    which a resume may change) and the data + split."""
    return {"config_privacy_sha256": rd.config_fingerprint(), "data_fingerprint": prep.data_fingerprint}


def train_model(job: JobPlan, model, data: JobData, ctx: JobContext):
    """Train ``model`` by the engine under the job's run plan (``job.engine``); returns the
    engine's result.

    Raises:
        KeyboardInterrupt: after Ctrl-C, once the step in flight is saved (with a privacy
            statement of the steps spent written to the run directory)."""
    rd, world, log, audit, notes, prep = ctx.rd, ctx.world, ctx.log, ctx.audit, ctx.notes, data.prep
    main, engine_resume, progress, train_data = ctx.main, ctx.engine_resume, ctx.progress, data.train
    plan = job.engine if audit is None else audit.plan(job.engine)  # the frozen run plan the engine trains by
    private = plan.private
    steps = plan.config.steps
    counter = _TokenCounter(train_data)
    counted = counter.wrap()
    start_step = 0
    if engine_resume:
        start_step = ckpt.step_of(str(rd.checkpoints))
        if main:
            for path, rows in ((rd.metrics, rd.read_metrics()), (rd.diagnostics, rd.read_diagnostics())):
                kept = [r for r in rows if r["step"] <= start_step]
                write_atomic(path, "".join(strict_dumps(r) + "\n" for r in kept))
        log(f"resuming at step {start_step} of {steps}")
    bar = (
        progress_bar(steps, f"train {job.training.algorithm}", "step", initial=start_step, lines=LOOP_LINES)
        if progress
        else None
    )
    mfile = open(rd.metrics, "a") if main else None  # noqa: SIM115 - closed below, whatever happens
    dfile = open(rd.diagnostics, "a") if main else None  # noqa: SIM115 - likewise
    scalars = Scalars(rd.root, job.output.tensorboard and main, start_step)  # closed below too
    last_tok = [0, time.time()]

    def on_step(m: dict) -> None:
        if mfile is None:  # one writer
            return
        now = time.time()
        toks = counter.tokens - last_tok[0]
        dt = max(1e-9, m.get("step_time") or (now - last_tok[1]))
        last_tok[0], last_tok[1] = counter.tokens, now
        # metrics.jsonl is public: nothing in it may be a function of the step's cohort. The cohort
        # size, token count, throughput and step time are exact counts of it; the loss, the fraction
        # clipped (its reduced denominator divides the cohort size) and the non-finite units (an
        # adversary's NaN record counts its own participations) are un-noised statistics of it. Those
        # go to diagnostics.jsonl, the data holder's private file (docs/threat_model.md)
        row = {
            "step": m["step"],
            "epsilon": m.get("epsilon_spent"),
            "clip_norm": m.get("clip_norm") if private else None,  # C, or the adaptive C (a DP release)
            "journal": m.get("journal"),
        }  # binds the ledger journal's length (docs/threat_model.md)
        diag = {
            "step": m["step"],
            "loss": m["loss"],
            "fraction_clipped": m.get("fraction_clipped") if private else None,
            "nonfinite_units": m.get("nonfinite_units", 0),
        }
        mfile.write(strict_dumps(row) + "\n")  # strict JSON (a non-private run's epsilon is "inf")
        mfile.flush()
        dfile.write(strict_dumps(diag) + "\n")
        dfile.flush()
        scalars.step({**row, **diag})  # TensorBoard's folder is private too
        if bar is not None:
            eps = row["epsilon"]
            bar.update(1)
            bar.set_postfix_str(
                f"loss {diag['loss']:.3f} eps {eps if eps is None else f'{eps:.2f}'} tok/s {toks / dt:.0f}"
            )

    def checkpoint_files(run) -> dict:
        """The LM files committed with each engine checkpoint, as one unit."""
        eps = run.ledger.epsilon_upper_bound()
        files = {"ledger.json": lambda path: _write_ledger_summary(path, run.step, run.ledger.spent, eps)}
        if not run.distribution.every_rank_writes:  # else the weights are in each rank's part (docs/scaling.md)
            files["model.safetensors"] = lambda path: _save_weights(model, path, run.step, eps)
        return files

    if main:
        rd.write_state(status="running")
    context = journal_context(rd, prep)
    # the statement's scope, fixed before the first step: `userdp report` checks privacy.json against it
    context["statement"] = statement_scope(release_facts(job, prep.train_subset.num_records, ctx.notes))
    if job.plan:  # the plan's DP median is part of the statement: bound before the first step
        context["plan_dp_median_epsilon"] = plan_median_epsilon(job.plan, str(rd.root / "plan.json"))
    if audit is not None:
        context.update(audit.journal_context())
    try:
        loss_fn = audit.loss(models.causal_lm_loss) if audit is not None else models.causal_lm_loss
        callbacks = [on_step] + ([lambda m: audit.observe_step(model)] if audit is not None else [])
        return train(
            model,
            counted,
            loss_fn,
            plan,
            RunOptions(
                checkpoint_dir=str(rd.checkpoints),
                resume=engine_resume,
                callbacks=callbacks,
                journal_context=context,
                checkpoint_extra=checkpoint_files,
                on_start=lambda info: _announce(info, log),
                combiner=ctx.combiner,
            ),
        )
    except KeyboardInterrupt as exc:
        if main:
            rd.write_state(status="interrupted")
            if isinstance(exc, TrainingInterrupted):  # the step in flight finished: state what was spent
                priv = privacy_json(job, exc.record, prep.train_subset.num_records, notes)
                priv["split"], priv["data_drops"], priv["stopped"] = prep.split_rule, prep.drops, "interrupted"
                write_json(rd.privacy, priv)
                write_report(rd.root)
            log(
                f"interrupted: the last checkpoint in {rd.checkpoints} and the ledger journal are kept; "
                f"continue with: {'torchrun ... -m ' if world.distributed else ''}userdp train --resume {rd.root}"
            )
        raise
    finally:
        for f in (mfile, dfile):
            if f is not None:
                f.close()
        scalars.close()
        if bar is not None:
            bar.close()


def _announce(info: dict, log: Log) -> None:
    """What the run will do, before its first step."""
    if info["noise_multiplier"] == 0:
        log(f"training {info['steps']} steps WITHOUT noise (non-private): no privacy guarantee")
        return
    unit = "records" if info["unit"] == "record" else "users"
    log(
        f"privacy: sigma {info['noise_multiplier']:.4g}, sampling rate q {info['sampling_rate']:.4g} "
        f"({info['sampler_mode']}), expected {info['expected_units']:.4g} {unit} per step of "
        f"{info['num_units']}, {info['steps']} steps, target epsilon {info['target_epsilon']}, "
        f"delta {info['delta']:.3g} ({info['delta_rule']}), accountant {info['accountant']}"
        + (f"; {info['steps_accounted']} steps already accounted" if info["steps_accounted"] else "")
    )
    if str(info.get("noise_kernel", "")).startswith("eager (torch.compile") or "differed" in str(
        info.get("noise_kernel")
    ):
        log(f"warning: the device noise kernel runs {info['noise_kernel']}: correct, but about 20x slower")


def _save_weights(model, path, step: int, eps) -> None:
    """Write the trainable weights to ``path`` (checkpoints/model.safetensors, committed with the
    engine's checkpoint as one unit)."""
    tensors = {n: p.detach().cpu().contiguous() for n, p in model.named_parameters() if p.requires_grad}
    save_file(tensors, str(path), metadata={"step": str(step), "epsilon_spent_upper_bound": str(eps)})


def _write_ledger_summary(path, step: int, spent: int, eps) -> None:
    """A readable summary of the ledger; the authoritative state is checkpoint.pt and the journal."""
    with open(path, "w") as f:
        json.dump(
            {
                "step": step,
                "steps_accounted": spent,
                "epsilon_spent_upper_bound": eps,
                "authoritative": ["checkpoint.pt (ledger state)", "ledger_journal.jsonl (hash chain)"],
            },
            f,
            indent=2,
        )
        f.write("\n")
