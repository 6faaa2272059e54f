"""A release before training (the DP median that chose G) is spent through the ledger like every
other release (issue 36): its pure-DP event is composed with the steps by the accountant, counted
against the target, and a calibrated sigma leaves room for it."""

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

from userdp import accounting as A
from userdp.accounting.rdp import pure_dp_rdp
from userdp.engine import ULS, TrainConfig, train
from userdp.engine.plan import privacy_repr
from userdp.errors import UserError

from _engine_helpers import Mean, sq_loss, train_config, user_data

DELTA = 1e-5


def test_the_pure_dp_event_stands_for_an_epsilon_dp_release():
    ev = A.pure_dp_event(0.5)
    assert A.pure_dp_epsilon(ev) == pytest.approx(0.5, rel=1e-12)
    assert A.pure_dp_epsilon(ev, A.NeighborRel.REPLACE_ONE) == pytest.approx(1.0, rel=1e-12)  # remove + add
    assert A.pure_dp_epsilon(dp_accounting.RandomizedResponseDpEvent(0.5, 3)) is None
    assert A.has_pure_dp(A.compose_after([ev], A.uls_step_event(1.0, 0.1), 3))
    assert not A.has_pure_dp(A.compose(A.uls_step_event(1.0, 0.1), 3))
    # its RDP is the two-point pair's, which dp_accounting computes for randomized response (replace-one)
    orders = np.array([1.5, 2.0, 4.0, 16.0, 256.0])
    ref = rdp_lib.RdpAccountant(orders=list(orders), neighboring_relation=A.NeighborRel.REPLACE_ONE)
    ref.compose(ev)
    assert np.allclose(pure_dp_rdp(0.5, orders), np.asarray(ref._rdp), rtol=1e-9)
    # on its own, each accountant gives (about) its epsilon, and never more than it at delta > 0
    for acc in ("pld", "rdp"):
        eps = A.epsilon(ev, DELTA, acc)
        assert 0.49 < eps <= 0.5 + 0.01, (acc, eps)


@pytest.mark.parametrize("step", [A.uls_step_event(1.0, 0.1), A.els_step_event(1.5, 0.05, 4)], ids=["uls", "els"])
@pytest.mark.parametrize("acc", ["pld", "rdp"])
def test_the_median_composes_with_the_steps_within_the_sum_and_above_each(step, acc):
    median = A.pure_dp_event(0.5)
    train_only = A.epsilon(A.compose(step, 40), DELTA, acc)
    both = A.epsilon(A.compose_after([median], step, 40), DELTA, acc)
    assert max(train_only, A.epsilon(median, DELTA, acc)) < both <= train_only + 0.5 + 1e-9


def test_calibration_leaves_room_for_the_prior_and_no_more():
    mech = A.Mechanism.for_training(A.UnitSampling("user", 0.1, 2), "poisson", 1.0, 40)
    median = A.pure_dp_event(0.5)
    alone = mech.calibrated(3.0, DELTA).noise_multiplier
    z = mech.calibrated(3.0, DELTA, prior=(median,)).noise_multiplier
    assert z > alone
    assert A.epsilon(A.compose_after([median], mech.step_event(z), 40), DELTA) <= 3.0
    assert A.epsilon(A.compose_after([median], mech.step_event(z / 1.02), 40), DELTA) > 3.0  # tight to ~1%
    with pytest.raises(UserError, match="before training already spend epsilon"):
        mech.calibrated(3.0, DELTA, prior=(A.pure_dp_event(3.5),))


def test_train_counts_the_prior_first_and_against_the_target():
    data = user_data([2] * 200)
    median = A.pure_dp_event(0.5)
    cfg = TrainConfig(algorithm=ULS(2, 0.1), steps=20, target_epsilon=3.0, delta=DELTA, prior_events=(median,))
    res = train(Mean(3), data, sq_loss, cfg)
    total = A.event_from_dict(res.record["dp_event_total"])
    assert total == A.compose_after([median], A.event_from_dict(res.record["step_event"]), 20)
    assert res.epsilon == pytest.approx(A.epsilon(total, DELTA), rel=1e-9) and res.epsilon <= 3.0
    assert res.record["steps_accounted"] == 20
    # a fixed sigma calibrated without the median has no room for it: the budget stops the run early
    alone = train(Mean(3), data, sq_loss, TrainConfig(algorithm=ULS(2, 0.1), steps=20, target_epsilon=3.0, delta=DELTA))
    fixed = TrainConfig(
        algorithm=ULS(2, 0.1),
        steps=20,
        noise_multiplier=alone.noise_multiplier,
        target_epsilon=3.0,
        delta=DELTA,
        prior_events=(median,),
    )
    stopped = train(Mean(3), data, sq_loss, fixed)
    assert stopped.record["steps_accounted"] < 20 and stopped.epsilon <= 3.0
    # the journal and a resume are bound to the prior (a privacy setting)
    assert privacy_repr(cfg) != privacy_repr(
        TrainConfig(algorithm=ULS(2, 0.1), steps=20, target_epsilon=3.0, delta=DELTA)
    )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(prior_events=("median",), target_epsilon=3.0), r"prior_events\[0\] must be a dp_accounting DpEvent"),
        (dict(prior_events=A.pure_dp_event(0.5), target_epsilon=3.0), "prior_events must be a tuple"),
        (dict(prior_events=(A.pure_dp_event(0.5),), noise_multiplier=0.0), "non-private run"),
    ],
)
def test_a_bad_prior_is_one_line_naming_it(kwargs, match):
    with pytest.raises(UserError, match=match):
        train_config(algorithm=ULS(2, 0.1), steps=5, delta=DELTA, **kwargs)


def test_the_ledger_states_the_prior_before_the_first_step():
    from userdp.engine.ledger import PrivacyLedger

    step = A.uls_step_event(1.0, 0.1)
    led = PrivacyLedger(step, DELTA, target_epsilon=3.0)
    led.spend_event(A.pure_dp_event(0.5))
    assert led.spent == 0 and math.isclose(led.epsilon(), A.epsilon(A.pure_dp_event(0.5), DELTA), rel_tol=1e-9)
    assert led.epsilon_upper_bound() >= led.epsilon() > 0.45  # never 0 once the median is out
