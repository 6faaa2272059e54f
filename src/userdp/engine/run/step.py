"""One training run's state and its step (:class:`EngineRun`): the cohort, the per-unit clipped sums
over chunks, the distribution's release of the noisy sum, the optimizer; what the loop
(:mod:`userdp.engine.run.loop`) drives a step at a time. The parts are built once, before the first
step (:mod:`userdp.engine.run.build`); the step composes them and branches on none of them. Its
checkpoint is :mod:`userdp.engine.run.state`."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from userdp.engine.clipping import StepClipping
from userdp.engine.model_lint import buffer_versions, check_release
from userdp.engine.plugin_outputs import call as plugin_call
from userdp.engine.plugin_outputs import check_finite_scalar, checked_cohort
from userdp.engine.run import state as run_state
from userdp.engine.run.build import accumulation_dtype, build_optimizer, build_run
from userdp.engine.run.cohort import Chunks, to_device, to_host
from userdp.engine.run.options import RunOptions, run_options
from userdp.engine.run.record import PrivacyRecord, run_record


class EngineRun:
    """State of one training run (kept small: everything here is saved in a checkpoint)."""

    # what :func:`~userdp.engine.run.build.build_run` gives a run, once, before its first step
    model: Any
    data: Any
    cfg: Any  # its TrainConfig
    algo: Any  # its algorithm (ELS, ULS, FedAvg, ...)
    plan: Any  # its RunPlan
    combiner: Any
    distribution: Any
    per_unit: Any
    chunks: Chunks  # the cohort's generators and the chunks' loading
    sampler: Any
    noise: Any  # its noise mechanism (a transform: init / update)
    noise_state: Any  # the mechanism's state across steps (checkpointed for a seeded run, never released)
    ledger: Any
    optimizer: torch.optim.Optimizer

    def __init__(
        self,
        model,
        data,
        loss_fn,
        config,
        options: RunOptions | None = None,
        optimizer: torch.optim.Optimizer | None = None,
    ):
        """``config``: a :class:`~userdp.engine.plan.TrainConfig`, or a :class:`~userdp.engine.plan.RunPlan`
        made for this data (:func:`~userdp.engine.plan.make_plan`)."""
        build_run(self, model, data, loss_fn, config, run_options(options))
        self.optimizer = build_optimizer(self, optimizer)

    # ------------------------------------------------------------------ what the plan says
    n_units = property(lambda self: self.plan.num_units)
    rate = property(lambda self: self.plan.sampling_rate)
    expected_units = property(lambda self: self.plan.expected_units)
    expected_weight = property(lambda self: self.plan.expected_weight)
    delta = property(lambda self: self.plan.delta)
    noise_multiplier = property(lambda self: self.plan.noise_multiplier)
    update_z = property(lambda self: self.plan.update_noise_multiplier)

    def _sensitivity(self) -> float:
        return self.plan.sensitivity(self.clip_state, len(self.params))

    # ------------------------------------------------------------------ one step
    def clipped_sum(self, ids: np.ndarray, n_chunks: int | None = None, lazy: bool = False):
        """Per-unit updates of ``ids``, clipped and summed; plus statistics. No noise. ``n_chunks``:
        run at least that many chunks, the extra ones of zero weight (the distribution's floor).
        ``lazy``: the strategy may leave bad units' rows unzeroed on a device
        (:attr:`~userdp.engine.clipping.StepClipping.lazy_zeroing`); the caller then reads the last
        statistic (bad units, padding included) and computes the sums again where it is not 0."""
        algo = self.algo
        acc = accumulation_dtype(self.params[0].dtype)
        sums = self.distribution.accumulator(self.params, accumulation_dtype, acc)
        # units, centered count, loss, clipped, weight, non-finite units; bad units with padding (release's redo)
        stats = torch.zeros(7, dtype=torch.float64, device=self.device)  # read once a step, in run_step
        c_now = float(self.clip_state["clip_norm"])
        reproject = (
            self.plan.clipping.reproject_bounds(self.clip_state, len(self.params))
            if getattr(algo, "reproject", False)
            else None
        )
        clip = StepClipping(self.plan.clipping, self.clip_state, acc, reproject, lazy_zeroing=lazy)
        chunks = self.chunks.split(ids)
        extra = max(0, (n_chunks or 0) - len(chunks))
        loaded = self.chunks.loaded(chunks, self.step, extra)
        chunks = chunks + [ids[:0]] * extra
        sink = {"sink": sums.sink} if sums.sink is not None else {}
        for cid, (batch, mask) in zip(chunks, loaded, strict=True):
            k = len(cid)
            b = mask.shape[0]
            valid = torch.zeros(b, dtype=acc, device=self.device)
            valid[:k] = 1.0
            w = valid.clone()
            if self.table.weights is not None:
                w[:k] *= to_device(torch.as_tensor(self.table.weights[cid], dtype=w.dtype), self.device)
            part, norms, losses, bad = self.per_unit.clipped_sum(batch, mask, w, clip, **sink)
            sums.add(part)
            unclipped = (norms <= c_now).to(acc)
            losses = torch.where(torch.isfinite(losses), losses.detach(), 0.0).to(acc)
            stats += torch.stack(
                [
                    valid.sum(),
                    ((unclipped - 0.5) * valid).sum(),
                    (losses * valid).sum(),
                    ((1 - unclipped) * valid).sum(),
                    w.sum(),
                    (bad.to(acc) * valid).sum(),
                    bad.to(acc).sum(),
                ]
            ).double()
        return sums.result(self.device), stats

    def run_step(self, stop_requested: bool = False):
        """One step. ``stop_requested``: this rank wants the run to stop after this step (Ctrl-C);
        the request is combined with the statistics, so every rank stops after the same step
        (``metrics["stop"]``)."""
        t0 = time.perf_counter()
        metrics, noisy_centered = self.release(stop_requested)
        self.optimizer.step()
        if self.master is not self.params:
            with torch.no_grad():
                for p, m in zip(self.params, self.master, strict=True):
                    p.copy_(m)
        return self.end_step(metrics, noisy_centered, t0)

    def release(self, stop_requested: bool = False) -> tuple[dict, float]:
        """The step's release: the ledger counts the step first, then a cohort is sampled, its
        units' updates clipped and summed, the noise added once to the sum, and the sum divided by
        the public denominator becomes ``.grad`` of the parameters the optimizer steps (replacing
        whatever was there). Returns the step's metrics so far and the count query's noisy value."""
        cfg, plan, comb, dist = self.cfg, self.plan, self.combiner, self.distribution
        check_release(self.model, self.mixing, None)  # a caller's loop may have called model.train()
        self.ledger.record_step()  # before anything of this step can be seen (on every rank: before its all-reduce)
        main = comb.rank == 0
        if main and plan.update_noise_multiplier > 0 and dist.draws_ahead():
            # the noise depends on nothing of the step's data: a host source may draw it while the sums are computed
            self.noise.begin_step(self.sum_numel, self.sum_dtypes)
        versions = buffer_versions(self.model)
        self.optimizer.zero_grad(set_to_none=True)  # last step's update: free it before this step's sums
        # what a sampler returns is checked where it enters (distinct integer ids in range; a plugin's
        # exception is one line naming it): a unit named twice would count twice in the sum
        ids = checked_cohort(
            plugin_call(
                "sampler",
                self.sampler,
                self.sampler.sample,
                self.n_units,
                self.rate,
                self.step,
                self.chunks.cohort_rng(self.step),
                self.sampler_state,
            ),
            self.n_units,
            self.sampler,
        )
        mine = ids[comb.rank :: comb.world_size]
        n_chunks = dist.chunks(len(ids), comb.world_size, cfg.performance.chunk_size)  # a floor (the distribution's)
        # on a device the strategy may skip zeroing bad units' rows (a pass over every factor), and the
        # step's one sync says whether any unit was bad: then the sums may hold NaN, and are computed
        # again, zeroing, before anything of them is used
        lazy = dist.lazy_zeroing(self.device)
        sums, stats = self.clipped_sum(mine, n_chunks, lazy=lazy)
        check_release(self.model, (), versions)  # no buffer moved: nothing un-noised leaves in a checkpoint
        stats = to_host(stats)  # the step's one host sync: a few float64 statistics
        if lazy and stats[6] > 0:
            sums = stats = None  # unreleased, and never will be: the step's sums are these
            sums, stats = self.clipped_sum(mine, n_chunks)
            check_release(self.model, (), versions)
            stats = stats.cpu()
        stats = stats[:6]
        # ---- 1. the statistics (float64, a few numbers): the main rank adds the count query's noise
        if main and plan.count_stddev:
            stats[1] += check_finite_scalar(
                plugin_call("noise mechanism", self.noise, self.noise.scalar, plan.count_stddev), self.noise
            )
        stats = torch.cat([stats, torch.tensor([float(stop_requested)], dtype=torch.float64)])
        stats = comb.all_reduce_sum([stats])[0].double().cpu()
        n_units, noisy_centered, loss_sum, n_clipped, weight, n_bad, stops = stats.tolist()
        self.nonfinite_units += int(n_bad)
        # ---- 2. noise on the sum, drawn once per step for the whole sum (on the main rank, added to
        # its partial sum before the all-reduce), float32 or wider; then the clipped sums, in their dtype
        std_sum = plan.update_noise_multiplier * self._sensitivity()
        den, est_std = cfg.denominator.scales(plan.expected_weight, weight, std_sum)
        self.last_denominator = den  # what .grad was divided by (the neighbour test multiplies it back)
        sums = dist.release(self, sums, est_std * den)
        # ---- divide by the public constant (in float32+), hand to the optimizer (grads were freed at the start)
        for m, x in zip(self.master, sums, strict=True):  # in place: the sums are this step's own buffers
            m.grad = x.div_(den).to(m.dtype)
        metrics = {
            "step": self.step + 1,
            "loss": loss_sum / max(n_units, 1.0),
            "units": int(n_units),
            "stop": stops > 0,
            "nonfinite_units": int(n_bad),
            "fraction_clipped": n_clipped / max(n_units, 1.0),
            "clip_norm": float(self.clip_state["clip_norm"]),
        }
        return metrics, noisy_centered

    def end_step(self, metrics: dict, noisy_centered: float, t0: float) -> dict:
        """After the optimizer's step: the step counts as applied, the adaptive clip norm moves,
        and the metrics get the step's time and the epsilon spent."""
        cfg, plan = self.cfg, self.plan
        self.step += 1
        if self.plan.clipping.adaptive:
            noisy = 0.5 + noisy_centered / plan.expected_units
            metrics["noisy_fraction_unclipped"] = noisy
            self.clip_state = self.plan.clipping.update(self.clip_state, noisy)
        dt = time.perf_counter() - t0
        metrics["step_time"] = dt
        metrics["units_per_s"] = metrics["units"] / dt if dt > 0 else float("nan")
        if cfg.performance.track_epsilon:
            metrics["epsilon_spent"] = self.ledger.epsilon_upper_bound()
        if self.ledger.journal is not None:  # a record of this step that binds the journal's length
            metrics["journal"] = self.ledger.journal.cite()
        return metrics

    # ------------------------------------------------------------------ checkpoints (engine/run/state.py)
    def state(self) -> tuple[dict, dict]:
        """(the checkpoint's state, the parts each rank writes): :func:`userdp.engine.run.state.checkpoint_state`."""
        return run_state.checkpoint_state(self)

    def save(self, extra=None):
        """Write the checkpoint (:func:`userdp.engine.run.state.save`)."""
        run_state.save(self, extra)

    def restore(self, st: dict):
        """Restore a checkpoint's state (:func:`userdp.engine.run.state.restore`)."""
        run_state.restore(self, st)

    def rekey(self, begun: int) -> None:
        """Key a resumed seeded run anew (:func:`userdp.engine.run.state.rekey`)."""
        run_state.rekey(self, begun)

    rekeyed_at: int | None = None
    restored_spent: int = 0

    # ------------------------------------------------------------------ the record
    def record(self) -> PrivacyRecord:
        """The run's privacy record as of now (:class:`~userdp.engine.privacy_record.PrivacyRecord`)."""
        return run_record(self)
