"""One training run's state and its step (:class:`EngineRun`): the cohort, the per-unit clipped sums
over chunks, the distribution's release of the noisy sum, the optimizer; what the loop
(:mod:`userdp.engine.loop`) drives a step at a time. Its checkpoint is :mod:`userdp.engine.run_state`."""

from __future__ import annotations

import hashlib
import math
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from torch import nn

from userdp.engine import run_state
from userdp.engine.algorithms import UnitTable
from userdp.engine.clipping import StepClipping
from userdp.engine.distributed import LocalCombiner
from userdp.engine.distribution import DISTRIBUTIONS
from userdp.engine.ledger import PrivacyLedger
from userdp.engine.model_lint import buffer_versions, check_release, mixing_modules
from userdp.engine.optimizers import own_optimizer
from userdp.engine.per_unit import make_per_unit
from userdp.engine.plan import RunPlan, TrainConfig, make_plan, privacy_repr
from userdp.engine.plugin_outputs import call as plugin_call
from userdp.engine.plugin_outputs import check_finite_scalar, checked_cohort
from userdp.engine.precision import EXACT_FLOAT32, Precision
from userdp.engine.privacy_record import PrivacyRecord
from userdp.engine.run_options import RunOptions, run_options
from userdp.engine.run_record import run_record
from userdp.engine.run_state import BOUNDING, COHORT, POOL, UNIT_DRAWS, seeds
from userdp.engine.sampling import bucket_size
from userdp.engine.user_data import UserData, compact_groups
from userdp.errors import UserError


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without a blocking copy: pinned and non-blocking on CUDA (a
    pageable copy waits for the device), as is elsewhere."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device, non_blocking=device.type != "cpu")


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Norms, clipped sums, the denominator and the noise: float32, or float64 for a float64 model."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_plan_fits(plan: RunPlan, num_users: int, num_units: int, total_weight: float | None) -> None:
    """A plan made elsewhere (``make_plan``) must count the data it trains on: its mechanism, delta
    and denominator were derived from those counts.

    Raises:
        UserError: the plan's counts differ from the data's."""
    expected_weight = plan.expected_units * (total_weight if total_weight is not None else num_units) / num_units
    if (plan.num_users, plan.num_units) != (int(num_users), int(num_units)) or not math.isclose(
        plan.expected_weight, expected_weight, rel_tol=1e-12
    ):
        raise UserError(
            f"the run plan was made for {plan.num_users} users and {plan.num_units} units; this data "
            f"has {num_users} users and {num_units} units (make the plan from this data: make_plan)"
        )


def _optimizer(cfg: TrainConfig, optimizer, params: list, master: list) -> torch.optim.Optimizer:
    """The config's optimizer over the masters, or the caller's own (make_private), checked."""
    return cfg.optimizer.build(master) if optimizer is None else own_optimizer(optimizer, params, master)


class EngineRun:
    """State of one training run (kept small: everything here is saved in a checkpoint)."""

    def __init__(
        self,
        model,
        data,
        loss_fn,
        config: TrainConfig | RunPlan,
        options: RunOptions | None = None,
        optimizer: torch.optim.Optimizer | None = None,
    ):
        options = run_options(options)
        if not isinstance(data, UserData):
            raise UserError(f"data must be a userdp.engine.UserData, got {type(data).__name__}")
        given_plan = config if isinstance(config, RunPlan) else None
        cfg = given_plan.config if given_plan is not None else config
        self.model, self.data, self.cfg = model, data, cfg
        self.algo = cfg.algorithm
        # a user's masked mean gradient does not see its padding slots: trim them (engine.user_data.compact_groups)
        self._compact = self.algo.unit == "user" and self.algo.update == "gradient" and self.algo.records_per_unit > 1
        self.combiner = options.combiner or LocalCombiner()
        precision = Precision(cfg.precision)
        # the distribution part: how the model is held, the sums accumulate and the noise is released
        self.distribution = DISTRIBUTIONS.lookup(cfg.sharding)()
        self.distribution.prepare(cfg, model, self.combiner)
        self.per_unit = make_per_unit(
            self.distribution.per_unit(cfg.per_unit), model, loss_fn, self.algo, precision, self.distribution.coverage
        )
        self._mixing = mixing_modules(model)  # checked again at every release
        self.params = self.per_unit.params
        self.device = self.params[0].device
        precision.check_device(self.device)
        # Low-precision models train on float32 master weights: the released update (noised sum
        # / denominator) is float32, the optimizer steps the masters, the model gets a rounded copy
        # (post-processing). Norms, sums and noise are float32 whatever the model's dtype.
        if any(p.dtype in (torch.float16, torch.bfloat16) for p in self.params):
            self.master = [nn.Parameter(p.detach().float().clone()) for p in self.params]
        else:
            self.master = self.params
        self.distribution.check_params(self.params)
        self._padding = None  # a sharded rank's zero-weight chunk (clipped_sum)
        self.precision = {
            "autocast": cfg.precision,
            "model": sorted({str(p.dtype).replace("torch.", "") for p in self.params}),
            "master_weights": "float32" if self.master is not self.params else "the model's own",
            "norms_sums_noise": sorted({str(_accumulation_dtype(p.dtype)).replace("torch.", "") for p in self.params}),
            "float32_contractions": EXACT_FLOAT32,
        }
        self.dir = options.checkpoint_dir
        self.seeded = cfg.seed is not None
        # generators: the cohort and the data key (identical on every rank), the noise (main rank)
        self._data_key, source, torch_seed = seeds(cfg.seed, self.combiner, self.device)
        if self.seeded:
            torch.manual_seed(torch_seed)  # dropout etc. inside the model
        # D' (ELS's records kept per user) from its own generator, never from the cohort's: a user
        # with more than G records consumes draws, so sharing the cohort's stream would let one
        # added user move every later cohort (its membership must be its own draws alone)
        self.table: UnitTable = self.algo.units(data, self._bounding_rng())
        # the frozen plan: mechanism, noise, denominator, delta (calibrated if a target is given)
        total_weight = float(self.table.weights.sum()) if self.table.weights is not None else None
        if given_plan is None:
            self.plan: RunPlan = make_plan(
                cfg, num_users=data.num_users, num_units=len(self.table), total_weight=total_weight
            )
        else:  # the caller's plan (already calibrated): it must be the plan of this data
            _check_plan_fits(given_plan, data.num_users, len(self.table), total_weight)
            self.plan = given_plan
        # the plan's parts: the sampler, and the noise mechanism over this run's keyed source
        self.sampler = self.plan.sampler
        self.sampler_state: dict = self._fresh_sampler_state()
        self.noise = self.plan.make_noise(source)
        self.noise.init(self.master)
        self.distribution.check_noise(self.noise)
        # what the noise is added to each step: the sums, one per trainable parameter, in float32+
        self._sum_numel = sum(p.numel() for p in self.params)
        self._sum_dtypes = sorted({_accumulation_dtype(p.dtype) for p in self.params}, key=str)
        # the device noise kernel, built (compiled, checked) now, not in step 1; its status recorded (no silent eager)
        prepare = getattr(source, "prepare", None)
        self.noise_kernel = (
            prepare(self.device)
            if prepare is not None
            else ("host generator" if source is not None else "none on this rank")
        )
        # the journal is bound to everything its epsilon depends on: the config, delta (a default
        # delta is computed from N) and the accountant, so a privacy record that names others is caught
        # (performance settings — chunk size, per-unit strategy, precision, checkpoint cadence — may change)
        context = {
            "engine_privacy_config_sha256": hashlib.sha256(privacy_repr(cfg).encode()).hexdigest(),
            "delta": None if self.plan.delta is None else float(self.plan.delta),
            "accountant": cfg.accountant,
            # N, which the statement prints and delta's default rule uses: a record naming another is refused
            "num_users": int(data.num_users),
        }
        context.update(options.journal_context or {})
        self.ledger = PrivacyLedger(
            self.plan.step_event,
            self.plan.delta,
            target_epsilon=cfg.target_epsilon,
            accountant=cfg.accountant,
            safe_steps=self.plan.safe_steps,
            bands=self.plan.cycle,
        )
        if self.dir and self.combiner.rank == 0:  # one writer: the main rank keeps the journal (every rank counts)
            self.ledger.attach_journal(self.dir, context)
        for event in cfg.prior_events:  # released before the first step: counted first, against the budget
            self.ledger.spend_event(event)  # (a resumed run's checkpoint restores the same, with its steps)
        self.clip_state = self.plan.clipping.initial_state()
        # the config's optimizer, or the caller's own (make_private): it steps the trainable parameters
        self.external_optimizer = optimizer is not None
        self.optimizer = _optimizer(cfg, optimizer, self.params, self.master)
        self.step = 0
        self.nonfinite_units = 0  # units whose update was Inf/NaN (zeroed); NOT a private statistic
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="userdp-load")
        self.history: list[dict] = []

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
    def _pad(self, batch, mask, b):
        k = mask.shape[0]
        if b == k:
            return batch, mask
        idx = torch.cat([torch.arange(k), torch.zeros(b - k, dtype=torch.long)])
        batch = {n: v[idx] for n, v in batch.items()}
        mask = torch.cat([mask, torch.zeros(b - k, *mask.shape[1:], dtype=mask.dtype)])
        return batch, mask

    def _bounding_rng(self) -> np.random.Generator:
        """The generator of the run's one-time contribution bounding (ELS's D'): keyed by the data
        key alone and used for nothing else, so the cohort draws are the same whether or not a user
        with more than G records is present (the neighbour test at a sampling rate below 1)."""
        return np.random.default_rng(np.random.SeedSequence(self._data_key, spawn_key=(BOUNDING,), pool_size=POOL))

    def _cohort_rng(self, step: int) -> np.random.Generator:
        """The generator of step ``step``'s cohort: keyed by the data key and the step alone, so unit
        i's draw at a step is the i-th of that step's stream whatever the number of units (a user
        appended last moves no other unit's membership at any step: a sequential stream shifted every
        later step's draws by one), and a resume continues the same cohorts with no state saved."""
        return np.random.default_rng(
            np.random.SeedSequence(self._data_key, spawn_key=(COHORT, int(step)), pool_size=POOL)
        )

    def _unit_rng(self, step: int, unit: int) -> np.random.Generator:
        """The generator of unit ``unit``'s record draw at ``step``: keyed by the run's data key,
        the step and the unit alone, so a unit draws the same records whichever rank loads it
        and however the cohort is chunked (W processes give one process's model; a resume with
        another world size continues the same run)."""
        return np.random.default_rng(
            np.random.SeedSequence(self._data_key, spawn_key=(UNIT_DRAWS, step, int(unit)), pool_size=POOL)
        )

    def _load(self, cid: np.ndarray, step: int):
        """One chunk's batch and mask, padded to its bucket size, on the device."""
        if self.algo.random_load:  # one draw per unit, from the unit's own generator
            parts = [
                self.algo.load(self.data, self.table, cid[i : i + 1], self._unit_rng(step, u))
                for i, u in enumerate(cid)
            ]
            batch = self.data.concat([b for b, _ in parts])
            mask = torch.cat([m for _, m in parts])
        else:
            batch, mask = self.algo.load(self.data, self.table, cid, None)
        if self._compact:
            batch, mask = compact_groups(batch, mask)
        batch, mask = self._pad(batch, mask, bucket_size(len(cid), self.cfg.chunk_size))
        batch = {n: _to_device(v, self.device) for n, v in batch.items()}
        return batch, _to_device(mask.to(self.params[0].dtype), self.device)

    def _prefetch(self, chunks):
        """The chunks' batches in order, the next one loaded by a worker thread while this one
        computes (each unit's records come from its own generator, so the order is moot)."""
        if not chunks:
            return
        pending = self._loader.submit(self._load, chunks[0], self.step)
        for i in range(len(chunks)):
            ready = pending.result()
            if i + 1 < len(chunks):
                pending = self._loader.submit(self._load, chunks[i + 1], self.step)
            yield ready

    def _padding_chunk(self, template):
        """A chunk of one unit whose mask and weight are zero (its update is exactly zero, it counts
        for nothing): a sharded rank with fewer units than another runs these, so that every rank
        runs FSDP's gathers as often. Its records are a real unit's (a finite forward), masked out."""
        if self._padding is None:
            batch, mask = template if template is not None else self._load(np.zeros(1, dtype=np.int64), 0)
            self._padding = ({n: v[:1].clone() for n, v in batch.items()}, torch.zeros_like(mask[:1]))
        return self._padding

    def clipped_sum(self, ids: np.ndarray, n_chunks: int | None = None, lazy: bool = False):
        """Per-unit updates of ``ids``, clipped and summed; plus statistics. No noise. ``n_chunks``:
        run at least that many chunks, the extra ones of zero weight (a sharded step). ``lazy``: the
        strategy may leave bad units' rows unzeroed on a device
        (:attr:`~userdp.engine.clipping.StepClipping.lazy_zeroing`); the caller then reads the last
        statistic (bad units, padding included) and computes the sums again where it is not 0."""
        cfg, algo = self.cfg, self.algo
        acc = _accumulation_dtype(self.params[0].dtype)
        sums = self.distribution.accumulator(self.params, _accumulation_dtype, acc)
        # units, centered count, loss, clipped, weight, non-finite units; bad units with padding (release's redo)
        stats = torch.zeros(7, dtype=torch.float64, device=self.device)  # read once a step, in run_step
        c_now = float(self.clip_state["clip_norm"])
        reproject = (
            self.plan.clipping.reproject_bounds(self.clip_state, len(self.params))
            if getattr(algo, "reproject", False)
            else None
        )
        clip = StepClipping(self.plan.clipping, self.clip_state, acc, reproject, lazy_zeroing=lazy)
        if self._compact:  # users of like record counts share a chunk, so little padding is left to compute
            ids = ids[np.argsort(np.minimum(self.data.sizes()[self.table.users[ids]], algo.group_size), kind="stable")]
        chunks = [ids[s : s + cfg.chunk_size] for s in range(0, len(ids), cfg.chunk_size)]
        loaded = self._prefetch(chunks)
        sink = {"sink": sums.sink} if sums.sink is not None else {}
        if n_chunks is not None and n_chunks > len(chunks):
            loaded = self._padded(loaded, n_chunks - len(chunks))
            chunks = chunks + [ids[:0]] * (n_chunks - len(chunks))
        for cid, (batch, mask) in zip(chunks, loaded, strict=True):
            k = len(cid)
            b = mask.shape[0]
            valid = torch.zeros(b, dtype=acc, device=self.device)
            valid[:k] = 1.0
            w = valid.clone()
            if self.table.weights is not None:
                w[:k] *= _to_device(torch.as_tensor(self.table.weights[cid], dtype=w.dtype), self.device)
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

    def _padded(self, loaded, extra: int):
        """The loaded chunks, then ``extra`` zero-weight padding chunks (:meth:`_padding_chunk`)."""
        last = None
        for item in loaded:
            last = item
            yield item
        for _ in range(extra):
            yield self._padding_chunk(last)

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
        check_release(self.model, self._mixing, None)  # a caller's loop may have called model.train()
        self.ledger.record_step()  # before anything of this step can be seen (on every rank: before its all-reduce)
        main = comb.rank == 0
        if main and plan.update_noise_multiplier > 0 and hasattr(self.noise, "begin_step") and dist.draws_ahead():
            # the noise depends on nothing of the step's data: a host source may draw it while the sums are computed
            self.noise.begin_step(self._sum_numel, self._sum_dtypes)
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
                self._cohort_rng(self.step),
                self.sampler_state,
            ),
            self.n_units,
            self.sampler,
        )
        mine = ids[comb.rank :: comb.world_size]
        n_chunks = dist.chunks(len(ids), comb.world_size, cfg.chunk_size)  # (a floor: FSDP's gathers pair up)
        # on a device the strategy may skip zeroing bad units' rows (a pass over every factor), and the
        # step's one sync says whether any unit was bad: then the sums may hold NaN, and are computed
        # again, zeroing, before anything of them is used
        lazy = dist.lazy_zeroing(self.device)
        sums, stats = self.clipped_sum(mine, n_chunks, lazy=lazy)
        check_release(self.model, (), versions)  # no buffer moved: nothing un-noised leaves in a checkpoint
        stats = _host(stats)  # the step's one host sync: a few float64 statistics
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
        if cfg.track_epsilon:
            metrics["epsilon_spent"] = self.ledger.epsilon_upper_bound()
        if self.ledger.journal is not None:  # a record of this step that binds the journal's length
            metrics["journal"] = self.ledger.journal.cite()
        return metrics

    # ------------------------------------------------------------------ checkpoints (engine/run_state.py)
    def state(self) -> tuple[dict, dict]:
        """(the checkpoint's state, a sharded run's shards): :func:`userdp.engine.run_state.checkpoint_state`."""
        return run_state.checkpoint_state(self)

    def save(self, extra=None):
        """Write the checkpoint (:func:`userdp.engine.run_state.save`)."""
        run_state.save(self, extra)

    def restore(self, st: dict):
        """Restore a checkpoint's state (:func:`userdp.engine.run_state.restore`)."""
        run_state.restore(self, st)

    def rekey(self, begun: int) -> None:
        """Key a resumed seeded run anew (:func:`userdp.engine.run_state.rekey`)."""
        run_state.rekey(self, begun)

    def _fresh_sampler_state(self) -> dict:
        """The sampler's state at the start of a run (a cyclic sampler's groups: a keyed hash of each
        unit's user id, from the data, never saved)."""
        initial = getattr(self.sampler, "initial_state", None)
        if initial is None:
            return {}
        keys = self.data.user_keys()
        return initial([keys[int(u)] for u in self.table.users], self.plan.cycle)

    rekeyed_at: int | None = None
    restored_spent: int = 0

    # ------------------------------------------------------------------ the record
    def record(self) -> PrivacyRecord:
        """The run's privacy record as of now (:class:`~userdp.engine.privacy_record.PrivacyRecord`)."""
        return run_record(self)


def _host(stats: torch.Tensor) -> torch.Tensor:
    """The step's statistics on the host. A model on the meta device (shapes without values) has
    none to give: one line, not torch's "cannot copy out of meta tensor" (the tests that count a
    step's syncs on meta answer this read themselves).

    Raises:
        UserError: the parameters are on the meta device."""
    try:
        return stats.cpu()
    except NotImplementedError:
        if stats.is_meta:
            raise UserError(
                "model: its parameters are on the meta device (shapes without values): load its weights first "
                "(e.g. from_pretrained without device_map='meta', or to_empty() and load_state_dict)"
            ) from None
        raise
