"""The broken builds the audit is tested against do exactly what they claim, and only inside
their ``with`` block (one SGD step on the mean model, where every update is known)."""

import numpy as np
import pytest

from userdp import engine as E
from userdp.audit.faults import broken_build
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
    if fault:
        with broken_build(fault, times):
            res = E.train(model, data, linear_loss, cfg)
    else:
        res = E.train(model, data, linear_loss, cfg)
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
    noise = base - quiet  # the seeded noise of the intact run
    assert np.linalg.norm(noise) > 0.5
    # clipping off: same seeded noise, unclipped updates
    loose, _, _ = _step("clipping_off")
    assert np.allclose(loose - noise, x.sum(0) / den, atol=1e-4)
    # a user counted 3 times: same noise, three times the clipped sum
    counted, _, _ = _step("user_counted_g_times", 3)
    assert np.allclose(counted - noise, 3 * clipped.sum(0) / den, atol=1e-5)


def test_faults_are_undone_after_the_block():
    before, _, _ = _step()
    with pytest.raises(RuntimeError), broken_build("noise_off"):
        raise RuntimeError("inside")
    after, rec, _ = _step()
    assert np.array_equal(before, after) and "broken_build" not in rec
    with pytest.raises(UserError, match="unknown fault"), broken_build("gravity_off"):
        pass
