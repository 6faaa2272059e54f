"""Phase 3 of ``userdp train``: the plan. The LM config's training and privacy sections become
the engine's frozen :class:`~userdp.engine.plan.TrainConfig`, and with the data's counts one
:class:`~userdp.engine.plan.RunPlan` (:func:`resolve`: :func:`mechanism_plan`'s, made once per
privacy settings and counts, with the run's :class:`~userdp.engine.performance.Performance`): the
budget check asks it, and the engine trains by it. The algorithm is the registered class the
config names (:func:`algorithm_of`); nothing here compares its name."""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass

import torch

from userdp import accounting
from userdp import engine as E
from userdp.devices import resolve_precision
from userdp.engine.algorithms import ALGORITHMS
from userdp.engine.memory import RunShape, auto_chunk_size
from userdp.engine.noise.mechanism import noise_buffers
from userdp.engine.plan import SAMPLER_MODE, RunPlan, make_plan
from userdp.engine.sampling import accounted_as
from userdp.errors import UserError
from userdp.fileio import write_json
from userdp.lm import config as C
from userdp.lm.plan_file import median_events
from userdp.lm.prepare import Log, stderr_log
from userdp.lm.run_dir import RunDir


def algorithm_of(cfg: C.RunConfig) -> type:
    """The registered algorithm class ``training.algorithm`` names (engine.algorithms.ALGORITHMS)."""
    return ALGORITHMS.lookup(cfg.training.algorithm)


def check_cohort(cfg: C.RunConfig, num_units: int) -> None:
    """The expected cohort must fit the units (a larger one used to be capped at q = 1 silently)."""
    t = cfg.training
    unit = algorithm_of(cfg).units_label
    if t.cohort_size > num_units:
        raise UserError(
            f"training.cohort_size = {t.cohort_size:g} is more than the {num_units} {unit}; "
            f"give at most {num_units} (sampling rate 1)"
        )


def engine_config(cfg: C.RunConfig, num_units_hint: int, device: torch.device, prior: tuple = ()):
    """The engine's :class:`~userdp.engine.plan.TrainConfig` for ``cfg`` (``device``: where it runs, resolved
    once by the job, which decides the precision's dtype; ``prior``: the DpEvents released before
    training, e.g. a plan's DP median, which the ledger counts first)."""
    t, p = cfg.training, cfg.privacy
    check_cohort(cfg, num_units_hint)
    rate = t.cohort_size / max(1, num_units_hint)
    algo = algorithm_of(cfg).from_settings(t, rate)
    if t.optimizer == "sgd":
        opt = E.SGD(lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)
    elif t.optimizer == "adam":
        opt = E.Adam(lr=t.lr, weight_decay=t.weight_decay)
    else:
        opt = E.Adafactor(lr=t.lr, weight_decay=t.weight_decay)
    normalized = t.clipping == "normalized"
    if not algo.private:
        clip = E.FlatClip(1e12)
    elif t.clipping == "per_layer":
        clip = E.PerLayerClip(t.clip_norm)
    else:
        clip = E.FlatClip(t.clip_norm, normalized=normalized)

    precision = resolve_precision(t.precision, device)
    kw = dict(
        algorithm=algo,
        steps=t.steps,
        clipping=clip,
        optimizer=opt,
        delta=p.delta,
        accountant=p.accountant,
        sampling=p.sampler,
        noise=p.noise,
        bands=p.bands,
        seed=t.seed,
        performance=E.Performance(
            chunk_size=t.chunk_size or 8,  # auto: resolved before training (resolve_chunk_size)
            checkpoint_every=t.checkpoint_every,
            per_unit=t.per_unit,
            precision=precision,
            sharding=t.sharding,
        ),
    )
    if not algo.private:
        kw["noise_multiplier"] = 0.0
    elif p.noise_multiplier is not None:
        kw.update(noise_multiplier=p.noise_multiplier, target_epsilon=p.epsilon, prior_events=prior)
    else:
        kw.update(target_epsilon=p.epsilon, prior_events=prior)
    return E.TrainConfig(**kw)


def num_units(cfg: C.RunConfig, data) -> int:
    """The units the sampler draws from in ``data`` (users, or |D'| for a record-level unit)."""
    return algorithm_of(cfg).count_units(data.sizes(), cfg.training.group_size)


def with_performance(base: RunPlan, cfg: C.RunConfig, num_units: int, device, prior: tuple = ()) -> RunPlan:
    """``base`` (a :func:`mechanism_plan`) with ``cfg``'s performance settings: the chunk size
    (:func:`resolve` fixes it first), the per-unit strategy, the precision (on ``device``, see
    :func:`engine_config`), the distribution and the checkpoint cadence. The config it then holds
    differs from ``base``'s in its :class:`~userdp.engine.performance.Performance` alone (checked:
    the journal is bound to the rest)."""
    config = engine_config(cfg, num_units, device, prior)
    if config != base.config:  # equality leaves the Performance out
        raise AssertionError("a run plan's privacy settings differ from its mechanism plan's")
    return dataclasses.replace(base, config=config)


def mechanism_plan(cfg: C.RunConfig, num_users: int, num_units: int, prior: tuple = ()) -> RunPlan:
    """The plan of ``cfg``'s privacy settings on these counts, with its performance settings neutral
    (wherever it will run): what a budget check or a tuning's calibration needs, made once."""
    return _mechanism_plan(_performance_neutral(cfg), num_users, num_units, tuple(prior))


def _performance_neutral(cfg: C.RunConfig) -> C.RunConfig:
    """``cfg`` with its performance settings fixed (they change how a run computes, not its plan)."""
    t = dataclasses.replace(
        cfg.training,
        chunk_size=1,
        memory_gb=None,
        per_unit="auto",
        precision="float32",
        checkpoint_every=1,
        sharding="none",
    )
    return dataclasses.replace(cfg, training=t, model=dataclasses.replace(cfg.model, device="cpu"))


@functools.lru_cache(maxsize=8)
def _mechanism_plan(cfg: C.RunConfig, num_users: int, num_units: int, prior: tuple = ()) -> RunPlan:
    # a performance-neutral config (model.device cpu): its precision is float32 wherever the job runs
    config = engine_config(cfg, num_units, _NEUTRAL_DEVICE, prior)
    return make_plan(config, num_users=num_users, num_units=num_units)


_NEUTRAL_DEVICE = torch.device("cpu")


def check_budget(cfg: C.RunConfig, num_users: int, num_units: int, prior: tuple = ()) -> None:
    """Refuse up front a fixed sigma whose configured steps, after the ``prior`` events (a plan's DP
    median), pass the target epsilon: :func:`check_plan_budget` on :func:`mechanism_plan`'s plan.

    Raises:
        UserError: the configured steps would spend more than ``privacy.epsilon``.
    """
    check_plan_budget(cfg, mechanism_plan(cfg, num_users, num_units, prior), prior)


def check_plan_budget(cfg: C.RunConfig, plan: RunPlan, prior: tuple = ()) -> None:
    """Refuse a fixed sigma whose configured steps, after the ``prior`` events, pass the target
    epsilon. The figure comes from ``plan``, the run plan the engine will use (the same mechanism,
    sampler and delta), so it cannot disagree with the ledger.

    Raises:
        UserError: the configured steps would spend more than ``privacy.epsilon``.
    """
    p, t = cfg.privacy, cfg.training
    if not algorithm_of(cfg).private or p.noise_multiplier is None:
        return
    eps = accounting.epsilon(
        accounting.compose_after(prior, plan.step_event, plan.compositions(t.steps)), plan.delta, p.accountant
    )
    if eps > p.epsilon:
        before = " after the plan's DP median" if prior else ""
        raise UserError(
            f"privacy: with noise_multiplier {p.noise_multiplier} and sampling rate {plan.sampling_rate:.4g}, the "
            f"configured {t.steps} steps{before} spend epsilon = {eps:.3g} > the target {p.epsilon} at "
            f"delta = {plan.delta:.3g}; lower training.steps, raise privacy.noise_multiplier, or drop it "
            "to calibrate sigma to the target"
        )


@dataclass(frozen=True)
class JobPlan:
    """The job after planning, frozen: what the phases after it read (training, evaluation, the
    release). Made once by :func:`resolve` when the data's counts, the plan's choices and the
    chunk size are known; no later phase sees the whole configuration.

    ``engine`` is the engine's frozen :class:`~userdp.engine.plan.RunPlan` (``engine.config``, a
    :class:`~userdp.engine.plan.TrainConfig`, holds the privacy and the performance settings);
    ``training`` and ``privacy`` are the resolved sections the report describes; ``plan`` is the
    applied plan's record (``plan: auto`` or ``--plan``), or None."""

    engine: RunPlan
    training: C.TrainingConfig
    privacy: C.PrivacyConfig
    seq_len: int
    eval: C.EvalConfig
    output: C.OutputConfig
    lora: C.LoraConfig
    plan: dict | None = None

    @property
    def algorithm(self) -> type:
        """The registered algorithm class ``training.algorithm`` names."""
        return ALGORITHMS.lookup(self.training.algorithm)

    @property
    def sampler_assumed(self) -> str:
        """What the accountant assumed: Poisson for the default sampler; shuffled batches are
        accounted without amplification and fixed-size cohorts as sampling without replacement."""
        return SAMPLER_MODE[(accounted_as(self.privacy.sampler), self.algorithm.unit)]


def resolve(
    cfg: C.RunConfig, num_users: int, num_units: int, plan: dict | None = None, device=None, *, chunk_size: int
) -> JobPlan:
    """The job plan of a config with its plan applied, on data with these counts, run on ``device``
    with ``chunk_size`` units a call (:func:`resolve_chunk_size`'s choice): the one run plan made,
    its budget checked on that plan, and the sections the later phases read.

    Raises:
        UserError: the cohort does not fit the units, or a fixed sigma passes the budget."""
    cfg = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, chunk_size=int(chunk_size)))
    prior = median_events(plan, "the plan")  # spent before the first step: the ledger counts it first
    base = mechanism_plan(cfg, num_users, num_units, prior)  # the one plan: its budget, then its run
    check_plan_budget(cfg, base, prior)
    return JobPlan(
        engine=with_performance(base, cfg, num_units, device, prior),
        training=cfg.training,
        privacy=cfg.privacy,
        seq_len=cfg.tokenizer.seq_len,
        eval=cfg.eval,
        output=cfg.output,
        lora=cfg.model.lora,
        plan=plan,
    )


def resolve_chunk_size(cfg: C.RunConfig, model, device, rd: RunDir, log: Log = stderr_log, world_size: int = 1):
    """``training.chunk_size: auto`` -> the largest power-of-two chunk that fits the memory cap
    (:func:`userdp.engine.memory.auto_chunk_size`; per rank, with ``training.sharding: fsdp`` over
    ``world_size`` processes), saved in the run directory so that a resume uses the same one.
    Returns ``(chunk_size, choice)``: the value :func:`resolve` takes, and the record of an ``auto``
    choice for the report (None when the config fixed it).

    Raises:
        UserError: one unit does not fit the cap.
    """
    t = cfg.training
    if t.chunk_size is not None:
        return int(t.chunk_size), None

    saved = rd.root / "chunk_size.json"
    if saved.is_file():
        info = json.loads(saved.read_text())
    else:
        algo = algorithm_of(cfg).from_settings(t, 1.0)
        strategy = "vmap" if algo.update != "gradient" or t.per_unit == "vmap" else "ghost"
        records = algo.records_per_unit
        states = {"adam": 2, "adafactor": 1}.get(t.optimizer, 1 if t.momentum else 0)
        low = resolve_precision(t.precision, device) != "float32"
        shape = RunShape(
            records,
            cfg.tokenizer.seq_len,
            strategy=strategy,
            low_precision=low,
            optimizer_states=states,
            shards=world_size if t.sharding == "fsdp" else 1,
            noise_buffers=noise_buffers(cfg.privacy.noise, cfg.privacy.bands),
        )
        chunk, info = auto_chunk_size(
            model, shape, device=device, memory_cap_bytes=int(t.memory_gb * 2**30) if t.memory_gb else None
        )
        info["chunk_size"] = chunk
        write_json(saved, info)
    per = info.get("unit_bytes")
    log(
        f"chunk size: auto -> {info['chunk_size']} units per call (cap {info['memory_cap_bytes'] / 2**30:.1f} GiB, "
        f"{info['cap_source']}; about {(per or 0) / 2**20:.0f} MiB per unit)"
    )
    return int(info["chunk_size"]), info
