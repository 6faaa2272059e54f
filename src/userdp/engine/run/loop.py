"""The one DP training loop over privacy units, and its entry point :func:`train`.

Each step: sample units -> per-unit strategy (clipped sum of the chunk's units) -> [all-reduce]
-> noise mechanism on the SUM, drawn once -> divide by a public constant -> optimizer. What the
step does is read from the frozen :class:`~userdp.engine.plan.RunPlan`; the loop does not branch
on the algorithm, the clipping strategy, the per-unit strategy or the noise mechanism. ELS, ULS
and FedAvg differ only in their :mod:`~userdp.engine.algorithms` dataclass.
"""

from __future__ import annotations

import hashlib
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from userdp.engine import checkpoint as ckpt
from userdp.engine.distributed.distribution import DISTRIBUTIONS
from userdp.engine.distributed.processes import LocalCombiner
from userdp.engine.journal import JOURNAL
from userdp.engine.plan import SAMPLER_MODE, RunPlan, TrainConfig, config_difference, make_plan, privacy_repr  # noqa: F401  (re-exported)
from userdp.engine.plugin_outputs import checked_loss_fn
from userdp.engine.privacy_record import PrivacyRecord
from userdp.engine.run.options import RunOptions, run_options
from userdp.engine.run.step import EngineRun
from userdp.engine.user_data import UserData
from userdp.errors import BudgetExceededError, UserError
from userdp.validation import check_callable, check_instance


@dataclass
class TrainResult:
    steps: int  # steps applied to the parameters
    epsilon: float
    delta: float
    noise_multiplier: float  # what the accountant sees (effective, with adaptive clipping)
    update_noise_multiplier: float  # z_Delta applied to the update sum
    clip_norm: float
    stopped: str  # "completed" | "budget"
    record: PrivacyRecord
    history: list = field(default_factory=list)


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C during :func:`train`: the step in flight was finished and a checkpoint saved.

    Attributes:
        record: the run's privacy record at that point (every step counted, as in a finished run).
        steps: steps applied to the parameters.
    """

    def __init__(self, message: str, record: PrivacyRecord, steps: int):
        super().__init__(message)
        self.record = record
        self.steps = steps


class _DeferredInterrupt:
    """Defer the first Ctrl-C (SIGINT) to the end of the current step; a second one interrupts at once.

    Only in the main thread and only when there is a checkpoint to write; otherwise a no-op.
    """

    def __init__(self, enabled: bool):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.requested = False
        self._previous = None

    def _handler(self, signum, frame):
        if self.requested:  # second Ctrl-C: stop now (the last checkpoint and the journal remain)
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self):
        if self.enabled:
            self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc):
        if self.enabled:
            signal.signal(signal.SIGINT, self._previous)
        return False


def train(
    model: nn.Module,
    data: UserData,
    loss_fn: Callable,
    config: TrainConfig | RunPlan,
    options: RunOptions | None = None,
) -> TrainResult:
    """Train ``model`` on user-partitioned ``data`` with user-level DP. See docs/engine.md.

    ``config``: the run's :class:`TrainConfig`, or the :class:`RunPlan` already made from it for
    this data (:func:`make_plan`; it must count this data's users and units): the engine then
    trains by that plan, calibrated once, instead of making its own.

    ``loss_fn(model, batch) -> Tensor[n]``: one loss per record (vmappable).

    ``options``: a :class:`~userdp.engine.run.options.RunOptions` (None: one process, in memory):
    its ``checkpoint_dir`` with ``checkpoint_every`` > 0 gets atomic checkpoints (also at the end);
    ``resume=True`` continues from one — or, after a crash before the first checkpoint, from step 0
    with the steps the journal records as begun counted. Each of its ``callbacks`` receives the
    step's metrics dict (step, loss, units, fraction_clipped, clip_norm, step_time, units_per_s,
    epsilon_spent — a cheap upper bound); ``loss`` and ``fraction_clipped`` are computed on private
    data and are NOT privatized: for the data holder's monitoring only. ``on_start(info)`` is called
    once before the first step with what the run will do (noise_multiplier, sampling_rate,
    expected_units, steps, delta, delta_rule, sampler_mode, accountant, target_epsilon,
    steps_accounted, unit).

    Raises:
        UserError: bad configuration, a checkpoint or journal that is damaged, edited or from
            another run, or a checkpoint that could not be written.
        KeyboardInterrupt: after Ctrl-C, once the step in flight is finished and saved.
    """
    options = run_options(options)
    run = start_run(model, data, loss_fn, config, options)
    config = run.cfg
    if options.on_start is not None:
        options.on_start(
            {
                "noise_multiplier": run.noise_multiplier,
                "sampling_rate": run.rate,
                "expected_units": run.expected_units,
                "steps": config.steps,
                "delta": run.delta,
                "delta_rule": run.plan.delta_rule,
                "sampler_mode": run.plan.sampler_mode,
                "accountant": config.accountant,
                "target_epsilon": config.target_epsilon,
                "steps_accounted": run.ledger.spent,
                "unit": run.plan.unit,
                "num_units": run.n_units,
                "noise_kernel": run.noise_kernel,
            }
        )
    try:
        return _train_loop(run, options)
    finally:
        run.chunks.close()


def start_run(
    model: nn.Module,
    data: UserData,
    loss_fn: Callable,
    config: TrainConfig | RunPlan,
    options: RunOptions,
    optimizer: torch.optim.Optimizer | None = None,
) -> EngineRun:
    """A run ready for its first step (shared by :func:`train` and
    :func:`userdp.engine.private_loop.make_private`): its plan made or checked, its journal started
    (or, on ``resume``, its checkpoint restored and its journal's begun steps counted), every rank
    agreeing on the config, the data and the starting model.

    Raises:
        UserError: see :func:`train`."""
    _check_run_arguments(model, data, loss_fn, config)
    loss_fn = checked_loss_fn(loss_fn)  # what the caller's loss returns is checked where it is used
    checkpoint_dir, resume = options.checkpoint_dir, options.resume
    comb = options.combiner or LocalCombiner()
    cfg = config.config if isinstance(config, RunPlan) else config
    DISTRIBUTIONS.lookup(cfg.performance.sharding)().check(cfg, model, comb)  # refused before anything is written
    journal = os.path.join(checkpoint_dir, JOURNAL) if checkpoint_dir else None
    # one writer: the main rank alone checks for (and then starts) the journal; the other ranks
    # would race it. A refusal there ends the main rank, and the others with it (docs/scaling.md).
    if comb.rank == 0 and checkpoint_dir and not resume and (ckpt.exists(checkpoint_dir) or os.path.exists(journal)):
        raise UserError(
            f"{checkpoint_dir} already holds a checkpoint: pass resume=True to continue it, or use an empty directory"
        )
    created = bool(checkpoint_dir) and comb.rank == 0 and not os.path.exists(checkpoint_dir)
    if checkpoint_dir and comb.rank == 0:
        try:
            os.makedirs(checkpoint_dir, exist_ok=True)
        except OSError as e:
            raise UserError(f"checkpoint_dir {checkpoint_dir}: cannot create it ({e.strerror or e})") from None
    run = EngineRun(model, data, loss_fn, config, options, optimizer=optimizer)
    if not resume:
        try:
            _check_one_step_fits(run)
        except UserError:
            if created and not os.listdir(checkpoint_dir):  # nothing half-made is left behind
                os.rmdir(checkpoint_dir)
            raise
    if comb.world_size > 1:
        _agree(run)
    if resume and ckpt.exists(checkpoint_dir):
        run.restore(ckpt.load(checkpoint_dir))
    elif resume and comb.rank == 0:
        # crashed before the first checkpoint: the steps it began are spent all the same (never
        # replayed under the same noise: a seeded run is keyed anew); a missing or damaged journal is refused
        run.ledger.resume_without_checkpoint(replayable=False)
    elif checkpoint_dir and not resume and comb.rank == 0:
        run.ledger.start_journal()
    if comb.world_size > 1:  # every rank counts what the main rank's journal says
        counts = torch.tensor([float(run.ledger.spent), float(run.ledger.lost_steps)], dtype=torch.float64)
        spent, lost = comb.broadcast_from_main([counts])[0].tolist()
        run.ledger.spent, run.ledger.lost_steps = int(spent), int(lost)
    if resume and run.seeded and run.ledger.spent > run.restored_spent:
        run.rekey(run.ledger.spent)  # on every rank alike: the steps begun after the checkpoint are not replayed
    return run


def _check_one_step_fits(run: EngineRun) -> None:
    """A fresh run whose target epsilon does not admit one step (a fixed sigma too small for it)
    would take no step and still release its starting model and a statement: refused up front.

    Raises:
        UserError: naming the noise multiplier, the target and what one step spends."""
    ledger = run.ledger
    if not ledger.private or ledger.target_epsilon is None or ledger.allows(1):
        return
    one = ledger.epsilon(steps=ledger.spent + 1)
    raise UserError(
        f"target_epsilon {ledger.target_epsilon:g}: not one step fits at noise multiplier "
        f"{run.noise_multiplier:.4g} (one step spends epsilon = {one:.4g} at delta = {ledger.delta:.3g}); "
        "raise the noise multiplier, or give none to calibrate it to the target"
    )


def _check_run_arguments(model, data, loss_fn, config) -> None:
    """The engine's boundary for :func:`train` and ``make_private``: each argument of the right
    kind, named in one line, before anything is built from it (the options are checked
    by :class:`~userdp.engine.run.options.RunOptions` itself).

    Raises:
        UserError: the first argument that is wrong."""
    check_instance(model, "model", nn.Module, "a torch.nn.Module")
    if not any(p.requires_grad for p in model.parameters()):
        raise UserError("model has no parameter with requires_grad=True: there is nothing to train")
    check_instance(data, "data", UserData, "a userdp.engine.UserData (e.g. TensorUserData)")
    check_callable(loss_fn, "loss_fn")
    check_instance(config, "config", (TrainConfig, RunPlan), "a TrainConfig (or a RunPlan made from one)")


def _agree(run: EngineRun) -> None:
    """Make every rank start from the main rank's model, and refuse ranks whose configuration or
    data differ from the main rank's (a node with another config file or another corpus would
    otherwise train on a cohort that is not the one accounted).

    Raises:
        UserError: this rank's engine config or unit count differ from rank 0's, or its data
            (:meth:`~userdp.engine.user_data.UserData.fingerprint`: which user is which, and each
            user's records) does.
    """
    comb = run.combiner
    config = hashlib.sha256(repr(run.cfg).encode() + np.int64(run.n_units).tobytes()).digest()
    data = run.data.fingerprint()
    mine = [torch.tensor(np.frombuffer(d, dtype=np.int64).copy()) for d in (config, data)]
    main = [t.cpu() for t in comb.broadcast_from_main([t.clone() for t in mine])]
    if not torch.equal(mine[0], main[0]):
        raise UserError(
            f"rank {comb.rank}: this process's training config differs from rank 0's "
            "(every process of a job must read the same config)"
        )
    if not torch.equal(mine[1], main[1]):
        raise UserError(
            f"rank {comb.rank}: this process's data differ from rank 0's: its users, their order or "
            "their records (every process must number the same people alike; ids pseudonymised "
            "with Python's hash() are salted per process: use a keyed hash such as hashlib.blake2b)"
        )
    # e.g. a randomly initialised preset or LoRA's random A: rank 0's values on every rank (a distribution
    # that splits the model did so before splitting it: its ranks now hold different parts)
    run.distribution.share_initial_state(comb, run)


def _train_loop(run: EngineRun, options: RunOptions) -> TrainResult:
    config, checkpoint_dir, checkpoint_extra = run.cfg, options.checkpoint_dir, options.checkpoint_extra
    every = config.performance.checkpoint_every
    stopped = "completed"
    with _DeferredInterrupt(enabled=bool(checkpoint_dir)) as interrupt:
        while run.step < config.steps:
            try:
                # a Ctrl-C on any rank stops every rank after the same step (one-process runs: at once)
                m = run.run_step(stop_requested=interrupt.requested)
            except BudgetExceededError:
                stopped = "budget"
                break
            agreed = m.pop("stop")
            run.history.append(m)
            for cb in options.callbacks:
                cb(m)
            if agreed or (interrupt.requested and run.combiner.world_size == 1):
                # Ctrl-C: the step in flight was finished (parameters, optimizer and ledger agree),
                # so save it and stop: nothing is lost, `resume=True` continues from here.
                run.save(checkpoint_extra)
                rec = run.record().replace(stopped="interrupted")
                raise TrainingInterrupted(
                    f"interrupted after step {run.step}; checkpoint saved in {checkpoint_dir}", rec, run.step
                )
            if checkpoint_dir and every and run.step % every == 0:
                run.save(checkpoint_extra)
    if checkpoint_dir:
        run.save(checkpoint_extra)
    rec = run.record().replace(stopped=stopped)
    return TrainResult(
        steps=run.step,
        epsilon=rec.epsilon,
        delta=run.delta,
        noise_multiplier=run.noise_multiplier,
        update_noise_multiplier=run.update_z,
        clip_norm=float(run.clip_state["clip_norm"]),
        stopped=stopped,
        record=rec,
        history=run.history,
    )
