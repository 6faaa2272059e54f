"""User-level DP in the caller's own training loop: :func:`make_private`.

Opacus users keep their loop and call ``make_private(model, optimizer, data_loader)``. The
user-level equivalent cannot hand back a data loader: what a step releases is the noisy sum of
per-*user* clipped updates, and a user's update needs the user's records together (ELS clips per
record, ULS averages up to G of a user's records, FedAvg runs local SGD). So the loop gets one
object per step, and that object's :meth:`PrivateStep.backward` does what ``loss.backward()``
does in a non-private loop — it leaves the privatized gradient in ``p.grad`` — while the caller
keeps the optimizer, the learning-rate schedule, logging and evaluation::

    private = make_private(model, optimizer, data, loss_fn, config)
    for step in private:              # config.steps steps (fewer if the budget runs out)
        optimizer.zero_grad()
        metrics = step.backward()     # ledger first; Poisson cohort; clipped sum + noise -> p.grad
        optimizer.step()
        scheduler.step()              # anything that reads only the privatized gradient
    print(private.epsilon(), private.record())

Each step is exactly a step of :func:`userdp.engine.train` (the same sampler, per-unit strategy,
noise, denominator and ledger, in the same order): with a seed and an optimizer equal to the
config's, the two give the same model (tests/engine/test_private_loop.py). What the caller's loop
may not do is touch the private data itself: a ``loss.backward()`` on private records, or a
metric computed on them, is outside the guarantee (docs/engine.md, "Your own loop").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import torch
from torch import nn

from userdp import accounting
from userdp.engine.privacy_record import PrivacyRecord
from userdp.engine.run.loop import RunPlan, TrainConfig, start_run
from userdp.engine.run.options import RunOptions, run_options
from userdp.engine.run.step import EngineRun
from userdp.engine.user_data import UserData
from userdp.errors import UserError
from userdp.validation import check_instance


class PrivateStep:
    """One step of a :class:`PrivateTraining`; :meth:`backward` releases it, once."""

    def __init__(self, owner: PrivateTraining, index: int):
        self._owner = owner
        self.index = index  # 1-based step number
        self.metrics: dict | None = None

    def backward(self) -> dict:
        """Release this step: the ledger counts it (fsynced to the journal when there is one)
        before anything is computed, then a Poisson cohort of users is drawn, each unit's update
        clipped, the sum noised once and divided by the public denominator, and the result put in
        ``p.grad`` of every trainable parameter (replacing what was there). Returns the step's
        metrics (loss, units, fraction_clipped, clip_norm, epsilon_spent, ...: the loss and the
        fraction clipped are computed on private data and NOT privatized — for monitoring by the
        data holder only).

        Raises:
            UserError: called twice for one step, or after the loop moved on.
        """
        return self._owner._release(self)


class PrivateTraining:
    """What :func:`make_private` returns: iterate it for the steps, then ask it for epsilon and
    the privacy record. Also a context manager (closing frees the data loader's thread)."""

    def __init__(self, run: EngineRun):
        self._run = run
        self._current: PrivateStep | None = None
        self.stopped: str | None = None  # "completed" | "budget" once the iteration ends
        self.history: list[dict] = run.history

    # the run's facts, read from its frozen plan
    model = property(lambda self: self._run.model)
    optimizer = property(lambda self: self._run.optimizer)
    plan = property(lambda self: self._run.plan)
    steps = property(lambda self: self._run.cfg.steps)
    step = property(lambda self: self._run.step)
    noise_multiplier = property(lambda self: self._run.noise_multiplier)
    sampling_rate = property(lambda self: self._run.rate)
    delta = property(lambda self: self._run.delta)

    def __iter__(self) -> Iterator[PrivateStep]:
        """The steps, ``config.steps`` of them (fewer when the next would pass the target
        epsilon: :attr:`stopped` is then ``"budget"``). With a ``checkpoint_dir``, a checkpoint is
        written after every ``config.performance.checkpoint_every``-th step and at the end — after the loop's
        body, so after the caller's ``optimizer.step()``."""
        run = self._run
        every = run.cfg.performance.checkpoint_every if run.dir else 0
        try:
            while run.step < run.cfg.steps:
                if not run.ledger.allows(1):  # the next step would pass the target: stop before it
                    self.stopped = "budget"
                    break
                self._current = PrivateStep(self, run.step + 1)
                yield self._current
                if self._current.metrics is None:
                    raise UserError(
                        f"make_private: step {self._current.index} ended without step.backward(); "
                        "call it once in every step of the loop"
                    )
                if every and run.step % every == 0:
                    run.save()
            else:
                self.stopped = "completed"
            if run.dir:
                run.save()
        finally:
            self._current = None

    def _release(self, step: PrivateStep) -> dict:
        if step is not self._current:
            raise UserError("make_private: this step is over; call backward() on the step the loop yields")
        if step.metrics is not None:
            raise UserError(
                f"make_private: step {step.index} was already released (backward() twice); each call "
                "would be another release, counted by the ledger: call it once per step"
            )
        run = self._run
        t0 = time.perf_counter()
        metrics, noisy_centered = run.release()
        metrics.pop("stop")
        step.metrics = run.end_step(metrics, noisy_centered, t0)
        run.history.append(step.metrics)
        return step.metrics

    def epsilon(self, delta: float | None = None) -> float:
        """The epsilon spent so far at the run's delta, or at ``delta`` (an Opacus user's
        ``get_epsilon(delta)``); recomputed from the ledger's DpEvent. On a GPU the device noise
        sampler's bounded tail adds ``record()["noise_tail"]["delta"]`` (about 1e-14 at 1e8
        coordinates and 1e4 steps) to the delta, as the report states."""
        ledger = self._run.ledger
        if delta is None or not ledger.private:
            return ledger.epsilon()
        event = ledger.total_event()
        return 0.0 if event is None else accounting.epsilon(event, delta, self._run.cfg.accountant)

    def record(self) -> PrivacyRecord:
        """The privacy record, as :func:`userdp.engine.train` returns it (``stopped`` included)."""
        return self._run.record().replace(stopped=self.stopped or "in progress")

    def save(self) -> None:
        """Write a checkpoint now, between steps (after the caller's ``optimizer.step()``): for a
        loop that checkpoints on its own schedule, e.g. a Trainer's ``save_steps``.

        Raises:
            UserError: no ``checkpoint_dir`` was given, or a step is released but not finished."""
        if not self._run.dir:
            raise UserError("make_private: save() needs a checkpoint_dir")
        if self._current is not None and self._current.metrics is None:
            raise UserError(f"make_private: step {self._current.index} has not been released; save between steps")
        self._run.save()

    def close(self) -> None:
        self._run.chunks.close()

    def __enter__(self) -> PrivateTraining:
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False


def make_private(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: UserData,
    loss_fn: Callable,
    config: TrainConfig | RunPlan,
    options: RunOptions | None = None,
) -> PrivateTraining:
    """User-level DP for a training loop the caller writes (see the module docstring).

    Args:
        model: the model; its parameters with ``requires_grad`` are the ones trained (float32 or
            wider: mixed precision is ``config.performance.precision``).
        optimizer: the caller's ``torch.optim`` optimizer over exactly those parameters; it only
            ever sees the privatized gradient. ``config.optimizer`` is not used.
        data: the user-partitioned data (:class:`userdp.engine.UserData`).
        loss_fn: ``loss_fn(model, batch) -> Tensor[n]``, one loss per record (as for ``train``).
        config: the run's :class:`TrainConfig` (algorithm, steps, clipping, noise or target
            epsilon, delta, sampler, seed), or a :class:`RunPlan` made from it for this data.
        options: a :class:`~userdp.engine.run.options.RunOptions` (None: one process, in memory):
            its ``checkpoint_dir`` is where the ledger's journal and the checkpoints go (every
            ``config.performance.checkpoint_every`` steps and at the end); ``resume`` continues the run in it;
            ``combiner`` names the job's processes (:mod:`userdp.engine.distributed.processes`, e.g.
            ``TorchDistributedCombiner()`` under torchrun). Every rank runs the same loop over its
            share of each cohort; the noisy sum is all-reduced, so every rank's optimizer steps the
            same gradient and rank 0 alone keeps the journal and checkpoints. Its hooks (callbacks,
            checkpoint_extra, on_start) are ``train()``'s and are refused here: the loop is yours.

    Raises:
        UserError: a bad configuration, an optimizer that does not hold exactly the trainable
            parameters, float16/bfloat16 parameters, or a checkpoint_dir that holds another run.
    """
    options = run_options(options)
    check_instance(
        optimizer,
        "optimizer",
        torch.optim.Optimizer,
        "a torch.optim.Optimizer over the model's trainable parameters (your loop steps it)",
    )
    if options.hooks:
        raise UserError(
            f"make_private: options.{options.hooks[0]} is train()'s hook; in a loop of your own, call "
            "your own code between the steps"
        )
    earlier = getattr(model, _MARK, None)
    if earlier is not None and earlier.spent > 0 and not options.resume:
        raise UserError(
            "make_private: this model is already private under another make_private call; a second "
            "call would start a fresh ledger that does not count the first one's steps (their "
            "epsilons compose): continue the first, or resume it from its checkpoint_dir"
        )
    run = start_run(model, data, loss_fn, config, options, optimizer=optimizer)
    setattr(model, _MARK, run.ledger)  # the ledger alone (its count), not the run and its data
    return PrivateTraining(run)


#: the ledger of the make_private call that made a model private
_MARK = "_userdp_made_private"
