"""What a run is built from, built once before its first step (:func:`build_run`): the distribution
and the per-unit strategy it hands the model to, the master weights, the keys, the unit table and
its loader, the plan (made here, or the caller's, checked against this data), the noise mechanism
over this run's keyed source, the ledger and its journal, the clipping's state and the optimizer.

The step (:mod:`userdp.engine.run.step`) composes these parts and builds none of them.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

from userdp.engine.distributed.distribution import DISTRIBUTIONS
from userdp.engine.distributed.processes import LocalCombiner
from userdp.engine.ledger import PrivacyLedger
from userdp.engine.model_lint import mixing_modules
from userdp.engine.optimizers import own_optimizer
from userdp.engine.per_unit import make_per_unit
from userdp.engine.plan import RunPlan, TrainConfig, make_plan, privacy_repr
from userdp.engine.precision import EXACT_FLOAT32, Precision
from userdp.engine.run.cohort import Chunks, bounding_rng
from userdp.engine.run.options import RunOptions
from userdp.engine.run.state import fresh_sampler_state, seeds
from userdp.engine.user_data import UserData
from userdp.errors import UserError


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Norms, clipped sums, the denominator and the noise: float32, or float64 for a float64 model."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def build_run(run, model, data, loss_fn, config: TrainConfig | RunPlan, options: RunOptions) -> None:
    """Give ``run`` its parts (attributes), in the order each needs the ones before it; the optimizer
    last (:func:`build_optimizer`).

    Raises:
        UserError: data that is not a :class:`~userdp.engine.user_data.UserData`, a plan made for
            other data, or a part that refuses the model, the device or the optimizer."""
    if not isinstance(data, UserData):
        raise UserError(f"data must be a userdp.engine.UserData, got {type(data).__name__}")
    given_plan = config if isinstance(config, RunPlan) else None
    cfg: TrainConfig = config.config if isinstance(config, RunPlan) else config
    run.model, run.data, run.cfg, run.algo = model, data, cfg, cfg.algorithm
    run.combiner = options.combiner or LocalCombiner()
    run.dir = options.checkpoint_dir
    run.seeded = cfg.seed is not None
    _hold_model(run, model, loss_fn, cfg)
    # generators: the cohort and the data key (identical on every rank), the noise (main rank)
    data_key, source, torch_seed = seeds(cfg.seed, run.combiner, run.device)
    if run.seeded:
        torch.manual_seed(torch_seed)  # dropout etc. inside the model
    # D' (ELS's records kept per user) from its own generator, never from the cohort's: a user
    # with more than G records consumes draws, so sharing the cohort's stream would let one
    # added user move every later cohort (its membership must be its own draws alone)
    run.table = run.algo.units(data, bounding_rng(data_key))
    run.chunks = Chunks(run.algo, data, run.table, run.params[0], cfg.performance.chunk_size, data_key)
    run.plan = _plan(cfg, given_plan, data, run.table)
    run.sampler = run.plan.sampler
    run.sampler_state = fresh_sampler_state(run)
    _noise(run, source)
    run.ledger = _ledger(run, cfg, options)
    run.clip_state = run.plan.clipping.initial_state()
    run.step = 0
    run.nonfinite_units = 0  # units whose update was Inf/NaN (zeroed); NOT a private statistic
    run.history = []


def _hold_model(run, model, loss_fn, cfg: TrainConfig) -> None:
    """The distribution part (how the model is held, the sums accumulate and the noise is released),
    the per-unit strategy it trains with, and the weights the optimizer steps."""
    perf = cfg.performance
    precision = Precision(perf.precision)
    run.distribution = DISTRIBUTIONS.lookup(perf.sharding)()
    run.distribution.prepare(cfg, model, run.combiner)
    run.per_unit = make_per_unit(
        run.distribution.per_unit(perf.per_unit), model, loss_fn, run.algo, precision, run.distribution.coverage
    )
    run.mixing = mixing_modules(model)  # checked again at every release
    run.params = run.per_unit.params
    run.device = run.params[0].device
    precision.check_device(run.device)
    # Low-precision models train on float32 master weights: the released update (noised sum
    # / denominator) is float32, the optimizer steps the masters, the model gets a rounded copy
    # (post-processing). Norms, sums and noise are float32 whatever the model's dtype.
    if any(p.dtype in (torch.float16, torch.bfloat16) for p in run.params):
        run.master = [nn.Parameter(p.detach().float().clone()) for p in run.params]
    else:
        run.master = run.params
    run.distribution.check_params(run.params)
    run.precision = {
        "autocast": cfg.performance.precision,
        "model": sorted({str(p.dtype).replace("torch.", "") for p in run.params}),
        "master_weights": "float32" if run.master is not run.params else "the model's own",
        "norms_sums_noise": sorted({str(accumulation_dtype(p.dtype)).replace("torch.", "") for p in run.params}),
        "float32_contractions": EXACT_FLOAT32,
    }


def _plan(cfg: TrainConfig, given: RunPlan | None, data, table) -> RunPlan:
    """The frozen plan (mechanism, noise, denominator, delta; calibrated if a target is given): made
    from this data's counts, or the caller's, which must be the plan of this data (its mechanism,
    delta and denominator were derived from the counts it was made for).

    Raises:
        UserError: a given plan's counts differ from the data's."""
    total_weight = float(table.weights.sum()) if table.weights is not None else None
    if given is None:
        return make_plan(cfg, num_users=data.num_users, num_units=len(table), total_weight=total_weight)
    num_users, num_units = int(data.num_users), len(table)
    expected_weight = given.expected_units * (total_weight if total_weight is not None else num_units) / num_units
    if (given.num_users, given.num_units) != (num_users, num_units) or not math.isclose(
        given.expected_weight, expected_weight, rel_tol=1e-12
    ):
        raise UserError(
            f"the run plan was made for {given.num_users} users and {given.num_units} units; this data "
            f"has {num_users} users and {num_units} units (make the plan from this data: make_plan)"
        )
    return given


def _noise(run, source) -> None:
    """The plan's noise mechanism over this run's keyed source, checked by the distribution; what
    it is added to each step (the sums, one per trainable parameter, in float32+); its state where
    the distribution keeps it; the device
    kernel built (compiled, checked) now, not in step 1, its status recorded (no silent eager)."""
    run.noise = run.plan.make_noise(source)
    run.distribution.check_noise(run.noise)
    run.sum_numel = sum(p.numel() for p in run.params)
    run.sum_dtypes = sorted({accumulation_dtype(p.dtype) for p in run.params}, key=str)
    run.noise_state = run.distribution.noise_init(run)  # held by the run, checkpointed, never released
    prepare = getattr(source, "prepare", None)
    if prepare is not None:
        run.noise_kernel = prepare(run.device)
    else:
        run.noise_kernel = "host generator" if source is not None else "none on this rank"


def _ledger(run, cfg: TrainConfig, options: RunOptions) -> PrivacyLedger:
    """The run's ledger, its journal attached on the main rank (one writer; every rank counts) and
    the prior releases counted first, against the budget (a resumed run's checkpoint restores the
    same, with its steps). The journal is bound to everything its epsilon depends on: the config,
    delta (a default delta is computed from N) and the accountant, so a privacy record that names
    others is caught (performance settings — chunk size, per-unit strategy, precision, checkpoint
    cadence — may change)."""
    plan = run.plan
    context = {
        "engine_privacy_config_sha256": hashlib.sha256(privacy_repr(cfg).encode()).hexdigest(),
        "delta": None if plan.delta is None else float(plan.delta),
        "accountant": cfg.accountant,
        # N, which the statement prints and delta's default rule uses: a record naming another is refused
        "num_users": int(run.data.num_users),
    }
    context.update(options.journal_context or {})
    ledger = PrivacyLedger(
        plan.step_event,
        plan.delta,
        target_epsilon=cfg.target_epsilon,
        accountant=cfg.accountant,
        safe_steps=plan.safe_steps,
        bands=plan.cycle,
    )
    if run.dir and run.combiner.rank == 0:
        ledger.attach_journal(run.dir, context)
    for event in cfg.prior_events:
        ledger.spend_event(event)
    return ledger


def build_optimizer(run, optimizer: torch.optim.Optimizer | None) -> torch.optim.Optimizer:
    """The config's optimizer over the masters, or the caller's own (make_private), checked: it
    steps the trainable parameters."""
    run.external_optimizer = optimizer is not None
    if optimizer is None:
        return run.cfg.optimizer.build(run.master)
    return own_optimizer(optimizer, run.params, run.master)
