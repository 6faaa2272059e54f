"""Banded matrix-factorization noise over cyclic-Poisson user groups (userdp.engine.noise.bandmf,
userdp.engine.sampling.CyclicPoisson): the strategy the run used is b-banded with column norm 1,
b = 1 is today's independent noise bit for bit, the noise has the covariance C⁻¹C⁻ᵀ, a user takes
part only in the steps of its group, its group is its own, a seeded resume continues the stream,
and every combination that is not accounted is one line."""

import dataclasses

import numpy as np
import pytest
import torch
from _neighbours import ADVERSARIES, builder, honest, reg_loss

from userdp.engine import (
    ELS,
    SGD,
    ULS,
    AdaptiveClip,
    ClippedDenominator,
    FedAvg,
    FlatClip,
    RunOptions,
    TensorUserData,
    train,
)
from userdp.engine.neighbour import neighbour_gap
from userdp.engine.noise.bandmf import BandMF, bsr_coefficients, max_column_norm, strategy_matrix
from userdp.engine.noise.gaussian import GaussianNoise
from userdp.engine.run.loop import start_run
from userdp.engine.sampling import CyclicPoisson
from userdp.errors import UserError
from userdp.keyed_hash import keyed_uniforms

from _engine_helpers import MLP, ce_loss, ctrl_c_at, mlp_data, sigint_raises, train_config


def _data(n_users=40, per_user=3, seed=6):
    """``n_users`` users with ids ``user-<i>`` (their cyclic group follows the id, not the position)."""
    base = mlp_data([per_user] * n_users, seed=seed)
    ids = np.repeat([f"user-{i}" for i in range(n_users)], per_user)
    return TensorUserData.from_user_ids(base.tensors, ids)


def _cfg(bands=4, noise="bandmf", sampling="cyclic_poisson", steps=8, seed=3, rate=0.2, **kw):
    return train_config(
        algorithm=kw.pop("algorithm", ULS(group_size=2, sampling_rate=rate)),
        steps=steps,
        noise_multiplier=1.0,
        optimizer=SGD(0.2),
        clipping=kw.pop("clipping", FlatClip(1.0)),
        sampling=sampling,
        noise=noise,
        bands=bands,
        seed=seed,
        delta=1e-5,
        **kw,
    )


def _trained(cfg, data=None, options=None):
    torch.manual_seed(0)
    model = MLP()
    result = train(model, data or _data(), ce_loss, cfg, options or RunOptions())
    return model, result


# ---------------------------------------------------------------- the strategy
@pytest.mark.parametrize("bands", [1, 2, 4, 9])
def test_the_strategy_the_run_used_is_banded_lower_triangular_with_column_norm_one(bands):
    run = start_run(MLP(), _data(), ce_loss, _cfg(bands=bands, steps=20, rate=0.05), RunOptions())
    try:
        c = run.noise.coefficients  # the coefficients the run's noise actually streams with
        C = strategy_matrix(c, 20)
        assert np.allclose(np.triu(C, 1), 0.0)  # lower triangular
        rows, cols = np.nonzero(C)
        assert (rows - cols).max() == bands - 1  # exactly b bands
        norms = np.linalg.norm(C, axis=0)
        assert norms.max() <= 1.0 + 1e-12 and abs(norms.max() - 1.0) < 1e-12
        assert max_column_norm(c, 20) == pytest.approx(1.0, abs=1e-12)
        assert np.array_equal(c, bsr_coefficients(bands)) and np.all(np.diff(c) <= 0) and c[0] > 0
        assert run.record()["correlated_noise"]["max_column_norm"] == pytest.approx(1.0, abs=1e-12)
    finally:
        run.chunks.close()


def test_bsr_is_the_square_root_of_the_prefix_sum_matrix_before_it_is_banded():
    # with as many bands as steps (unscaled), C·C is the all-ones lower-triangular prefix-sum matrix
    n = 12
    c = np.array([np.prod([(2 * k - 1) / (2 * k) for k in range(1, j + 1)]) for j in range(n)])
    assert np.allclose(c / np.linalg.norm(c), bsr_coefficients(n))
    C = strategy_matrix(c, n)
    assert np.allclose(C @ C, np.tril(np.ones((n, n))))


def test_one_band_is_todays_independent_noise_bit_for_bit():
    a, ra = _trained(_cfg(bands=1, noise="iid_gaussian", sampling="poisson"))
    b, rb = _trained(_cfg(bands=1))
    for x, y in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(x, y)
    assert ra.epsilon == rb.epsilon  # the same figure, to the last digit


def test_the_noise_has_covariance_c_inverse_c_inverse_transposed():
    """Each coordinate's T noise values are one draw of N(0, std² C⁻¹C⁻ᵀ) (coordinates independent):
    over 40,000 coordinates every entry of the sample covariance is within 6 standard errors."""
    steps, bands, d, std = 6, 3, 40_000, 2.0
    noise = BandMF(GaussianNoise.from_seed(17), bands=bands)
    state = noise.init(d, torch.float32, "cpu")
    draws = []
    for _ in range(steps):
        sums = [torch.zeros(d // 2), torch.zeros(d // 2)]
        sums, state = noise.update(sums, state, std)
        draws.append(torch.cat(sums).double().numpy())
    X = np.stack(draws)  # [T, d]
    Cinv = np.linalg.inv(strategy_matrix(noise.coefficients, steps))
    want = std**2 * Cinv @ Cinv.T
    got = X @ X.T / d
    se = np.sqrt((want**2 + np.outer(np.diag(want), np.diag(want))) / d)  # sd of a Gaussian product mean
    assert np.all(np.abs(got - want) <= 6 * se), np.max(np.abs(got - want) / se)
    # and the noise is correlated: the running sum of b steps has less variance than independent noise's
    assert np.var(X[:bands].sum(0)) < bands * std**2


# ---------------------------------------------------------------- who takes part when
def test_a_user_takes_part_only_in_the_steps_of_its_own_group():
    bands = 4
    run = start_run(MLP(), _data(n_users=60), ce_loss, _cfg(bands=bands, steps=40, rate=0.25), RunOptions())
    try:
        groups = run.sampler_state["groups"]
        keys = run.data.user_keys()
        want = np.floor(keyed_uniforms(keys, 0, "cyclic-poisson") * bands).astype(int)
        assert np.array_equal(groups, want[run.table.users])  # a keyed hash of the user's own id
        seen: dict[int, list[int]] = {}
        for step in range(40):
            ids = run.sampler.sample(run.n_units, run.rate, step, run.chunks.cohort_rng(step), run.sampler_state)
            assert np.all(groups[ids] == step % bands)
            for u in ids:
                seen.setdefault(int(u), []).append(step)
        gaps = [b - a for steps in seen.values() for a, b in zip(steps, steps[1:], strict=False)]
        assert min(gaps) >= bands and all(g % bands == 0 for g in gaps)  # participations b apart
        assert len(seen) == 60  # at q·b = 1 every user takes part, each in its group's steps
    finally:
        run.chunks.close()


def test_one_user_moves_no_other_users_group_or_draws_wherever_it_sits():
    """The data-neighbour test for the groups: removing a user from the middle of the data (every
    later position shifts) leaves every other user's group as it was, since a group is a keyed hash
    of the user's own id."""
    full = _data(n_users=30)
    keep = [f"user-{i}" for i in range(30) if i != 11]
    rows = np.repeat(np.arange(30), 3)
    ids = np.repeat([f"user-{i}" for i in range(30)], 3)
    mask = ids != "user-11"
    smaller = TensorUserData.from_user_ids({k: v[torch.from_numpy(mask)] for k, v in full.tensors.items()}, ids[mask])
    assert rows[mask].size == 87 and smaller.user_keys() == sorted(keep)
    sampler = CyclicPoisson()
    a = sampler.initial_state(full.user_keys(), 5)["groups"]
    b = sampler.initial_state(smaller.user_keys(), 5)["groups"]
    where = {k: g for k, g in zip(full.user_keys(), a, strict=True)}
    assert all(where[k] == g for k, g in zip(smaller.user_keys(), b, strict=True))
    # by position, the users after the removed one would have taken their successors' groups
    by_position = sampler.initial_state(list(range(30)), 5)["groups"]
    assert not np.array_equal(np.delete(by_position, 11), by_position[:29])


def test_the_added_user_changes_no_one_elses_cohort():
    data = honest(n_users=12, g=4)
    bigger_keys = list(range(13))
    s = CyclicPoisson()
    small_state, big_state = s.initial_state(list(range(12)), 3), s.initial_state(bigger_keys, 3)
    assert np.array_equal(small_state["groups"], big_state["groups"][:12])
    for step in range(12):
        a = s.sample(12, 0.2, step, np.random.default_rng(step), small_state)
        b = s.sample(13, 0.2, step, np.random.default_rng(step), big_state)
        assert np.array_equal(a, b[b < 12])
    assert data.num_users == 12


# ---------------------------------------------------------------- sensitivity
@pytest.mark.parametrize("adversary", ["cancelling", "huge", "repeated"])
@pytest.mark.parametrize("entry", ["train", "make_private"])
def test_the_banded_path_releases_no_more_than_the_bound(adversary, entry):
    """The neighbour test on the MF path: the adversary (appended last) is in group 0 and every user
    of group 0 is sampled at step 0 (q·b = 1), so its whole contribution is in the release."""
    bands = 2
    n = next(n for n in range(8, 40) if np.floor(keyed_uniforms([n], 0, "cyclic-poisson")[0] * bands) == 0)
    cfg = _cfg(bands=bands, steps=1, rate=1 / bands, algorithm=ULS(group_size=4, sampling_rate=1 / bands))
    gap = neighbour_gap(builder(layers=2), honest(n_users=n, g=4), ADVERSARIES[adversary](), reg_loss, cfg, entry=entry)
    assert gap.within(), f"{adversary}: {gap.ratio:.4f} x the bound"
    if adversary == "repeated":  # the one adversary whose clipped update is whole: it took part at step 0
        assert gap.gap > 0.5 * gap.sensitivity


# ---------------------------------------------------------------- state
def test_a_seeded_resume_continues_the_same_noise_stream_bit_for_bit(tmp_path):
    """Interrupted after step 5 (the step finishes and is saved), the resumed seeded run ends where
    the uninterrupted one does: the b − 1 past noise vectors were checkpointed with the stream's key."""
    cfg = _cfg(bands=3, steps=9, rate=0.3, checkpoint_every=4)
    ref, r_ref = _trained(cfg)
    with sigint_raises(), pytest.raises(KeyboardInterrupt):
        _trained(cfg, options=RunOptions(checkpoint_dir=str(tmp_path), callbacks=[ctrl_c_at(5)]))
    torch.manual_seed(0)
    model = MLP()
    r = train(model, _data(), ce_loss, cfg, RunOptions(checkpoint_dir=str(tmp_path), resume=True))
    assert r.steps == 9 and r.record["steps_lost_to_crashes"] == 0
    for x, y in zip(ref.parameters(), model.parameters(), strict=True):
        assert torch.equal(x, y)
    assert r.epsilon == r_ref.epsilon


def test_an_unseeded_checkpoint_holds_no_noise_and_a_resume_refuses_other_steps(tmp_path):
    from userdp.engine import checkpoint

    cfg = _cfg(bands=3, steps=6, rate=0.3, seed=None, checkpoint_every=3)
    _trained(cfg, options=RunOptions(checkpoint_dir=str(tmp_path)))
    saved = checkpoint.load(str(tmp_path))
    assert "noise" not in saved  # the past noise vectors are secret: never written unseeded
    with pytest.raises(UserError, match="steps: 6 there, 12 here"):
        _trained(dataclasses.replace(cfg, steps=12), options=RunOptions(checkpoint_dir=str(tmp_path), resume=True))


# ---------------------------------------------------------------- the refusal matrix
@pytest.mark.parametrize(
    "change,words",
    [
        (dict(sampling="poisson", bands=1), "noise 'bandmf' needs sampling 'cyclic_poisson'"),
        (dict(sampling="shuffle"), "bands = 4 needs sampling 'cyclic_poisson'"),
        (dict(sampling="poisson", noise="iid_gaussian"), "bands = 4 needs sampling 'cyclic_poisson'"),
        (dict(algorithm=ELS(group_size=2, sampling_rate=0.05)), "ELS samples records"),
        (dict(clipping=AdaptiveClip(initial_norm=1.0)), "adaptive clipping"),
        (dict(denominator=ClippedDenominator()), "clipped denominator"),
        (dict(bands=0), "bands"),
        (dict(bands=10**6), "bands"),
    ],
)
def test_every_unaccounted_combination_is_one_line(change, words):
    with pytest.raises(UserError, match=words) as info:
        _cfg(**change)
    assert "\n" not in str(info.value)


def test_a_group_rate_above_one_is_one_line():
    with pytest.raises(UserError, match=r"q·b = 1\.2 > 1: use at most 3 bands"):
        start_run(MLP(), _data(), ce_loss, _cfg(bands=4, rate=0.3), RunOptions())


def test_fedavg_takes_part_in_cycles_too():
    _, r = _trained(_cfg(algorithm=FedAvg(group_size=2, sampling_rate=0.2), steps=4))
    assert r.record["cycle"]["bands"] == 4 and r.record["correlated_noise"]["name"] == "bandmf"


class _DeviceLike:
    """A source that is not the host generator (as ChaCha on CUDA is not): it only draws whole."""

    def __init__(self, inner):
        self.inner = inner

    def like(self, tensors, std):
        return self.inner.like(tensors, std)


def test_the_draw_combined_in_pieces_whole_or_read_in_order_gives_the_same_numbers():
    """The recursion inside the host draw (pieces in the pool's threads), on a whole draw (a device
    source) and on the pieces a sharded step reads are the same numbers, step after step."""
    shapes = [(700, 1500), (3,), (1 << 20,)]  # over a million numbers: the draw is split among threads
    fused, whole, ordered = (BandMF(GaussianNoise.from_seed(5), bands=3) for _ in range(3))
    whole.source = _DeviceLike(whole.source)
    numel = sum(int(np.prod(s)) for s in shapes)
    states = [m.init(numel, torch.float32, "cpu") for m in (fused, whole, ordered)]
    for _ in range(4):
        a = [torch.zeros(s) for s in shapes]
        b = [torch.zeros(s) for s in shapes]
        a, states[0] = fused.update(a, states[0], 0.5)
        b, states[1] = whole.update(b, states[1], 0.5)
        # as a sharded step composes it: the draw read in order, each piece filtered, then advanced
        c = torch.cat(
            [ordered.filter(z, lo, states[2]).mul_(0.5) for lo, z in ordered.draws(numel, [torch.float32], "cpu")]
        )
        states[2] = ordered.advance(states[2])
        flat = torch.cat([t.reshape(-1) for t in a])
        assert torch.equal(flat, torch.cat([t.reshape(-1) for t in b])) and torch.equal(flat, c)
