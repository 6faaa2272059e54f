"""What the guarantee rests on (issue 4 item 9): sensitivity of the pre-noise sum, the noise
scale, Poisson cohort sizes, the ledger's refusal, and the sampling record."""

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from scipy import stats

from userdp import accounting
from userdp.engine import (
    ELS,
    SGD,
    ULS,
    ClippedDenominator,
    FedAvg,
    FlatClip,
    PerLayerClip,
    PrivacyLedger,
    TensorUserData,
    TrainConfig,
    train,
)
from userdp.engine.performance import Performance
from userdp.engine.privacy_record import PrivacyRecord
from userdp.engine.run.step import EngineRun
from userdp.engine.sampling import Poisson, bucket_size
from userdp.errors import BudgetExceededError, UserError

from _engine_helpers import MLP, Mean, ce_loss, linear_loss, mlp_data, sq_loss, user_data


def _with_adversary(data: TensorUserData, n_records: int, direction: torch.Tensor, scale: float):
    x = data.tensors["x"]
    adv = direction.unsqueeze(0).repeat(n_records, 1) * scale
    adv = adv + torch.linspace(0, 1, n_records).unsqueeze(1) * scale * 0.01  # distinct records
    return TensorUserData({"x": torch.cat([x, adv])}, np.concatenate([data.offsets, [data.offsets[-1] + n_records]]))


def _pre_noise_sum(model, data, loss, algo, clip, seed=0):
    cfg = TrainConfig(
        algorithm=algo,
        steps=1,
        clipping=clip,
        noise_multiplier=1.0,
        delta=1e-5,
        seed=seed,
        accountant="rdp",
        performance=Performance(chunk_size=16, track_epsilon=False),
    )
    run = EngineRun(model, data, loss, cfg)
    sums, stats_ = run.clipped_sum(np.arange(run.n_units))  # every unit in the cohort: worst case
    return torch.cat([s.reshape(-1) for s in sums]), run


@pytest.mark.parametrize("algo_name", ["uls", "fedavg", "fedavg_reproject", "fedavg_weighted", "els"])
@pytest.mark.parametrize("loss_name", ["linear", "square"])
def test_one_adversarial_user_moves_the_sum_by_at_most_c_or_gc(algo_name, loss_name):
    G, C = 4, 0.7
    algo = {
        "uls": ULS(G, 0.5),
        "els": ELS(G, 0.5),
        "fedavg": FedAvg(G, 0.5, local_epochs=2, local_lr=0.3, local_batch_size=2),
        "fedavg_reproject": FedAvg(G, 0.5, local_epochs=2, local_lr=0.3, local_batch_size=2, reproject=True),
        "fedavg_weighted": FedAvg(G, 0.5, local_epochs=1, local_lr=0.5, weight_cap=2.0),
    }[algo_name]
    loss = linear_loss if loss_name == "linear" else sq_loss
    d = 5
    base = user_data([3, 1, 6, 2, 9, 4], d=d, seed=1)
    g = torch.Generator().manual_seed(7)
    worst = 0.0
    for trial in range(4):
        direction = torch.randn(d, generator=g)
        direction /= direction.norm()
        scale = [1e-3, 0.5, 1e3, 1e6][trial]
        # FedAvg mini-batches shuffle every user's records from the step's generator: an adversary
        # with more than G records would consume draws first and reshuffle the others, so it gets G
        n_adv = G if algo_name in ("fedavg", "fedavg_reproject") else 10
        with_adv = _with_adversary(base, n_records=n_adv, direction=direction, scale=scale)
        init = torch.randn(d, generator=g)
        s_without, _ = _pre_noise_sum(Mean(d, init), base, loss, algo, FlatClip(C))
        s_with, run = _pre_noise_sum(Mean(d, init), with_adv, loss, algo, FlatClip(C))
        # the other users' units are identical in both runs (same seed, adversary is the last user)
        diff = float((s_with - s_without).norm())
        bound = C * (G if algo_name == "els" else 1)
        assert diff <= bound * (1 + 1e-5), (algo_name, scale, diff, bound)
        worst = max(worst, diff)
    # the bound is attained for huge aligned updates (linear loss): G*C under ELS, C otherwise
    if loss_name == "linear":
        assert worst >= 0.99 * C * (G if algo_name == "els" else 1)


def test_per_layer_sum_sensitivity_is_total_bound():
    data = mlp_data([3, 5, 2, 7], seed=2)
    x = torch.cat([data.tensors["x"], torch.full((6, 6), 1e4)])
    y = torch.cat([data.tensors["y"], torch.zeros(6, dtype=torch.long)])
    adv = TensorUserData({"x": x, "y": y}, np.concatenate([data.offsets, [data.offsets[-1] + 6]]))
    torch.manual_seed(0)
    m = MLP()
    state = {k: v.clone() for k, v in m.state_dict().items()}
    clip = PerLayerClip(2.0)
    a, _ = _pre_noise_sum(m, data, ce_loss, ULS(4, 0.5), clip)
    m2 = MLP()
    m2.load_state_dict(state)
    b, run = _pre_noise_sum(m2, adv, ce_loss, ULS(4, 0.5), clip)
    assert float((a - b).norm()) <= 2.0 * (1 + 1e-5)
    assert run._sensitivity() == pytest.approx(2.0)


@pytest.mark.parametrize("normalized", [False, True])
def test_noise_std_per_coordinate_is_sigma_c_over_denominator(normalized):
    d, sigma, C, N, q = 20000, 1.7, 0.3, 40, 0.25
    data = user_data([2] * N, d=1, seed=0)
    zero_loss = lambda model, batch: (model.theta * 0.0).sum() * batch["x"][:, 0]  # gradient 0 everywhere
    m = Mean(d)
    cfg = TrainConfig(
        algorithm=ULS(2, q),
        steps=1,
        clipping=FlatClip(C, normalized=normalized),
        optimizer=SGD(lr=1.0),
        noise_multiplier=sigma,
        delta=1e-5,
        seed=123,
        accountant="rdp",
        performance=Performance(track_epsilon=False),
    )
    res = train(m, data, zero_loss, cfg)
    noise = -m.theta.detach().double()
    expected = sigma * (1.0 if normalized else C) / (q * N)
    assert res.record["denominator"] == pytest.approx(q * N)
    assert noise.mean().abs() < 4 * expected / math.sqrt(d)
    assert noise.std().item() == pytest.approx(expected, rel=0.03)
    assert (noise != 0).all()  # every coordinate, also those with zero gradient


def test_clipped_denominator_noise_scale():
    d, sigma, C, N, q = 20000, 1.0, 0.5, 50, 0.2
    data = user_data([1] * N, d=1)
    zero_loss = lambda model, batch: (model.theta * 0.0).sum() * batch["x"][:, 0]
    m = Mean(d)
    cfg = TrainConfig(
        algorithm=ULS(1, q),
        steps=1,
        clipping=FlatClip(C),
        optimizer=SGD(lr=1.0),
        noise_multiplier=sigma,
        delta=1e-5,
        seed=5,
        denominator=ClippedDenominator(0.5),
        accountant="rdp",
        performance=Performance(track_epsilon=False),
    )
    train(m, data, zero_loss, cfg)
    assert m.theta.detach().std().item() == pytest.approx(2 * sigma * C / (q * N * 0.5), rel=0.03)


def test_poisson_cohort_sizes_follow_binomial():
    N, q, T = 300, 0.07, 4000
    rng = np.random.default_rng(11)
    sizes = np.array([len(Poisson().sample(N, q, t, rng, {})) for t in range(T)])
    counts = np.bincount(sizes, minlength=N + 1)
    pmf = stats.binom.pmf(np.arange(N + 1), N, q)
    # pool the tails so every expected count >= 5, then a chi-square goodness-of-fit test
    exp = pmf * T
    keep = exp >= 5
    obs = np.append(counts[keep], counts[~keep].sum())
    ex = np.append(exp[keep], exp[~keep].sum())
    p = stats.chisquare(obs, ex * obs.sum() / ex.sum()).pvalue
    assert p > 1e-3
    assert sizes.mean() == pytest.approx(N * q, abs=4 * math.sqrt(N * q * (1 - q) / T))


@pytest.mark.slow
def test_engine_cohorts_are_poisson_and_buckets_pad():
    N, q = 120, 0.1
    data = user_data([2] * N, d=2)
    res = train(
        Mean(2),
        data,
        sq_loss,
        TrainConfig(
            algorithm=ULS(2, q),
            steps=300,
            noise_multiplier=1.0,
            delta=1e-5,
            seed=3,
            accountant="rdp",
            performance=Performance(chunk_size=8, track_epsilon=False),
        ),
    )
    units = np.array([h["units"] for h in res.history])
    assert units.var() > 0  # variable cohorts, not a fixed batch
    assert units.mean() == pytest.approx(N * q, abs=4 * math.sqrt(N * q * (1 - q) / 300))
    assert units.var() == pytest.approx(N * q * (1 - q), rel=0.3)
    assert [bucket_size(k, 8) for k in [1, 2, 3, 5, 8, 9]] == [1, 2, 4, 8, 8, 8]


def test_ledger_refuses_a_step_past_the_budget():
    ev = accounting.uls_step_event(1.0, 0.05)
    led = PrivacyLedger(ev, 1e-5, target_epsilon=1.0, accountant="rdp")
    n = 0
    with pytest.raises(BudgetExceededError):
        for _ in range(100000):
            led.record_step()
            n += 1
    assert n == led.max_steps() == led.spent
    assert led.epsilon() <= 1.0 < accounting.epsilon(accounting.compose(ev, n + 1), 1e-5, "rdp")
    assert led.epsilon_upper_bound() >= led.epsilon() - 1e-9


def test_a_run_far_inside_its_budget_steps_without_searching_for_the_most_steps(monkeypatch):
    """A fixed sigma under a loose target took 22 s of PLD search before its first step: the ledger
    now admits a step once twice the steps asked for fit, and searches only near the budget,
    where its answer is the search's to the step."""
    ev = accounting.uls_step_event(1.5, 0.1)
    searches = []
    search = accounting.max_steps
    monkeypatch.setattr(accounting, "max_steps", lambda *a, **k: searches.append(1) or search(*a, **k))
    far = PrivacyLedger(ev, 1e-5, target_epsilon=50.0)
    for _ in range(20):
        far.record_step()
    assert searches == [] and far.spent == 20
    near_target = accounting.epsilon(accounting.compose(ev, 12), 1e-5, "pld")
    near = PrivacyLedger(ev, 1e-5, target_epsilon=near_target)
    with pytest.raises(BudgetExceededError):
        for _ in range(100):
            near.record_step()
    assert near.spent == near.max_steps() == 12 and len(searches) == 1


@pytest.mark.slow
def test_train_stops_before_the_budget():
    data = user_data([3] * 50, d=2)
    res = train(
        Mean(2),
        data,
        sq_loss,
        TrainConfig(
            algorithm=ULS(3, 0.1),
            steps=10000,
            noise_multiplier=1.5,
            target_epsilon=2.0,
            delta=1e-5,
            seed=0,
            accountant="rdp",
            performance=Performance(track_epsilon=False),
        ),
    )
    assert res.stopped == "budget" and 0 < res.steps < 10000
    assert res.epsilon <= 2.0
    ev = accounting.uls_step_event(1.5, 0.1)
    assert accounting.epsilon(accounting.compose(ev, res.steps + 1), 1e-5, "rdp") > 2.0


def test_calibrated_sigma_meets_target_and_adaptive_split():
    data = user_data([2] * 400, d=2)
    from userdp.accounting.split import effective_noise_multiplier
    from userdp.engine import AdaptiveClip

    res = train(
        Mean(2),
        data,
        sq_loss,
        TrainConfig(
            algorithm=ULS(2, 0.1),
            steps=20,
            target_epsilon=3.0,
            delta=1e-5,
            seed=0,
            clipping=AdaptiveClip(),
            accountant="rdp",
            performance=Performance(track_epsilon=False),
        ),
    )
    assert res.epsilon <= 3.0 and res.epsilon > 2.8
    assert res.record["count_noise_stddev"] == pytest.approx(40 / 20)  # sigma_b = m/20
    assert effective_noise_multiplier(res.update_noise_multiplier, 2.0) == pytest.approx(res.noise_multiplier)
    assert res.update_noise_multiplier > res.noise_multiplier
    # a cohort too small for the split (2*sigma_b <= z) is refused with a clear error
    with pytest.raises(UserError, match="count noise"):
        train(
            Mean(2),
            user_data([2] * 100, d=2),
            sq_loss,
            TrainConfig(
                algorithm=ULS(2, 0.1),
                steps=20,
                noise_multiplier=1.2,
                delta=1e-5,
                clipping=AdaptiveClip(),
                accountant="rdp",
            ),
        )


@pytest.mark.slow
def test_shuffle_and_fixed_size_records_say_so():
    data = user_data([2] * 40, d=2)
    for sampling, acc in [("shuffle", "pld"), ("fixed_size", "rdp")]:
        res = train(
            Mean(2),
            data,
            sq_loss,
            TrainConfig(
                algorithm=ULS(2, 0.25),
                steps=5,
                noise_multiplier=2.0,
                delta=1e-5,
                seed=0,
                sampling=sampling,
                accountant=acc,
                performance=Performance(track_epsilon=False),
            ),
        )
        r = res.record
        assert r["sampler_mode"] in ("shuffle_fixed_batches", "fixed_size_wor")
        if sampling == "shuffle":  # the headline is the guarantee that holds without amplification
            assert r["epsilon"] == r["epsilon_no_amplification"]
            assert r["epsilon_assuming_poisson"] < r["epsilon"]
        else:
            assert "epsilon_no_amplification" in r and r["epsilon_no_amplification"] > r["epsilon"]
        assert "sampling_warning" in r
        assert all(h["units"] == 10 for h in res.history)
    assert "poisson" in r["sampling_warning"].lower() or "replace-one" in r["sampling_warning"]
    with pytest.raises(UserError):
        TrainConfig(algorithm=ULS(2, 0.25), steps=5, noise_multiplier=1.0, sampling="fixed_size")
    with pytest.raises(UserError):
        TrainConfig(algorithm=ULS(2, 0.25), steps=5, noise_multiplier=1.0, sampling="bogus")


def test_seed_is_recorded_and_unseeded_runs_differ():
    data = user_data([2] * 30, d=3)
    cfg = TrainConfig(
        algorithm=ULS(2, 0.3),
        steps=3,
        noise_multiplier=1.0,
        delta=1e-5,
        accountant="rdp",
        performance=Performance(track_epsilon=False),
    )
    a, b = Mean(3), Mean(3)
    ra = train(a, data, sq_loss, cfg)
    train(b, data, sq_loss, cfg)
    assert not ra.record["seeded"] and "entropy" in ra.record["randomness"]
    assert not torch.equal(a.theta, b.theta)
    import dataclasses

    rs = train(Mean(3), data, sq_loss, dataclasses.replace(cfg, seed=4))
    assert rs.record["seeded"] and "seed" in rs.record["randomness"]


def test_batchnorm_in_training_mode_is_refused():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    data = user_data([2] * 10, d=3)
    loss = lambda m, b: m(b["x"]).sum(-1)
    cfg = TrainConfig(
        algorithm=ULS(2, 0.5),
        steps=1,
        noise_multiplier=1.0,
        delta=1e-5,
        accountant="rdp",
        performance=Performance(track_epsilon=False),
    )
    with pytest.raises(UserError, match="BatchNorm1d"):
        train(model, data, loss, cfg)
    model[1].eval()  # frozen statistics: allowed
    train(model, data, loss, cfg)


def test_the_privacy_record_is_one_frozen_type_that_reads_like_its_json():
    """train() returns a PrivacyRecord: frozen, every key of its JSON readable by index, the fields
    that do not apply absent (here Poisson: no sampling warning), a change is a new record."""
    res = train(
        Mean(2),
        user_data([2] * 40, d=2),
        sq_loss,
        TrainConfig(algorithm=ULS(2, 0.25), steps=3, noise_multiplier=2.0, delta=1e-5, seed=0),
    )
    rec = res.record
    assert isinstance(rec, PrivacyRecord)
    with pytest.raises(dataclasses.FrozenInstanceError):
        rec.epsilon = 0.0
    as_json = json.loads(json.dumps(rec.to_dict(), allow_nan=False))
    assert set(as_json) == set(rec) and all(as_json[k] == json.loads(json.dumps(rec[k])) for k in rec)
    assert rec["epsilon"] == rec.epsilon == res.epsilon > 0 and rec.stopped == "completed"
    assert "sampling_warning" not in rec and rec.get("sampling_warning") is None
    with pytest.raises(KeyError):
        rec["sampling_warning"]
    later = rec.replace(stopped="interrupted")
    assert later["stopped"] == "interrupted" and rec["stopped"] == "completed"
    rec.to_dict()["algorithm"]["sampling_rate"] = 9.0  # the JSON is a copy: the record is unchanged
    assert rec.algorithm["sampling_rate"] == 0.25
