"""The plugin boundary (userdp.engine.plugin_outputs): what a plugin sampler or noise mechanism
returns is checked where it enters the engine, once per step, and a plugin that raises is one line
naming it. Written from the class: every way a cohort can be wrong (a unit twice, out of range,
not integers, not 1-D), every way a release can be (NaN, inf, a non-number on the count query),
and an exception from each part; and the neighbour test, which a duplicating sampler would fail
by a factor of 2 without the boundary."""

import numpy as np
import pytest
import torch

from userdp.engine import SGD, ULS, FlatClip, TrainConfig, train
from userdp.engine import plugin_outputs as P
from userdp.engine.neighbour import neighbour_gap
from userdp.engine.noise.mechanism import NOISE_MECHANISMS, IIDGaussian
from userdp.engine.sampling import SAMPLERS, Poisson
from userdp.errors import UserError

from _engine_helpers import Mean, sq_loss, train_config, user_data

pytestmark = pytest.mark.usefixtures("isolated_registries")

SIZES = [3, 1, 5, 2, 8, 4] * 2


class _Sampler:
    """A plugin sampler returning what ``make(n)`` gives."""

    mode = "poisson"
    accounted_as = "poisson"

    def __init__(self, name, make):
        self.name, self.make = name, make

    def sample(self, num_units, rate, step, rng, state):
        return self.make(num_units)


def _boom(n):
    raise RuntimeError("the plugin's bug")


BAD_COHORTS = {
    "a unit twice": (lambda n: np.array([0, 1, 1]), "more than once"),
    "the last unit twice": (lambda n: np.array([n - 1, n - 1]), "more than once"),
    "past the last unit": (lambda n: np.array([0, n]), "outside [0, "),
    "negative": (lambda n: np.array([-1, 2]), "outside [0, "),
    "floats": (lambda n: np.array([0.0, 1.5]), "must be integers"),
    "a 2-D array": (lambda n: np.array([[0, 1], [2, 3]]), "1-D"),
    "strings": (lambda n: np.array(["0", "1"]), "must be integers"),
    "raises": (_boom, "raised RuntimeError: the plugin's bug"),
}


def _config(**kw):
    base = dict(
        algorithm=ULS(2, 0.5),
        steps=2,
        clipping=FlatClip(1.0),
        optimizer=SGD(0.1),
        noise_multiplier=1.0,
        delta=1e-5,
        seed=3,
        track_epsilon=False,
        accountant="rdp",
    )
    return train_config(**{**base, **kw})


@pytest.mark.parametrize("case", list(BAD_COHORTS))
def test_a_plugin_samplers_bad_cohort_is_one_line_naming_it_before_any_sum(case):
    make, needle = BAD_COHORTS[case]
    SAMPLERS.register(_Sampler("bad_sampler_for_test", make), name="bad_sampler_for_test")
    model = Mean(3)
    with pytest.raises(UserError) as exc:
        train(model, user_data(SIZES), sq_loss, _config(sampling="bad_sampler_for_test"))
    msg = str(exc.value)
    assert needle in msg and "'bad_sampler_for_test'" in msg and "\n" not in msg, msg
    assert torch.equal(model.theta, torch.zeros(3))  # nothing was applied


def test_a_good_cohort_passes_the_boundary_unchanged_and_an_empty_one_is_an_empty_step():
    ids = np.array([4, 0, 2], dtype=np.int32)
    out = P.checked_cohort(ids, 5, Poisson())
    assert out.dtype == np.int64 and out.tolist() == [4, 0, 2]
    assert P.checked_cohort([], 5, Poisson()).size == 0
    assert P.checked_cohort(np.array([], dtype=float), 5, Poisson()).size == 0


class _Noise(IIDGaussian):
    """A plugin mechanism whose release is ``write(t)`` for each sum."""

    write = None

    def update(self, sums, state, std):
        for t in sums:
            type(self).write(t)
        return sums, state


@pytest.mark.parametrize(
    "write, needle",
    [
        (lambda t: t.fill_(float("nan")), "non-finite"),
        (lambda t: t.view(-1)[0].fill_(float("inf")), "non-finite"),
        (lambda t: (_ for _ in ()).throw(ValueError("oops")), "raised ValueError: oops"),
    ],
    ids=["nan", "inf", "raises"],
)
def test_a_plugin_noise_mechanisms_bad_release_is_refused_before_the_model_moves(write, needle):
    class Bad(_Noise):
        name = "bad_noise_for_test"

    Bad.write = staticmethod(write)
    NOISE_MECHANISMS.register(Bad, name=Bad.name)
    model = Mean(3)
    with pytest.raises(UserError) as exc:
        train(model, user_data(SIZES), sq_loss, _config(noise=Bad.name))
    assert needle in str(exc.value) and "'bad_noise_for_test'" in str(exc.value)
    assert torch.isfinite(model.theta).all() and torch.equal(model.theta, torch.zeros(3))


def test_a_plugin_count_query_noise_must_be_a_finite_number():
    class NanScalar(IIDGaussian):
        name = "nan_scalar_for_test"

        def scalar(self, std):
            return float("nan")

    with pytest.raises(UserError, match="'nan_scalar_for_test'.*count query's noise"):
        P.check_finite_scalar(NanScalar(None).scalar(1.0), NanScalar(None))
    assert P.check_finite_scalar(0.25, NanScalar(None)) == 0.25


def test_userdps_own_parts_are_trusted_and_their_bugs_stay_tracebacks():
    assert P.built_in(Poisson()) and P.built_in(IIDGaussian)
    assert not P.built_in(_Sampler("x", lambda n: n))
    with pytest.raises(RuntimeError):  # a bug of userdp's own is not dressed as a user error
        P.call("sampler", Poisson(), _boom, 3)


def test_the_neighbour_test_catches_a_duplicating_sampler_without_the_boundary(monkeypatch):
    """The sampler names the added user twice (it is last): its share of the released sum is 2C.
    The boundary refuses the cohort; with the boundary switched off the neighbour test measures the
    doubled share (so the check is what keeps the property, not an accident of the test)."""
    SAMPLERS.register(
        _Sampler("dup_last_for_test", lambda n: np.concatenate([np.arange(n), [n - 1]])), name="dup_last_for_test"
    )
    init = torch.from_numpy(np.random.default_rng(0).normal(size=4)).float()
    data = user_data([2] * 6, d=4, seed=1)
    attacker = user_data([2], d=4, seed=2, scale=50.0)
    cfg = TrainConfig(
        algorithm=ULS(2, 1.0),
        steps=1,
        clipping=FlatClip(1.0),
        noise_multiplier=1.0,
        seed=11,
        sampling="dup_last_for_test",
    )

    def build():
        return Mean(4, init=init)

    with pytest.raises(UserError, match="more than once"):
        neighbour_gap(build, data, attacker, sq_loss, cfg)
    import userdp.engine.run.step as L

    monkeypatch.setattr(L, "checked_cohort", lambda ids, n, s: np.asarray(ids, dtype=np.int64))
    gap = neighbour_gap(build, data, attacker, sq_loss, cfg)
    assert not gap.within() and gap.ratio > 1.9
