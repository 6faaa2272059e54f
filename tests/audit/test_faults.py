"""The broken builds the audit is tested against do exactly what they claim, and only inside
their ``with`` block (one SGD step on the mean model, where every update is known)."""

import numpy as np
import pytest

from userdp import engine as E
from userdp.audit.faults import broken_plan, broken_train_plan
from userdp.engine.noise.mechanism import IIDGaussian
from userdp.errors import UserError

from _engine_helpers import Mean, linear_loss, user_data


def _step(fault=None, times=3):
    data = user_data([1] * 6, d=4, seed=1, scale=10.0)  # six users, one record each, norms ~20 >> C
    cfg = E.TrainConfig(
        algorithm=E.ULS(group_size=1, sampling_rate=1.0),
        steps=1,
        clipping=E.FlatClip(1.0),
        optimizer=E.SGD(lr=1.0),
        noise_multiplier=2.0,
        seed=5,
        delta=1e-5,
    )
    model = Mean(4)
    res = E.train(model, data, linear_loss, broken_train_plan(cfg, data, fault, times) if fault else cfg)
    return model.theta.detach().double().numpy(), res.record, data


def test_each_fault_changes_exactly_what_it_names():
    base, rec, data = _step()
    x = data.tensors["x"].double().numpy()
    clipped = x / np.maximum(1.0, np.linalg.norm(x, axis=1, keepdims=True))  # the gradient of a record is -x
    den = 6.0  # expected units at q = 1
    assert "broken_build" not in rec
    # noise off: the update is the clipped mean, exactly
    quiet, rec_q, _ = _step("noise_off")
    assert rec_q["broken_build"] == "noise_off"
    assert np.allclose(quiet, clipped.sum(0) / den, atol=1e-5)
    noise = base - quiet  # the seeded noise of the intact run: N(0, (2/6)² I) in 4 coordinates
    assert np.linalg.norm(noise) > 0.05  # it was added (a norm under 0.05 has probability 6e-5)
    # clipping off: same seeded noise, unclipped updates
    loose, _, _ = _step("clipping_off")
    assert np.allclose(loose - noise, x.sum(0) / den, atol=1e-4)
    # a user counted 3 times: same noise, three times the clipped sum
    counted, _, _ = _step("user_counted_g_times", 3)
    assert np.allclose(counted - noise, 3 * clipped.sum(0) / den, atol=1e-5)


def test_a_fault_is_a_part_of_one_runs_plan_and_patches_no_engine_class():
    """The broken parts live in one run's plan: the engine's classes are untouched, a run beside a
    broken one is the intact run bit for bit, and a fault the plan cannot carry is refused."""
    noise_before, clip_before = (IIDGaussian.update, IIDGaussian.filter), E.FlatClip.factors_from_norms
    before, _, _ = _step()
    for fault in ("noise_off", "clipping_off", "user_counted_g_times"):
        _step(fault)
    after, rec, data = _step()
    assert np.array_equal(before, after) and "broken_build" not in rec
    assert (IIDGaussian.update, IIDGaussian.filter) == noise_before and E.FlatClip.factors_from_norms is clip_before
    cfg = E.TrainConfig(algorithm=E.ULS(group_size=1, sampling_rate=1.0), steps=1, noise_multiplier=2.0, delta=1e-5)
    with pytest.raises(UserError, match="unknown fault"):
        broken_train_plan(cfg, data, "gravity_off")
    per_layer = E.TrainConfig(
        algorithm=E.ULS(group_size=1, sampling_rate=1.0),
        steps=1,
        noise_multiplier=2.0,
        delta=1e-5,
        clipping=E.PerLayerClip(1.0),
    )
    with pytest.raises(UserError, match="breaks flat clipping"):
        broken_train_plan(per_layer, data, "clipping_off")
    plan = broken_train_plan(cfg, data, "noise_off")
    assert plan.broken_build == "noise_off" and plan.step_event == broken_plan(plan, "clipping_off").step_event
