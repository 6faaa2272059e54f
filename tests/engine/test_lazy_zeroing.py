"""Lazy zeroing of bad units on a device (issue 35): the ghost strategy skips the pass that zeroes a
non-finite unit's rows of every factor, and the step's one host sync says whether any unit was
bad; then the step's sums are computed again, zeroing, before any of them is used.

The CPU zeroes exactly when a unit is bad (reading ``bad.any()`` is free there), so the device's
rule is emulated here: ``contraction.must_zero`` and ``distribution.defers_zeroing`` as on CUDA."""

import pytest
import torch
from _neighbours import ADVERSARIES, builder, honest, reg_loss

import userdp.engine.distributed.distribution as distribution_mod
import userdp.engine.run.loop as loop_mod
from userdp.engine import ULS, FlatClip, TrainConfig, contraction
from userdp.engine.neighbour import join, neighbour_gap, released_sum
from userdp.engine.performance import Performance


def _as_on_a_device(monkeypatch) -> list:
    """The device's zeroing rule on the CPU; returns the list each EngineRun.clipped_sum call appends
    ``(lazy, every sum finite)`` to."""
    monkeypatch.setattr(contraction, "must_zero", lambda bad, lazy=False: not lazy)
    monkeypatch.setattr(distribution_mod, "defers_zeroing", lambda device: True)
    calls = []
    real = loop_mod.EngineRun.clipped_sum

    def spy(self, ids, n_chunks=None, lazy=False):
        sums, stats = real(self, ids, n_chunks, lazy)
        calls.append((lazy, all(bool(torch.isfinite(s).all()) for s in sums)))
        return sums, stats

    monkeypatch.setattr(loop_mod.EngineRun, "clipped_sum", spy)
    return calls


def _config(seed=11):
    return TrainConfig(
        algorithm=ULS(group_size=4, sampling_rate=1.0),
        steps=1,
        noise_multiplier=1.0,
        clipping=FlatClip(1.0),
        seed=seed,
        performance=Performance(per_unit="ghost", checkpoint_every=0),
    )


def test_a_bad_unit_sends_the_step_back_to_be_computed_again_zeroing(monkeypatch):
    """With a non-finite user in the cohort the lazy pass's sums are NaN (the zeroing really was
    skipped), the step is computed again with zeroing, and what it releases is finite and the same
    as the always-zeroing step's (same seed)."""
    data = join(honest(g=4), ADVERSARIES["nonfinite"]())
    want, _ = released_sum(builder(layers=2)(), data, reg_loss, _config())  # the CPU: zeroed exactly
    calls = _as_on_a_device(monkeypatch)
    got, _ = released_sum(builder(layers=2)(), data, reg_loss, _config())
    assert calls == [(True, False), (False, True)]
    assert all(bool(torch.isfinite(g).all()) for g in got)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_a_step_without_a_bad_unit_is_computed_once_and_releases_the_same(monkeypatch):
    data = honest(g=4)
    want, _ = released_sum(builder(layers=2)(), data, reg_loss, _config())
    calls = _as_on_a_device(monkeypatch)
    got, _ = released_sum(builder(layers=2)(), data, reg_loss, _config())
    assert calls == [(True, True)]
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("adversary", ["nonfinite", "cancelling", "huge"])
def test_lazy_zeroing_keeps_the_neighbour_bound(monkeypatch, adversary):
    _as_on_a_device(monkeypatch)
    gap = neighbour_gap(builder(layers=2), honest(g=4), ADVERSARIES[adversary](), reg_loss, _config())
    assert gap.within(), f"{adversary}: {gap.ratio:.4f} x the bound"


def test_the_cpu_never_computes_a_step_twice(monkeypatch):
    """On the CPU the strategy zeroes exactly when a unit is bad: no redo, however bad the cohort."""
    calls = []
    real = loop_mod.EngineRun.clipped_sum

    def spy(self, ids, n_chunks=None, lazy=False):
        calls.append(lazy)
        return real(self, ids, n_chunks, lazy)

    monkeypatch.setattr(loop_mod.EngineRun, "clipped_sum", spy)
    data = join(honest(g=4), ADVERSARIES["nonfinite"]())
    got, _ = released_sum(builder(layers=2)(), data, reg_loss, _config())
    assert calls == [False] and all(bool(torch.isfinite(g).all()) for g in got)
