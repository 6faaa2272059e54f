"""Tests of the synthetic experiments (SPEC §7.1, §7.2)."""

import json
import math

import numpy as np
import pytest

from userdp.errors import UserError
from userdp.experiments import mean_estimation as me
from userdp.experiments import variance as va

# ------------------------------------------------------------------ variance (SPEC §7.1)


def test_variance_rows_match_the_direct_variances(monkeypatch):
    # inject sigma functions so the test checks the bookkeeping and eq. (7), not the accountant
    monkeypatch.setattr(va, "els_noise_multiplier", lambda p, g, t, e, d, a: 10.0 / e)
    monkeypatch.setattr(va, "uls_sigma_of_m", lambda n, t, e, d, a: lambda m: (1.0 + m / 100) / e)
    cfg = va.VarianceConfig(
        num_users=1000, max_group_size=32, els_group_size=8, compute_budget=256, steps=10, epsilons=(1.0, 4.0)
    )
    rows = va.run(cfg)
    assert sorted({r.cohort_size for r in rows}) == [8, 16, 32, 64, 128, 256]
    d, L, B = 50, 1.0, 256
    for r in rows:
        assert r.group_size_uls * r.cohort_size == B
        assert r.sampling_rate_els == pytest.approx(B / (1000 * 8))
        assert r.sampling_rate_uls == pytest.approx(r.cohort_size / 1000)
        var_els = d * r.sigma_els**2 * L**2 / B**2
        for key, l_g in (("ratio_identical", 1.0), ("ratio_orthogonal", 1 / math.sqrt(r.group_size_uls))):
            var_uls = d * r.sigma_uls**2 * l_g**2 * r.group_size_uls**2 / B**2
            assert getattr(r, key) == pytest.approx(var_uls / var_els, rel=1e-12)
    # orthogonal gradients always favour ULS by a factor G relative to identical ones
    for r in rows:
        assert r.ratio_orthogonal == pytest.approx(r.ratio_identical / r.group_size_uls)


@pytest.mark.slow
def test_variance_with_the_accountant_shows_the_papers_pattern():
    # one real (PLD) comparison at G_ULS = 1 vs large G: with identical within-user gradients
    # ELS is better at large G_ULS; at G_ULS = 1 (q = B/N) ULS ~ ELS (sigma_ELS almost G-free
    # under PLD, SPEC §5.1)
    cfg = va.VarianceConfig(
        num_users=2000,
        max_group_size=16,
        els_group_size=4,
        compute_budget=64,
        steps=200,
        delta=1e-5,
        epsilons=(2.0,),
        cohort_sizes=(4, 64),
        accountant="rdp",
    )  # RDP keeps this test cheap
    rows = {r.cohort_size: r for r in va.run(cfg)}
    assert rows[4].ratio_identical > 1.5
    # (RDP overstates the MoG sigma a little, so at G_ULS = 1 ULS is no worse than ELS)
    assert 0.5 < rows[64].ratio_identical < 1.1
    assert rows[4].ratio_identical > 2 * rows[64].ratio_identical
    assert rows[4].ratio_orthogonal < rows[4].ratio_identical


def test_variance_config_errors_name_the_option():
    from userdp.errors import UserError

    with pytest.raises(UserError, match="--els-group-size"):
        va.VarianceConfig(els_group_size=100, max_group_size=64).validate()
    with pytest.raises(UserError, match="does not divide"):
        va.VarianceConfig(cohort_sizes=(3,), compute_budget=1024).validate()


# ------------------------------------------------------------------ mean estimation (SPEC §7.2)


def test_generator_shapes_and_heavy_tail():
    cfg = me.MeanEstimationConfig(dimension=5, num_users=300, records_per_user=8, heavy_tailed=True)
    data = me.generate(cfg, np.random.default_rng(0))
    assert data.records.shape == (data.sizes.sum(), 5)
    assert data.offsets[-1] == data.sizes.sum() and data.sizes.min() >= 1
    assert np.median(data.sizes) == pytest.approx(8, abs=2)
    assert data.sizes.max() > 4 * np.median(data.sizes)  # heavy tail
    # within-user variance is what was asked for
    cfg2 = me.MeanEstimationConfig(dimension=3, num_users=50, records_per_user=400, within_user_variance=4.0)
    d2 = me.generate(cfg2, np.random.default_rng(1))
    owner = np.repeat(np.arange(50), d2.sizes)
    resid = d2.records - d2.user_means[owner]
    assert resid.var() == pytest.approx(4.0, rel=0.05)


def test_noiseless_uls_converges_to_the_average_user_mean():
    # sigma = 0, clip far above every gradient, lr = 1, G >= every user's size, q = 1: each step
    # is a full gradient step to the average of the users' sample means
    cfg = me.MeanEstimationConfig(
        dimension=4, num_users=20, records_per_user=5, steps=3, compute_budget=100, uls_group_sizes=(5,)
    )
    data = me.generate(cfg, np.random.default_rng(2))
    from userdp.engine import ULS

    loss, eps = me.train_once(
        data, ULS(group_size=5, sampling_rate=1.0), cfg, noise_multiplier=0.0, learning_rate=1.0, clip_norm=1e6, seed=0
    )
    target = np.mean([data.records[a:b].mean(0) for a, b in zip(data.offsets[:-1], data.offsets[1:], strict=True)], 0)
    assert loss == pytest.approx(float(np.sum((target - data.mu) ** 2)), rel=1e-4, abs=1e-8)
    assert eps == math.inf


def test_tail_averaging_reports_the_mean_of_the_last_iterates():
    # noiseless full-batch ULS at lr 0.5 from theta = 0: theta_t = target * (1 - 0.5**t) exactly;
    # average_fraction 0.5 of 4 steps reports (theta_3 + theta_4) / 2
    from dataclasses import replace

    from userdp.engine import ULS

    cfg = me.MeanEstimationConfig(
        dimension=4,
        num_users=20,
        records_per_user=5,
        steps=4,
        compute_budget=100,
        uls_group_sizes=(5,),
        average_fraction=0.5,
    )
    data = me.generate(cfg, np.random.default_rng(3))
    target = np.mean([data.records[a:b].mean(0) for a, b in zip(data.offsets[:-1], data.offsets[1:], strict=True)], 0)
    kw = dict(noise_multiplier=0.0, learning_rate=0.5, clip_norm=1e6, seed=0)
    alg = ULS(group_size=5, sampling_rate=1.0)
    avg, _ = me.train_once(data, alg, cfg, **kw)
    theta = target * (1 - (0.5**3 + 0.5**4) / 2)
    assert avg == pytest.approx(float(np.sum((theta - data.mu) ** 2)), rel=1e-4)
    final, _ = me.train_once(data, alg, replace(cfg, average_fraction=0.0), **kw)
    assert final == pytest.approx(float(np.sum((target * (1 - 0.5**4) - data.mu) ** 2)), rel=1e-4)
    with pytest.raises(UserError):
        replace(cfg, average_fraction=1.5).validate()


@pytest.mark.slow
def test_sigma_is_calibrated_once_per_setting_and_reused(monkeypatch):
    from userdp import accounting

    calls = []
    real = accounting.calibrate_noise_multiplier
    monkeypatch.setattr(accounting, "calibrate_noise_multiplier", lambda *a, **k: calls.append(1) or real(*a, **k))
    cfg = me.MeanEstimationConfig(
        dimension=3,
        num_users=100,
        records_per_user=4,
        steps=5,
        compute_budget=16,
        uls_group_sizes=(2,),
        els_group_size=1,
        learning_rates=(1.0,),
        clip_norms=(1.0, 2.0),
        trials=1,
        accountant="rdp",
    )
    rows = me.run_study(cfg, {"within_user_variance": (1.0,)})
    assert len(rows) == 4  # base (variance 10) + the swept variance, ELS and ULS each
    # ULS G=2 calibrated once, although it ran 2 clips x 2 variances times
    # (ELS's sigma goes through userdp.planning, which may calibrate in its own way)
    uls = [r["noise_multiplier"] for r in rows if r["algorithm"] == "ULS"]
    assert uls[0] == uls[1] > 0
    assert len(calls) <= 2


def test_noiseless_study_gets_close_to_the_population_mean():
    cfg = me.MeanEstimationConfig(
        dimension=4,
        num_users=200,
        records_per_user=8,
        steps=15,
        compute_budget=64,
        uls_group_sizes=(1, 8),
        learning_rates=(0.5,),
        clip_norms=(100.0,),
        trials=1,
        between_user_std=0.1,
        within_user_variance=1.0,
    )
    rows = me.run_study(cfg, {}, noise_multiplier=0.0)
    assert [r["algorithm"] for r in rows] == ["ELS", "ULS", "ULS"]
    assert rows[0]["group_size"] == 8  # the median records per user
    for r in rows:
        assert set(r) >= {"algorithm", "group_size", "within_user_variance", "epsilon", "loss"}
        # stationary SGD noise at lr 0.5 with ~64 records per step: E loss ~ (1/3)*d*(1+0.01)/64
        assert r["loss"] < 0.1
    json.dumps(rows)


def test_private_run_is_calibrated_and_noise_hurts():
    cfg = me.MeanEstimationConfig(
        dimension=4,
        num_users=200,
        records_per_user=4,
        steps=10,
        compute_budget=32,
        uls_group_sizes=(4,),
        els_group_size=1,
        learning_rates=(0.5,),
        clip_norms=(2.0,),
        trials=4,  # the mean loss over 4 datasets: with one, the sampling error can outweigh the noise
        epsilon=0.5,
        accountant="rdp",
    )
    private = me.run_setting(cfg)
    clean = me.run_setting(cfg, noise_multiplier=0.0)
    for p, c in zip(private, clean, strict=True):
        assert p["noise_multiplier"] > 0.5
        assert p["epsilon_spent"] <= 0.5 * 1.01
        assert p["loss"] > c["loss"]


def test_cli_mean_estimation_json_rows(capsys):
    from userdp.cli import main

    rc = main(
        [
            "experiment",
            "mean-estimation",
            "--users",
            "40",
            "--records-per-user",
            "4",
            "--dimension",
            "3",
            "--steps",
            "3",
            "--compute-budget",
            "8",
            "--uls-group-sizes",
            "1,2",
            "--learning-rates",
            "0.5",
            "--clip-norms",
            "10",
            "--trials",
            "1",
            "--no-sweeps",
            "--noise-multiplier",
            "0",
            "--json",
        ]
    )
    assert rc == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["algorithm"], r["group_size"]) for r in rows] == [("ELS", 4), ("ULS", 1), ("ULS", 2)]
    for r in rows:
        assert {"algorithm", "group_size", "within_user_variance", "epsilon", "loss"} <= set(r)
        assert math.isfinite(r["loss"])


def test_cli_variance_bad_option_is_one_line(capsys):
    from userdp.cli import main

    assert main(["experiment", "variance", "--els-group-size", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--els-group-size" in err[0]


def test_quick_settings_are_reduced_and_valid():
    base = me.MeanEstimationConfig()
    q, sweeps = me.quick_settings(base, {"epsilon": (0.25, 4.0)})
    q.validate()
    runs = lambda c, n: (
        (1 + len(c.uls_group_sizes)) * len(c.learning_rates) * len(c.clip_norms) * c.trials * c.steps * n
    )
    # at most a fifth of the default run's engine steps (the default sweeps 7 settings)
    assert runs(q, 1 + sum(len(v) for v in sweeps.values())) <= runs(base, 7) / 5
    assert list(sweeps) == ["within_user_variance"] and q.num_users <= 1000


@pytest.mark.heavy(counterpart="tests/experiments/test_synthetic.py::test_cli_mean_estimation_json_rows")
@pytest.mark.slow
def test_mean_estimation_quick_runs_as_docs_experiments_md_shows(capsys):
    # it always failed: --quick's check ran after the defaults were filled in (issue 26)
    import json

    from userdp.cli import main

    assert main(["experiment", "mean-estimation", "--quick", "--no-sweeps", "--json", "--dimension", "4"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["algorithm"] for r in rows} >= {"ELS", "ULS"}
    assert main(["experiment", "mean-estimation", "--quick", "--steps", "5000"]) == 2
    assert "--quick sets --steps itself" in capsys.readouterr().err
