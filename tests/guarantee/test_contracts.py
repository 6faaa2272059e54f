"""Issue 25's contracts below the CLI: the tuning guarantee re-derived from events, unit weights,
accountants refused when the plan is made, ChaCha's bounded tail paid for in delta, seeded
a resume never replays under the same noise."""

import math

import dp_accounting
import numpy as np
import pytest
import torch

from userdp import accounting as A
from userdp.accounting import private_selection as PS
from userdp.accounting.selection import TrialCount
from userdp.engine import ELS, ULS, RunOptions, TrainConfig, train
from userdp.engine.algorithms import UnitTable
from userdp.engine.noise.chacha import TAIL_MASS_PER_PAIR, _normals_from_blocks, tail_delta
from userdp.engine.performance import Performance
from userdp.engine.plan import make_plan
from userdp.errors import UserError

from _engine_helpers import Mean, sq_loss, user_data


# ------------------------------------------------------------------ 1. tuning: private selection, K secret
def test_released_guarantee_is_private_selection_and_never_depends_on_k():
    """Issue 34 (C3): the released statement is the private-selection bound whatever K was drawn
    (taking the smaller of it and the composition would publish whether K was small); the
    composition is what publishing the trials would cost, reported apart."""
    ev = A.compose(A.uls_step_event(1.2, 0.05), 100)
    count = TrialCount.with_mean("tnb", 8.0, 1.0)
    delta = 1e-5
    few = PS.derive({"m": A.event_to_dict(ev)}, ["m"] * 3, count, delta)
    rdp = dp_accounting.rdp.RdpAccountant(orders=list(PS.ORDERS))
    rdp.compose(ev, 3)
    assert few["epsilon_if_trials_published"] == pytest.approx(rdp.get_epsilon(delta), rel=1e-9)
    many = PS.derive({"m": A.event_to_dict(ev)}, ["m"] * 40, count, delta)
    hidden = PS.derive({"m": A.event_to_dict(ev)}, None, count, delta)
    assert few["epsilon_released_model"] == many["epsilon_released_model"] == hidden["epsilon_released_model"]
    assert hidden["epsilon_released_model"] == hidden["epsilon_selection_bound"]
    assert "epsilon_if_trials_published" not in hidden
    assert few["epsilon_if_trials_published"] < few["epsilon_selection_bound"] < many["epsilon_if_trials_published"]
    # an empty trial list can no longer make anything zero (C2 used it to certify epsilon = 0)
    none = PS.derive({"m": A.event_to_dict(ev)}, [], count, delta)
    assert none["epsilon_released_model"] == hidden["epsilon_released_model"] > 0


def test_trial_count_read_back_is_validated():
    for bad in (
        {"kind": "tnb", "eta": float("nan"), "gamma": 0.1, "mu": 1.0},
        {"kind": "tnb"},
        {"kind": "zipf", "eta": 1, "gamma": 0.1, "mu": 1},
    ):
        with pytest.raises(UserError):
            PS.trial_count_from_dict(bad, "tune.json")


# ------------------------------------------------------------------ 7. unit weights in [0, 1]
@pytest.mark.parametrize("w", [[0.5, 1.5], [-0.1, 1.0], [float("nan"), 1.0], [1.0]])
def test_unit_weights_outside_zero_one_are_refused(w):
    with pytest.raises(UserError, match="unit weights must be finite and in \\[0, 1\\]"):
        UnitTable(np.arange(2), weights=np.asarray(w))
    UnitTable(np.arange(2), weights=np.asarray([0.0, 1.0]))  # the boundary is fine


def test_an_algorithm_whose_units_weigh_more_than_one_is_refused_before_a_step(tmp_path):
    class Heavy(ULS):
        def units(self, data, rng):
            t = super().units(data, rng)
            return UnitTable(t.users, weights=np.full(len(t.users), 2.0))

    cfg = TrainConfig(
        algorithm=Heavy(2, 0.3), steps=2, noise_multiplier=1.0, delta=1e-5, performance=Performance(track_epsilon=False)
    )
    seen = []
    with pytest.raises(UserError, match="unit weights"):
        train(Mean(4), user_data([3] * 10, d=4), sq_loss, cfg, RunOptions(callbacks=[seen.append]))
    assert seen == []


# ------------------------------------------------------------------ 7. accountants refused at plan time
class _GaussianOnly:
    """A plugin accountant built on dp_accounting's RDP accountant, which has no mixtures."""

    name = "gaussian_only_test"
    discretized = False

    def epsilon(self, event, delta, **kw):
        acc = dp_accounting.rdp.RdpAccountant()
        acc.compose(event)
        return acc.get_epsilon(delta), self.name

    def delta(self, event, epsilon, **kw):
        acc = dp_accounting.rdp.RdpAccountant()
        acc.compose(event)
        return acc.get_delta(epsilon)

    def epsilon_of_steps(self, step_event, steps, delta):
        return self.epsilon(A.compose(step_event, steps), delta)[0]


def test_an_accountant_that_cannot_account_the_event_is_refused_when_the_plan_is_made():
    A.register_accountant(_GaussianOnly())
    try:
        els = TrainConfig(
            algorithm=ELS(4, 0.1), steps=5, noise_multiplier=1.0, delta=1e-5, accountant="gaussian_only_test"
        )
        with pytest.raises(UserError, match="gaussian_only_test: it cannot account .*MixtureOfGaussiansDpEvent"):
            make_plan(els, num_users=100, num_units=300)
        calibrated = TrainConfig(
            algorithm=ELS(4, 0.1), steps=5, target_epsilon=3.0, delta=1e-5, accountant="gaussian_only_test"
        )
        with pytest.raises(UserError, match="cannot account"):  # before calibration asks it
            make_plan(calibrated, num_users=100, num_units=300)
        uls = TrainConfig(
            algorithm=ULS(4, 0.1), steps=5, noise_multiplier=1.0, delta=1e-5, accountant="gaussian_only_test"
        )
        assert make_plan(uls, num_users=100, num_units=100).private
    finally:
        A.ACCOUNTANTS.pop("gaussian_only_test", None)


# ------------------------------------------------------------------ 7. ChaCha's tail goes into delta
def test_chacha_radius_is_bounded_where_the_tail_constant_says():
    """Emulated in float64: the extreme words give the largest radius sqrt(2 * 85 ln 2) (u1 =
    2^-86), the mass beyond it is 2^-85 a pair, and no word pattern gives a non-finite normal."""
    zero = torch.zeros(1, 16, dtype=torch.int64)
    r_max = float(_normals_from_blocks(zero).reshape(-1, 2).norm(dim=1).max())
    assert r_max == pytest.approx(math.sqrt(-2 * math.log(2.0**-86)), rel=1e-12)
    assert math.exp(-(math.sqrt(-2 * math.log(2.0**-85)) ** 2) / 2) == pytest.approx(TAIL_MASS_PER_PAIR, rel=1e-12)
    ones = torch.full((1, 16), 2**32 - 1, dtype=torch.int64)
    assert torch.isfinite(_normals_from_blocks(ones)).all()
    # what the old 53-bit radius would have added at GPT-2 size, eps = 8, 1,000 steps, against now
    old = tail_delta(124_000_000, 1000, 8.0, 2.0**-53)
    assert old > 1e-5 > 1e-11 > tail_delta(124_000_000, 1000, 8.0)
    assert tail_delta(10, 0, 3.0) == 0.0


@pytest.mark.slow
def test_a_chacha_run_adds_its_tail_to_the_stated_delta(monkeypatch):
    from userdp.engine.noise import gaussian as N
    from userdp.engine.noise.chacha import ChaChaNoise

    monkeypatch.setitem(N.DEVICE_SOURCES, "cpu", ChaChaNoise)
    cfg = TrainConfig(
        algorithm=ULS(2, 0.3), steps=3, noise_multiplier=1.0, delta=1e-5, performance=Performance(track_epsilon=False)
    )
    rec = train(Mean(4), user_data([3] * 10, d=4), sq_loss, cfg).record
    nt = rec["noise_tail"]
    assert nt["coordinates"] == 4 and nt["steps"] == 3
    assert nt["delta"] == pytest.approx(3 * 2 * 2.0**-85 * (1 + math.exp(rec["epsilon"])), rel=1e-12)
    monkeypatch.setitem(N.DEVICE_SOURCES, "cpu", N.GaussianNoise)
    assert "noise_tail" not in train(Mean(4), user_data([3] * 10, d=4), sq_loss, cfg).record


# ------------------------------------------------------------------ 7. a resume never replays under the same noise
def test_a_seeded_run_resumed_after_a_crash_never_reuses_its_noise(tmp_path):
    """Issue 34 (H1): a seeded run crashed after its checkpoint; its resume counts the steps begun
    after it and draws new noise for every later step (the noise of the crashed steps is never
    drawn again), on the CPU as elsewhere."""

    class Crash(Exception):
        pass

    def crash(m):
        if m["step"] == 3:
            raise Crash

    data = user_data([3] * 30, d=4)
    cfg = TrainConfig(
        algorithm=ULS(2, 0.3),
        steps=6,
        noise_multiplier=2.0,
        delta=1e-5,
        seed=7,
        performance=Performance(checkpoint_every=2, track_epsilon=False),
    )
    whole = train(Mean(4), data, sq_loss, cfg)
    with pytest.raises(Crash):
        train(Mean(4), data, sq_loss, cfg, RunOptions(checkpoint_dir=str(tmp_path), callbacks=[crash]))
    res = train(Mean(4), data, sq_loss, cfg, RunOptions(checkpoint_dir=str(tmp_path), resume=True))
    assert res.record["steps_lost_to_crashes"] == 1 and res.record["steps_accounted"] == 7
    # steps 3..6 after the resume are not the uncrashed run's steps 3..6 (other noise)
    assert [h["loss"] for h in res.history[2:]] != [h["loss"] for h in whole.history[2:]]
