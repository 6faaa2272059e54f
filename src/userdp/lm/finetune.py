"""``userdp train``: the job as named phases over one configuration —

1. :mod:`~userdp.lm.prepare` — the data: user store, held-out split, public text, tokenized users;
2. :mod:`~userdp.lm.starting_model` — the tokenizer and the starting model, on its device;
3. :mod:`~userdp.lm.plan_auto` and :mod:`~userdp.lm.job_plan` — the plan's choices, the engine's
   config and the one run plan the budget check and the engine share;
4. :mod:`~userdp.lm.training` — the engine trains by that plan; metrics and checkpoints;
5. :mod:`~userdp.lm.release` — evaluate, save the model and privacy.json, write the report.

:func:`run` orchestrates them and owns the run directory's life: a new run that fails before its
first step leaves nothing; once a step has begun, the directory and its ledger stay. The empirical
audit enters as hooks passed in by the CLI (``audit=``), so this layer does not import it.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from userdp.caches import cache_in, private_cache_for
from userdp.devices import resolve_device
from userdp.engine import checkpoint as ckpt
from userdp.engine.distributed.sharding import gathered_model
from userdp.engine.journal import JOURNAL
from userdp.errors import UserError
from userdp.fileio import atomic_dir, write_atomic
from userdp.lm import config as C
from userdp.lm import models
from userdp.lm.job_context import JobContext, JobData, Launch
from userdp.lm.job_plan import check_budget, check_cohort, num_units, resolve, resolve_chunk_size
from userdp.lm.model_fit import check_model_fits
from userdp.lm.plan_auto import planned_config
from userdp.lm.prepare import Log, build_datasets, prepare_data, stderr_log
from userdp.lm.release import evaluate_before, release
from userdp.lm.run_dir import RunDir, check_metrics_cite_journal, existing_run_dir, new_run_dir
from userdp.lm.starting_model import float32_for_sharding, get_tokenizer_and_model, place_model
from userdp.lm.tensorboard_log import check_available
from userdp.lm.training import train_model
from userdp.progress import shown as bars_shown
from userdp.world import JobStopped, World, translate


def _check_resumable(rd: RunDir, resume_dir: str) -> bool:
    """Whether the engine has anything to resume (False: the run crashed before its first step,
    and simply starts in the same directory). Refuses a run directory whose ledger was lost."""
    state = rd.read_state()
    if state.get("status") == "done":
        raise UserError(f"--resume {resume_dir}: this run already finished")
    journal = rd.checkpoints / JOURNAL
    metrics = rd.read_metrics()
    if not journal.is_file():
        if ckpt.exists(str(rd.checkpoints)) or metrics or state.get("status") in ("running", "interrupted"):
            raise UserError(
                f"{journal}: the ledger journal is missing, so the steps this run began cannot "
                "be counted; the run cannot be resumed (restore it from a backup, or start a "
                "new run in an empty --output)"
            )
        return False
    check_metrics_cite_journal(rd)
    return True


def _keep_performance_changes(rd: RunDir, cfg: C.RunConfig, log: Log) -> None:
    """A resumed run's changed performance settings (``--resume RUN --set training.chunk_size=4``)
    are written into its config.yaml, its comment lines kept; the journal is bound to the rest.

    Raises:
        UserError: anything but a performance setting differs from the saved config."""
    saved, new = C.to_dict(C.load_config(rd.config)), C.to_dict(cfg)
    if saved == new:
        return

    def section(cfg: dict, name: str) -> dict:
        return cfg[name] if isinstance(cfg.get(name), dict) else {}

    changed = sorted(
        f"{s}.{k}"
        for s in set(new) | set(saved)
        for k in set(section(new, s)) | set(section(saved, s))
        if section(saved, s).get(k) != section(new, s).get(k)
    )
    if C.privacy_fingerprint(saved) != C.privacy_fingerprint(new):
        keys = [k for k in changed if not C.is_performance_key(k)]
        raise UserError(
            f"--resume {rd.root}: only performance settings may change on resume; changed: "
            f"{', '.join(keys) or 'the config'} (saved in {rd.config})"
        )
    header = "".join(ln for ln in rd.config.read_text().splitlines(keepends=True) if ln.startswith("#"))
    write_atomic(rd.config, header + C.dump_yaml(cfg), replaces_input=True)  # the run's own, on purpose
    log(f"resume: performance settings changed ({', '.join(changed)}); saved in {rd.config}")


def run(
    cfg: C.RunConfig,
    *,
    output: str | None = None,
    resume_dir: str | None = None,
    progress: bool = True,
    log: Log = stderr_log,
    launch: Launch | None = None,
) -> dict | None:
    """Run (or resume) a training job; returns the summary (also in the run directory).

    ``output``: the new run's directory (empty or absent; None: ``output.dir``, else
    ``runs/<UTC time>``); ``resume_dir``: a run directory to continue instead. A new run that fails
    before its first step (bad data, a budget that cannot be met, ...) removes the run directory it
    made, so nothing half-written blocks the rerun; once a step has begun, the directory (and its
    ledger) stays.

    ``launch`` (:class:`userdp.lm.job_context.Launch`): what the command line brings: the job's
    processes (under torchrun every rank calls this; rank 0 alone writes and logs, docs/scaling.md,
    and only rank 0 returns the summary, the others None), a plan saved by ``userdp plan`` to apply
    (its data touches and its DP median's epsilon then go into the report, as with ``plan: auto``),
    and the empirical audit's hooks (needed when ``cfg.audit.canaries > 0``).

    Raises:
        UserError: bad configuration or data, a damaged run directory, an unmet budget.
        KeyboardInterrupt: after Ctrl-C (the run can be resumed).
        userdp.world.PeerLost: another process of a torchrun job failed (the run can be resumed)."""
    launch = launch or Launch()
    world, audit = launch.world or World(), launch.audit
    if not world.is_main:
        log, progress = (lambda msg: None), False
    try:
        with bars_shown(progress):  # every phase's bar, as the training bar, follows --no-progress
            ctx = JobContext(world=world, log=log, progress=progress, plan_file=launch.plan_file, resume_dir=resume_dir)
            return _run_top(cfg, output, audit, ctx)
    except (Exception, JobStopped) as exc:
        lost = exc if isinstance(exc, JobStopped) else translate(exc) if world.distributed else None
        if lost is None:
            raise
        if world.is_main and world.run_dir and Path(world.run_dir, "state.json").is_file():
            RunDir(Path(world.run_dir)).write_state(status="interrupted", stopped=str(lost))
        raise lost from None


def _run_top(cfg, output: str | None, audit_hooks: Callable | None, ctx: JobContext) -> dict | None:
    world, log, resume_dir = ctx.world, ctx.log, ctx.resume_dir
    check_available(cfg.output.tensorboard)  # before anything is read or made
    if world.distributed and cfg.audit.canaries:
        raise UserError(
            "audit.canaries: the empirical audit runs in one process only (its canaries and "
            "secrets file are not shared out yet); run `userdp audit` without torchrun"
        )
    C.check_sharding(cfg, world.distributed)
    if resume_dir is not None:
        rd = existing_run_dir(resume_dir)
        # rank 0 reads the journal and metrics (the others would race its rewrite of metrics.jsonl)
        with world.main_first("checking the run directory"):
            checked = _check_resumable(rd, resume_dir) if world.is_main else None
            if world.is_main:
                _keep_performance_changes(rd, cfg, log)
        engine_resume = world.broadcast_object(checked)
        audit = _audit_session(audit_hooks, cfg, rd, True, log, steps_begun=engine_resume)
        return _run(cfg, ctx.with_(rd=rd, engine_resume=engine_resume, audit=audit))
    if not world.is_main:  # rank 0 makes the run directory; the others use it
        with world.main_first("creating the run directory"):
            pass
        made = RunDir(Path(world.broadcast_object(None)))  # made by rank 0 (its config.yaml comes with the plan)
        return _run(cfg, ctx.with_(rd=made))
    target = Path(output or cfg.output.dir) if (output or cfg.output.dir) else None
    existed = target is not None and target.is_dir()
    rd = audit = None
    try:
        with world.main_first("creating the run directory"):
            rd = new_run_dir(output or cfg.output.dir)
            audit = _audit_session(audit_hooks, cfg, rd, False, log)
            rd.write_state(status="starting", started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        world.broadcast_object(str(rd.root.resolve()))
        return _run(cfg, ctx.with_(rd=rd, audit=audit))
    except BaseException:
        if rd is not None and not (rd.checkpoints / JOURNAL).exists():  # no step began: nothing to keep
            shutil.rmtree(rd.root, ignore_errors=True)
            if existed:
                rd.root.mkdir(parents=True, exist_ok=True)
            if audit is not None:
                audit.discard()
        raise


def _audit_session(
    hooks: Callable | None, cfg: C.RunConfig, rd: RunDir, resume: bool, log: Log, steps_begun: bool = False
):
    """The run's audit session (from ``hooks``, see :func:`run`) when ``audit.canaries > 0``, else None."""
    if not cfg.audit.canaries:
        return None
    if hooks is None:
        raise UserError(
            "audit.canaries: this run was started without the audit's hooks; use `userdp train` or "
            "`userdp audit`, or pass audit=userdp.audit.session.AuditSession to finetune.run"
        )
    return hooks(cfg.audit, rd.root, resume=resume, log=log, steps_begun=steps_begun)


def _run(cfg: C.RunConfig, ctx: JobContext) -> dict | None:
    # output.cache: run keeps every cached copy of this run's data in the run directory; a folder is
    # the project's, shared with its other runs, plans and evaluations
    where = private_cache_for(cfg.output.cache, ctx.rd.root)
    if where is not None:
        with cache_in(where):
            return _run_job(cfg, ctx)
    return _run_job(cfg, ctx)


def _run_job(cfg: C.RunConfig, ctx: JobContext) -> dict | None:
    """The phases, in order (see the module docstring)."""
    rd, world, log = ctx.rd, ctx.world, ctx.log
    ctx = ctx.with_(t_start=time.time(), device=resolve_device(cfg.model.device))  # once, before any data is read
    if ctx.audit is not None and ctx.audit.gradient and cfg.training.per_unit != "vmap":
        # the gradient canaries' loss term uses a weight directly: only vmap's per-unit gradients
        # see it. Settled from the config alone, before the data, so config.yaml says what runs
        cfg = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, per_unit="vmap"))
        log("audit: gradient canaries: per-unit gradients by vmap")
    world.run_dir = str(rd.root)
    log(f"run directory: {rd.root}")
    if world.distributed:
        log(f"processes: {world.world_size} ({world.backend}); rank 0 writes the run directory")
    check_model_fits(cfg.model, cfg.tokenizer)  # a model folder that cannot read its tokenizer's ids: before the data
    # 1. the data (refused early when the cohort or a fixed sigma's budget cannot work)
    with world.main_first("preparing the data"):
        prep = prepare_data(cfg.data, log)
    if cfg.plan != "auto" and ctx.plan_file is None:  # no plan replaces these settings: refuse before the model
        check_cohort(cfg, num_units(cfg, prep.train_subset))
        check_budget(cfg, prep.train_subset.num_users, num_units(cfg, prep.train_subset))
    # 2. the tokenizer and the starting model
    with world.main_first("building the tokenizer and the model"):
        tok, model, notes = get_tokenizer_and_model(
            cfg.tokenizer, cfg.model, prep, log, ctx.progress, device=ctx.device
        )
    if prep.sample_note:  # what a sample whose rate depends on N leaves of the guarantee: the report states it
        notes = {**notes, "sample": prep.sample_note}
    model, combiner, placed = place_model(cfg.model, model, world, log, device=ctx.device)
    ctx = ctx.with_(combiner=combiner).noted(notes, **placed)
    device = ctx.device
    if cfg.training.sharding == "fsdp":
        ctx = ctx.noted(float32_for_sharding(model, log))
    with world.main_first("tokenizing the data"):
        train_data, eval_data = build_datasets(
            prep, tok, seq_len=cfg.tokenizer.seq_len, selection=cfg.training.selection, log=log, model=model
        )
    if train_data.data_touch is not None:  # a non-private touch of the data: the report states it
        ctx = ctx.noted(data_touch=train_data.data_touch)
    # 3. the plan: its choices, the audit's canaries (before any step), the chunk size, the run plan
    cfg, plan = planned_config(cfg, ctx, prep, train_data, model)
    audit = ctx.audit
    if audit is not None:  # canary users join the training data (docs/audit.md)
        train_data = audit.attach(train_data, eval_data, tok, model, cfg)
    with world.main_first("choosing the chunk size"):  # rank 0's choice, saved, is every rank's
        chunk_size, chunk_info = resolve_chunk_size(cfg, model, device, rd, log, world.world_size)
    if chunk_info:
        ctx = ctx.noted(chunk_size=chunk_info)
    # the job plan: the sections the later phases read and the one run plan (budget checked)
    job = resolve(cfg, train_data.num_users, num_units(cfg, train_data), plan, device, chunk_size=chunk_size)
    data = JobData(prep=prep, tok=tok, train=train_data, eval=eval_data)
    if ctx.main:
        with atomic_dir(rd.tokenizer, keep_existing=False) as tmp:
            models.hf_tokenizer(tok).save_pretrained(str(tmp))
    # 4. train (the held-out users scored first)
    ev_state = evaluate_before(job.eval, model, data, ctx)
    res = train_model(job, model, data, ctx)
    model = gathered_model(model)  # a sharded run's phases after training use the whole model (every rank)
    # 5. evaluate, save, report (rank 0 writes)
    return release(job, model, data, res, ev_state, ctx)
