"""`userdp tune`: the trial-count distributions (chi-squared), Papernot & Steinke's bounds against
a direct computation, refusals, the search space, and a resume that never re-draws."""

import json
import math

import numpy as np
import pytest
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib
from scipy import stats

from userdp.accounting.selection import TrialCount, selection_rdp
from userdp.cli import main as cli
from userdp.errors import UserError
from userdp.tuning import accounting as TA
from userdp.tuning.space import parse_space

from _lm_corpus import interrupt_after_checkpoint, tiny_config, write_tiny_corpus, write_tiny_run

ORDERS = TA.ORDERS


@pytest.mark.parametrize(
    "count",
    [
        TrialCount.with_mean("tnb", 6, 1.0),
        TrialCount.with_mean("tnb", 6, 0.5),
        TrialCount.with_mean("tnb", 6, 0.0),
        TrialCount("poisson", mu=6.0),
    ],
)
def test_trial_count_matches_its_distribution(count):
    """Chi-squared goodness of fit of 20,000 draws (fixed seed) against the pmf; the pmf sums to 1
    and its mean is the closed form."""
    rng = np.random.default_rng(20261123)
    draws = np.array([count.sample(rng) for _ in range(20000)])
    ks = np.arange(0, 400)
    pmf = count.pmf(ks)
    assert pmf.sum() == pytest.approx(1.0, abs=1e-6)
    assert (ks * pmf).sum() == pytest.approx(count.mean(), rel=1e-5)
    edges = [k for k in range(60) if pmf[k] * 20000 >= 5]
    obs = [int((draws == k).sum()) for k in edges] + [int((~np.isin(draws, edges)).sum())]
    exp = [pmf[k] * 20000 for k in edges] + [20000 * (1 - pmf[edges].sum())]
    assert stats.chisquare(obs, exp).pvalue > 1e-3
    if count.kind == "tnb":
        assert draws.min() >= 1


def _tnb_direct(rho, count):
    """Their Theorem 2, written out with loops and E[K] from the pmf."""
    ek = float((np.arange(1, 5000) * count.pmf(np.arange(1, 5000))).sum())
    inner = min((1 - 1 / lh) * rho[j] + math.log(1 / count.gamma) / lh for j, lh in enumerate(ORDERS) if lh >= 1)
    return np.array(
        [
            rho[i] + (1 + count.eta) * inner + math.log(ek) / (lam - 1) if lam > 1 else np.inf
            for i, lam in enumerate(ORDERS)
        ]
    )


@pytest.mark.parametrize("eta", [0.0, 0.5, 1.0, 2.0])
def test_tnb_bound_is_the_theorem(eta):
    sigma = 3.0
    rho = ORDERS / (2 * sigma**2)  # a Gaussian mechanism's RDP
    count = TrialCount.with_mean("tnb", 10, eta)
    got = selection_rdp(ORDERS, rho, count)
    want = _tnb_direct(rho, count)
    ok = ORDERS > 1
    assert np.allclose(got[ok], want[ok], rtol=1e-6)


def test_poisson_bound_uses_a_valid_delta_hat():
    sigma, mu = 3.0, 5.0
    rho = ORDERS / (2 * sigma**2)
    got = selection_rdp(ORDERS, rho, TrialCount("poisson", mu=mu))
    for i in [5, 20, 40]:
        lam = ORDERS[i]
        eps_hat = math.log1p(1 / (lam - 1))
        # the exact delta of a Gaussian mechanism at eps_hat: the RDP-derived one used is never below it
        exact = stats.norm.cdf(-eps_hat * sigma + 1 / (2 * sigma)) - math.exp(eps_hat) * stats.norm.cdf(
            -eps_hat * sigma - 1 / (2 * sigma)
        )
        lower = rho[i] + mu * exact + math.log(mu) / (lam - 1)
        d_hat = float(rdp_lib.compute_delta(ORDERS, rho, eps_hat)[0])
        assert got[i] >= lower - 1e-12
        assert got[i] == pytest.approx(rho[i] + mu * d_hat + math.log(mu) / (lam - 1))


def test_total_epsilon_against_direct_conversion_and_against_one_run():
    sigma, delta = 4.0, 1e-5
    rho = ORDERS / (2 * sigma**2)
    count = TrialCount.with_mean("tnb", 8, 1.0)
    total = TA.total_epsilon([rho], count, delta)
    want, _ = rdp_lib.compute_epsilon(ORDERS, _tnb_direct(rho, count), delta)
    assert total == pytest.approx(want, rel=1e-9)
    one, _ = rdp_lib.compute_epsilon(ORDERS, rho, delta)
    assert total > one  # selection is never free
    # the max over mechanisms: a noisier second mechanism changes nothing, a less noisy one does
    assert TA.total_epsilon([rho, rho / 2], count, delta) == pytest.approx(total)
    assert TA.total_epsilon([rho, rho * 2], count, delta) > total
    # more trials on average cost more
    assert TA.total_epsilon([rho], TrialCount.with_mean("tnb", 30, 1.0), delta) > total


def test_a_budget_below_the_selection_floor_is_refused():
    count = TrialCount.with_mean("tnb", 8, 1.0)
    floor = TA.floor_epsilon(count, 1e-5)
    assert floor > 0
    with pytest.raises(UserError, match="cannot cover tuning"):
        TA.calibrate(lambda k, tau: None, ["m"], count, 1e-5, floor * 0.9)


def test_space_parsing_and_refusals():
    s = parse_space(
        {"training.lr": {"log_uniform": [1e-4, 1e-2]}, "training.group_size": [2, 4], "training.cohort_size": [16, 32]}
    )
    assert len(s.mechanisms()) == 4
    rng = np.random.default_rng(0)
    lrs = [s.draw(rng)["training.lr"] for _ in range(2000)]
    assert min(lrs) >= 1e-4 and max(lrs) <= 1e-2
    # log-uniform: log10(lr) uniform on [-4, -2]
    assert stats.kstest((np.log10(lrs) + 4) / 2, "uniform").pvalue > 1e-3
    for bad, msg in [
        ({"privacy.epsilon": [1, 2]}, "cannot be tuned"),
        ({"data.path": ["x"]}, "cannot be tuned"),
        ({"training.steps": {"uniform": [10, 20]}}, "changes the privacy mechanism"),
        ({"training.lr": {"log_uniform": [0, 1]}}, "low > 0"),
        ({"training.lr": []}, "empty list"),
        ([1, 2], "expected a mapping"),
    ]:
        with pytest.raises(UserError, match=msg):
            parse_space(bad)


# ---------------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tune")
    cfg, _ = write_tiny_run(tmp, "  checkpoint_every: 1\n")
    space = tmp / "space.yaml"
    space.write_text("training.lr: {log_uniform: [0.0001, 0.01]}\ntraining.group_size: [1, 2]\n")
    return tmp, cfg, space


@pytest.fixture
def tiny(tiny_files, tmp_path, monkeypatch):
    shared, cfg, space = tiny_files
    monkeypatch.setenv("USERDP_CACHE", str(shared / "cache"))
    return tmp_path, cfg, space


def _seed_with_trials(k_wanted, count):
    """A seed whose first draw gives k_wanted trials (the job draws K first)."""
    for seed in range(10000):
        if count.sample(np.random.default_rng(np.random.SeedSequence(seed))) == k_wanted:
            return seed
    raise AssertionError


@pytest.mark.heavy(
    counterpart="tests/tuning/test_tuning.py::test_total_epsilon_against_direct_conversion_and_against_one_run"
)
@pytest.mark.slow
def test_an_interrupted_tuning_run_resumes_without_redrawing(tiny, monkeypatch, capsys):
    tmp, cfg, space = tiny
    import userdp.lm.training as F
    import userdp.tuning.job as J
    from userdp.accounting.selection import TrialCount as TC

    seed = _seed_with_trials(2, TC.with_mean("tnb", 2.0, 1.0))
    monkeypatch.setattr(J.secrets, "randbits", lambda n: seed)
    names = iter(["trial-" + "0" * 15 + c for c in "ab"])  # the folder names drawn at random, fixed here
    monkeypatch.setattr(J, "trial_dir_name", lambda: next(names))
    real = interrupt_after_checkpoint(monkeypatch, 2, where="0b")  # the second trial dies at its step 2
    out = tmp / "tune"
    argv = [
        "tune",
        str(cfg),
        "--search",
        str(space),
        "--epsilon",
        "8",
        "--mean-trials",
        "2",
        "--output",
        str(out),
        "--no-progress",
    ]
    assert cli(argv) == 130
    plan = json.loads((out / "tune.json").read_text())
    assert plan["trials_planned"] == 2 and plan["trials"][0]["score"] is not None
    assert plan["trials"][1].get("score") is None
    # a resume never draws again: any draw now fails the test
    monkeypatch.setattr(F, "_save_weights", real)
    monkeypatch.setattr(J.secrets, "randbits", lambda n: (_ for _ in ()).throw(AssertionError("re-drawn")))
    monkeypatch.setattr(TC, "sample", lambda self, rng: (_ for _ in ()).throw(AssertionError("re-drawn")))
    capsys.readouterr()
    assert cli(["tune", "--resume", str(out), "--json", "--no-progress"]) == 0
    s = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    after = json.loads((out / "tune.json").read_text())
    assert [t["params"] for t in after["trials"]] == [t["params"] for t in plan["trials"]]
    # the headline is the released model's guarantee (selection leaks): private selection with the
    # number of trials secret (issue 34, C3), never one trial's own epsilon; no released file names K
    assert 0 < s["epsilon_one_trial"] < s["epsilon_total"] <= 8.0
    assert s["epsilon_total"] == s["epsilon_selection_bound"]
    for key in ("trials_run", "trial_mechanisms", "epsilon_trials_run_composed", "released_bound"):
        assert key not in s
    assert after["epsilon_if_trials_published"] > 0  # the workspace's own record keeps what publishing costs
    assert "epsilon_final_model" not in s
    assert s["best"]["heldout_loss"] == min(t["score"] for t in after["trials"])
    # the released run's report states the tuning guarantee as its headline
    best = out / "best"
    priv = json.loads((best / "privacy.json").read_text())
    assert priv["tuning"]["epsilon_total"] == s["epsilon_total"] == priv["epsilon_total"]
    assert not any(n.startswith("hyperparameter tuning") for n in priv["not_accounted"])
    capsys.readouterr()
    assert cli(["report", str(best), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["epsilon_total"] == pytest.approx(s["epsilon_total"], rel=1e-9)
    # issue 34 (L2): "epsilon" is the released model's guarantee in --json too; the trial's is epsilon_run
    assert rep["epsilon"] == rep["epsilon_total"] and rep["epsilon_run"] == pytest.approx(s["epsilon_one_trial"])
    assert rep["tier"]["meaning"] == priv["tier"]["meaning"]
    assert cli(["report", str(best)]) == 0
    md = capsys.readouterr().out
    headline = md.split("## 1.")[0]
    assert f"({s['epsilon_total']:.4g}, " in headline and "drawn in secret" in headline
    assert "2 trials" not in md and "trials_run" not in (best / "privacy.json").read_text()
    assert "not a guarantee for the selected model" in headline
    # the tuning figure is re-derived: an edited one is refused
    good = (best / "privacy.json").read_text()
    rec = json.loads(good)
    rec["tuning"]["epsilon_total"] = s["epsilon_one_trial"]
    (best / "privacy.json").write_text(json.dumps(rec))
    assert cli(["report", str(best)]) == 2
    assert "privacy.json (tuning): epsilon_total" in capsys.readouterr().err
    (best / "privacy.json").write_text(good)
    rows = json.loads((out / "results.json").read_text())
    assert len(rows) == 2 and (out / "results.csv").is_file() and (out / "scores.png").is_file()
    # a second tuning run into the same directory is refused
    assert cli(argv) == 2


def test_bad_tune_input_is_one_line_and_exit_2(tiny, capsys):
    tmp, cfg, space = tiny
    bad_space = tmp / "bad.yaml"
    bad_space.write_text("training.lr: [\n")
    cases = [
        (["tune", str(cfg), "--epsilon", "3"], "--search"),
        (["tune", str(cfg), "--search", str(space)], "--epsilon"),
        (["tune", str(cfg), "--search", str(bad_space), "--epsilon", "3"], "bad.yaml"),
        (["tune", str(cfg), "--search", str(space), "--epsilon", "0.01"], "cannot cover"),
        (["tune", str(cfg), "--search", str(space), "--epsilon", "3", "--on", "public"], "--public-config"),
        (["tune", "--resume", str(tmp / "nowhere")], "nowhere"),
    ]
    for argv, needle in cases:
        assert cli(argv + ["--no-progress"]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert needle in err[-1] and err[-1].startswith("userdp: error:"), (argv, err)


@pytest.mark.heavy(
    counterpart="tests/tuning/test_tuning.py::test_total_epsilon_against_direct_conversion_and_against_one_run"
)
@pytest.mark.slow
def test_on_public_tunes_on_public_data_and_touches_the_private_data_once(tiny, capsys):
    tmp, cfg, space = tiny
    pub_dir = tmp / "public_users"
    pub_dir.mkdir()
    data, public = write_tiny_corpus(pub_dir)
    copy_cfg = tmp / "copy.yaml"  # the private file byte for byte under another name: refused
    copy_cfg.write_text(tiny_config(data, public))
    assert (
        cli(
            [
                "tune",
                str(cfg),
                "--search",
                str(space),
                "--epsilon",
                "3",
                "--on",
                "public",
                "--public-config",
                str(copy_cfg),
                "--output",
                str(tmp / "tune_copy"),
                "--no-progress",
            ]
        )
        == 2
    )
    assert "same content as the private data" in capsys.readouterr().err
    lines = data.read_text().splitlines()  # the same people, one record edited: refused by user overlap
    data.write_text("\n".join([json.dumps({"user": "u0", "text": "an edited record"})] + lines[1:]) + "\n")
    assert (
        cli(
            [
                "tune",
                str(cfg),
                "--search",
                str(space),
                "--epsilon",
                "3",
                "--on",
                "public",
                "--public-config",
                str(copy_cfg),
                "--output",
                str(tmp / "tune_copy"),
                "--no-progress",
            ]
        )
        == 2
    )
    assert "are users of the private data" in capsys.readouterr().err
    # other people (every author renamed, so neither the content nor the users are the private data's)
    data.write_text(data.read_text().replace('"user": "u', '"user": "public-'))
    pub_cfg = tmp / "public.yaml"
    pub_cfg.write_text(tiny_config(data, public))
    out = tmp / "tune_pub"
    assert (
        cli(
            [
                "tune",
                str(cfg),
                "--search",
                str(space),
                "--epsilon",
                "3",
                "--mean-trials",
                "2",
                "--on",
                "public",
                "--public-config",
                str(pub_cfg),
                "--output",
                str(out),
                "--json",
                "--no-progress",
            ]
        )
        == 0
    )
    s = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    plan = json.loads((out / "tune.json").read_text())
    # every trial trained on the public config's data; one run (final/) on the private data
    for t in plan["trials"]:
        assert str(data) in (out / "trials" / t["dir"] / "config.yaml").read_text()
    final = out / "final"
    assert s["best"]["run_dir"] == str(final) and (out / "best").resolve() == final.resolve()
    assert str(pub_dir) not in (final / "config.yaml").read_text()
    priv = json.loads((final / "privacy.json").read_text())
    assert s["epsilon_total"] == s["epsilon_final_model"] == priv["epsilon"] <= 3.0
    assert "touched once" in priv["tuning_guarantee"]
    assert s["best"]["params"] == plan["trials"][plan["final"]["index"]]["params"]


@pytest.mark.heavy(
    counterpart="tests/tuning/test_tuning.py::test_total_epsilon_against_direct_conversion_and_against_one_run"
)
@pytest.mark.slow
def test_trials_share_one_private_cache_in_the_tuning_directory(tiny, monkeypatch):
    """Issue 28 (1): with output.cache: run every trial re-read and re-tokenized the private file;
    trials of one tuning run share the tuning directory's cache (still in the user's directory)."""
    import userdp.tuning.job as J
    from userdp.caches import run_cache, shared_run_cache

    seed = _seed_with_trials(2, TrialCount.with_mean("tnb", 2.0, 1.0))
    monkeypatch.setattr(J.secrets, "randbits", lambda n: seed)

    tmp, cfg, space = tiny
    assert run_cache(tmp / "r") == tmp / "r" / "cache"
    with shared_run_cache(tmp / "shared"):
        assert run_cache(tmp / "r") == tmp / "shared"
    out = tmp / "tune_cache"
    assert (
        cli(
            [
                "tune",
                str(cfg),
                "--search",
                str(space),
                "--epsilon",
                "8",
                "--mean-trials",
                "2",
                "--set",
                "output.cache=run",
                "--output",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    plan = json.loads((out / "tune.json").read_text())
    trials = [out / "trials" / t["dir"] for t in plan["trials"]]
    assert len(trials) == 2 and all((d / "privacy.json").is_file() for d in trials)
    # one private cache for both trials, inside the tuning directory; none in the trial directories
    assert (out / "cache").is_dir() and any((out / "cache").iterdir())
    assert all(not (d / "cache").exists() for d in trials)
