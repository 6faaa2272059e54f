"""A noise mechanism with state across steps added as one file (examples/plugins/banded_coefficients.py):
banded matrix-factorization noise of the user's coefficients. Given BandMF's own coefficients it is
BandMF bit for bit (the same numbers through its own state); given others, its noise has the
covariance C⁻¹C⁻ᵀ of those; a seeded resume continues its stream; its bad settings are one line. (Under FSDP2:
tests/engine/test_fsdp_train.py::test_a_plugin_mechanism_with_state_runs_sharded_with_no_other_change;
through `userdp train --plugin`: tests/test_plugins.py.)"""

import numpy as np
import pytest
import torch
from _paths import REPO

from userdp import plugins
from userdp.engine import SGD, ULS, FlatClip, RunOptions, TensorUserData, TrainConfig, train
from userdp.engine.noise.bandmf import strategy_matrix
from userdp.engine.noise.gaussian import GaussianNoise
from userdp.engine.noise.mechanism import NOISE_MECHANISMS
from userdp.errors import UserError

from _engine_helpers import MLP, ce_loss, ctrl_c_at, mlp_data, sigint_raises, train_config

PLUGIN = REPO / "examples" / "plugins" / "banded_coefficients.py"


@pytest.fixture
def banded(isolated_registries, monkeypatch):
    plugins.load(str(PLUGIN), source="--plugin")

    def use(text: str) -> None:
        monkeypatch.setenv("USERDP_BANDED_COEFFICIENTS", text)

    return use


def _data(n_users=40, per_user=3):
    base = mlp_data([per_user] * n_users, seed=6)
    return TensorUserData.from_user_ids(base.tensors, np.repeat([f"user-{i}" for i in range(n_users)], per_user))


def _cfg(noise: str, bands=3, steps=7, **kw) -> TrainConfig:
    return train_config(
        algorithm=ULS(group_size=2, sampling_rate=0.3),
        steps=steps,
        noise_multiplier=1.0,
        optimizer=SGD(0.2),
        clipping=FlatClip(1.0),
        sampling="cyclic_poisson",
        noise=noise,
        bands=bands,
        seed=3,
        delta=1e-5,
        **kw,
    )


def _trained(cfg, options=None):
    torch.manual_seed(0)
    model = MLP()
    return model, train(model, _data(), ce_loss, cfg, options or RunOptions())


def test_the_bsr_coefficients_by_hand_are_bandmf_bit_for_bit(banded):
    banded("1,0.5,0.375")  # binom(2k, k) / 4^k: BandMF's own, before both scale them to norm 1
    ref, r_ref = _trained(_cfg("bandmf"))
    got, r_got = _trained(_cfg("banded_coefficients"))
    for x, y in zip(ref.parameters(), got.parameters(), strict=True):
        assert torch.equal(x, y)
    assert r_got.epsilon == r_ref.epsilon and r_got.record["noise_mechanism"] == "banded_coefficients"
    assert r_got.record["correlated_noise"]["coefficients"] == r_ref.record["correlated_noise"]["coefficients"]
    moved, _ = _trained(_cfg("bandmf", steps=1))
    assert not all(torch.equal(x, y) for x, y in zip(ref.parameters(), moved.parameters(), strict=True))


def test_its_noise_has_the_covariance_of_its_own_coefficients(banded):
    """Each coordinate's T values are one draw of N(0, std² C⁻¹C⁻ᵀ), C of the given coefficients:
    over 40,000 coordinates every entry of the sample covariance is within 6 standard errors."""
    banded("1,0.6,0.3")
    steps, d, std = 6, 40_000, 2.0
    mech = NOISE_MECHANISMS.lookup("banded_coefficients")(GaussianNoise.from_seed(17), bands=3)
    state = mech.init(d, torch.float32, "cpu")
    draws = []
    for _ in range(steps):
        sums, state = mech.update([torch.zeros(d // 2), torch.zeros(d // 2)], state, std)
        draws.append(torch.cat(sums).double().numpy())
    X = np.stack(draws)
    c = np.array([1, 0.6, 0.3]) / np.linalg.norm([1, 0.6, 0.3])
    assert np.allclose(mech.c, c) and len(state["past"]) == 2  # b − 1 vectors kept
    Cinv = np.linalg.inv(strategy_matrix(c, steps))
    want = std**2 * Cinv @ Cinv.T
    got = X @ X.T / d
    se = np.sqrt((want**2 + np.outer(np.diag(want), np.diag(want))) / d)
    assert np.all(np.abs(got - want) <= 6 * se), np.max(np.abs(got - want) / se)
    other = np.linalg.inv(strategy_matrix(np.array([1, 0.5, 0.375]) / np.linalg.norm([1, 0.5, 0.375]), steps))
    assert np.max(np.abs(got - std**2 * other @ other.T) / se) > 6  # and the test can tell the strategies apart


def test_a_seeded_resume_continues_its_stream_bit_for_bit(banded, tmp_path):
    banded("1,0.6,0.3")
    cfg = _cfg("banded_coefficients", steps=9, checkpoint_every=4)
    ref, r_ref = _trained(cfg)
    with sigint_raises(), pytest.raises(KeyboardInterrupt):
        _trained(cfg, RunOptions(checkpoint_dir=str(tmp_path), callbacks=[ctrl_c_at(5)]))
    model, r = _trained(cfg, RunOptions(checkpoint_dir=str(tmp_path), resume=True))
    assert r.steps == 9 and r.record["steps_lost_to_crashes"] == 0 and r.epsilon == r_ref.epsilon
    for x, y in zip(ref.parameters(), model.parameters(), strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("text", ["1,0.5", "1,x,0.2", "0,0.5,0.2", "1,nan,0.2", ""])
def test_bad_coefficients_are_one_line_before_any_step(banded, text):
    banded(text)
    model = MLP()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(UserError) as exc:
        train(model, _data(), ce_loss, _cfg("banded_coefficients"))
    assert "USERDP_BANDED_COEFFICIENTS" in str(exc.value) and "\n" not in str(exc.value)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
