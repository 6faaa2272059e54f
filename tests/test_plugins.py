"""Registries reach the edges (issue 26): a new accountant, per-unit strategy and ULS variant,
one file each in examples/plugins/, run through `userdp train` with no edit to userdp; plugins load
by --plugin (module or file), a config's plugins: key (modules only) and an entry-point group."""

import json
import math

import pytest
import torch
from _paths import REPO
from safetensors.torch import load_file

from userdp import plugins
from userdp.accounting import accountants
from userdp.accounting.events import event_from_dict
from userdp.cli import main
from userdp.engine import algorithms
from userdp.errors import UserError
from userdp.lm import config as C
from userdp.registry import Registry

from _lm_corpus import write_tiny_run

EXAMPLES = REPO / "examples" / "plugins"
# every test leaves the registries and the loaded plugins as it found them (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("isolated_registries")


# ------------------------------------------------------------------------------ the registry
def test_a_registry_registers_looks_up_and_refuses_with_a_did_you_mean():
    reg = Registry("widget", {"alpha": 1})

    @reg.register
    class Beta:
        name = "beta"

    assert (
        reg.names() == ("alpha", "beta")
        and reg.lookup("beta") is Beta
        and reg.choices("auto")() == ("auto", "alpha", "beta")
    )
    with pytest.raises(UserError, match=r"widget must be one of alpha, beta; did you mean beta\? \(got 'betaa'\)"):
        reg.lookup("betaa")
    with pytest.raises(UserError, match="a widget named 'beta' is already registered"):
        reg.register(type("Other", (), {"name": "beta"}))
    reg.register(type("Other", (), {"name": "beta"}), replace=True)
    assert reg.lookup("beta") is not Beta
    with pytest.raises(UserError, match="needs a non-empty string name"):
        reg.register(object())
    assert reg.get("nope") is None  # still a mapping


def test_the_config_and_the_cli_read_the_registries_names():
    algorithms.ALGORITHMS.pop("uls_recent", None)  # another module's test may have loaded it (restored after)
    with pytest.raises(UserError, match="training.algorithm must be one of uls, els, fedavg, nonprivate"):
        C.load_config(None, ["training.algorithm=uls_recent"])
    plugins.load(str(EXAMPLES / "recent_records.py"), source="test")
    assert C.load_config(None, ["training.algorithm=uls_recent"]).training.algorithm == "uls_recent"
    with pytest.raises(UserError, match=r"privacy.accountant must be one of .*\(did you mean rdp\?\)"):
        C.load_config(None, ["privacy.accountant=rdpp"])


# ------------------------------------------------------------------------------ loading
def test_plugin_load_errors_are_one_line(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("raise RuntimeError('half-written plugin')\n")
    with pytest.raises(UserError, match=r"--plugin: plugin '.*broken.py' failed to load \(RuntimeError: half-written"):
        plugins.load(str(bad), source="--plugin")
    needs = tmp_path / "needs.py"
    needs.write_text("import a_dependency_that_is_missing\n")
    with pytest.raises(UserError, match="failed to load .*ModuleNotFoundError"):
        plugins.load(str(needs), source="--plugin")
    with pytest.raises(UserError, match="no module named 'no_such_plugin_mod'"):
        plugins.load("no_such_plugin_mod", source="--plugin")
    with pytest.raises(UserError, match="not a module name"):
        plugins.load("not a module", source="--plugin")
    with pytest.raises(UserError, match="names plugins as importable modules, not files"):
        C.load_config(None, [f"plugins=[{EXAMPLES / 'integer_rdp.py'}]"])


def test_a_configs_plugins_key_loads_modules_before_its_choices_are_checked(tmp_path, monkeypatch):
    (tmp_path / "my_userdp_accountant.py").write_text(
        "from userdp.accounting import accountants as A\n"
        "class Copy(A.RDPAccountant):\n    name = 'rdp_copy'\n"
        "A.register_accountant(Copy())\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    f = tmp_path / "c.yaml"
    f.write_text("plugins: [my_userdp_accountant]\nprivacy:\n  accountant: rdp_copy\n")
    cfg = C.load_config(f)
    assert cfg.plugins == ("my_userdp_accountant",) and cfg.privacy.accountant == "rdp_copy"
    assert "my_userdp_accountant" in plugins.loaded()


def test_an_installed_packages_entry_point_is_loaded_by_the_cli(tmp_path, monkeypatch, capsys):
    site = tmp_path / "site"
    (site / "fake_userdp_plugin-1.0.dist-info").mkdir(parents=True)
    (site / "fake_userdp_plugin-1.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: fake-userdp-plugin\nVersion: 1.0\n"
    )
    (site / "fake_userdp_plugin-1.0.dist-info" / "entry_points.txt").write_text(
        "[userdp.plugins]\nfake = fake_userdp_plugin_mod\n"
    )
    (site / "fake_userdp_plugin_mod.py").write_text(
        "from userdp.accounting import accountants as A\n"
        "class Ep(A.RDPAccountant):\n    name = 'rdp_from_entry_point'\n"
        "A.register_accountant(Ep())\n"
    )
    monkeypatch.syspath_prepend(str(site))
    rc = main(
        [
            "account",
            "--mechanism",
            "uls",
            "--noise-multiplier",
            "1.0",
            "--sampling-rate",
            "0.01",
            "--steps",
            "10",
            "--delta",
            "1e-6",
            "--accountant",
            "rdp_from_entry_point",
            "--json",
        ]
    )
    assert rc == 0, capsys.readouterr().err
    out = json.loads(capsys.readouterr().out)
    assert out["accountant"] == "rdp_from_entry_point"
    assert any(k.startswith("fake (fake_userdp_plugin_mod)") for k in plugins.loaded())


# ------------------------------------------------------------------------------ through `userdp train`
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plugins")
    cfg, _ = write_tiny_run(folder, training_extra="  seed: 7\n")
    return folder, cfg


def _train(tmp_path, cfg, *args):
    out = tmp_path / "run"
    rc = main(["train", str(cfg), "--no-progress", "--output", str(out), *args])
    assert rc == 0
    return out, json.loads((out / "privacy.json").read_text())


@pytest.mark.slow
def test_a_plugin_accountant_runs_through_userdp_train(tmp_path, tiny, monkeypatch):
    monkeypatch.setenv("USERDP_CACHE", str(tiny[0] / "cache"))
    plugin = EXAMPLES / "integer_rdp.py"
    out, priv = _train(tmp_path, tiny[1], "--plugin", str(plugin), "--set", "privacy.accountant=rdp_integer")
    # every plugin loaded in the process is named (here, at least this one)
    assert str(plugin) in priv["plugins"] and priv["accountant"].startswith("rdp_integer")
    assert any("plugin code ran inside training" in a for a in priv["assumptions"])
    # the run's epsilon is the plugin's on the run's own event (integer orders: never below the finer grid)
    event = event_from_dict(priv["dp_event"])
    eps_int = accountants.ACCOUNTANTS.lookup("rdp_integer").epsilon(event, priv["delta"])[0]
    eps_fine = accountants.ACCOUNTANTS.lookup("rdp").epsilon(event, priv["delta"])[0]
    assert math.isclose(priv["epsilon"], eps_int, rel_tol=1e-9) and eps_int >= eps_fine * (1 - 1e-12)


def test_a_plugin_uls_variant_runs_through_userdp_train(tmp_path, tiny, monkeypatch):
    monkeypatch.setenv("USERDP_CACHE", str(tiny[0] / "cache"))
    out, priv = _train(
        tmp_path, tiny[1], "--plugin", str(EXAMPLES / "recent_records.py"), "--set", "training.algorithm=uls_recent"
    )
    assert priv["algorithm"] == "uls_recent" and "most recent records" in priv["unit"]
    assert priv["sampler_assumed"] == "poisson_users"  # a user-level unit: ULS's accounting, unchanged
    assert priv["engine_record"]["algorithm"]["type"] == "ULSRecent"  # the plugin's class trained
    assert 0 < priv["epsilon"] <= 8.0


@pytest.mark.slow
def test_a_plugin_per_unit_strategy_runs_through_userdp_train_and_matches_vmap(tmp_path, tiny, monkeypatch):
    monkeypatch.setenv("USERDP_CACHE", str(tiny[0] / "cache"))
    out_loop, priv = _train(
        tmp_path / "loop", tiny[1], "--plugin", str(EXAMPLES / "loop_per_unit.py"), "--set", "training.per_unit=loop"
    )
    assert priv["engine_record"]["per_unit"]["strategy"] == "loop"
    out_vmap, _ = _train(tmp_path / "vmap", tiny[1], "--set", "training.per_unit=vmap")
    a, b = (load_file(str(o / "model" / "model.safetensors")) for o in (out_loop, out_vmap))
    assert a.keys() == b.keys()
    # the same seed: the same cohorts, records and noise; only the order of float32 sums differs, which
    # Adam's division by sqrt(v) carries to ~1e-6 in a weight near 0 after 4 steps (2.5e-6 seen once)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)
    metrics = [json.loads(line) for line in (out_loop / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 4


# ------------------------------------------------------------------------------ a sampler and a noise mechanism
def _load_example(name):
    return plugins.load(str(EXAMPLES / name), source="--plugin")


def test_the_geometric_sampler_draws_poisson_membership(isolated_registries):
    # the plugin declares accounted_as = "poisson": its draws must have Poisson's distribution
    import numpy as np

    from userdp.engine.sampling import accounted_as, get_sampler

    _load_example("geometric_poisson.py")
    assert accounted_as("poisson_geometric") == "poisson"
    s, rng = get_sampler("poisson_geometric"), np.random.default_rng(5)
    n, q, steps = 2000, 0.02, 2000
    hits = np.zeros(n)
    sizes = []
    for t in range(steps):
        ids = s.sample(n, q, t, rng, {})
        assert np.all(np.diff(ids) > 0) and (len(ids) == 0 or (ids[0] >= 0 and ids[-1] < n))
        hits[ids] += 1
        sizes.append(len(ids))
    # each unit in Binomial(steps, q): mean 40, sd 6.3; the cohort size Binomial(n, q): mean 40
    assert abs(hits.mean() - steps * q) < 0.2 and 5.3 < hits.std() < 7.3
    assert abs(np.mean(sizes) - n * q) < 0.5 and 5.3 < np.std(sizes) < 7.3
    assert np.corrcoef(hits[:-1], hits[1:])[0, 1] < 0.06  # neighbours' memberships independent


def test_a_registered_sampler_must_declare_its_accounting(isolated_registries):
    from userdp.engine import ULS, TrainConfig
    from userdp.engine.sampling import register_sampler

    class Unaccounted:
        name, mode = "mine", "mine"

        def sample(self, num_units, rate, step, rng, state):
            return rng.permutation(num_units)[:2]

    register_sampler(Unaccounted())
    with pytest.raises(UserError, match="must declare accounted_as"):
        TrainConfig(ULS(2, 0.5), steps=2, noise_multiplier=1.0, sampling="mine")


def test_the_float64_noise_mechanism_adds_gaussian_noise_of_the_asked_std(isolated_registries):
    from userdp.engine.noise.gaussian import GaussianNoise
    from userdp.engine.noise.mechanism import make_noise

    _load_example("float64_noise.py")
    mech = make_noise("iid_gaussian_float64", GaussianNoise.from_seed(3))
    t = torch.zeros(200_000)
    got, state = mech.update([t], mech.init(t.numel(), torch.float32, "cpu"), 2.5)
    assert got[0] is t and state is None
    assert t.dtype == torch.float32 and abs(float(t.mean())) < 0.03  # sd of the mean: 0.0056
    assert abs(float(t.std()) - 2.5) < 0.02  # sd of the sd: 0.004


@pytest.mark.slow
def test_a_plugin_sampler_and_noise_mechanism_run_through_userdp_train(tmp_path, tiny, monkeypatch):
    monkeypatch.setenv("USERDP_CACHE", str(tiny[0] / "cache"))
    out, priv = _train(
        tmp_path,
        tiny[1],
        "--plugin",
        str(EXAMPLES / "geometric_poisson.py"),
        "--plugin",
        str(EXAMPLES / "float64_noise.py"),
        "--set",
        "privacy.sampler=poisson_geometric",
        "--set",
        "privacy.noise=iid_gaussian_float64",
    )
    rec = priv["engine_record"]
    assert rec["sampler"] == {"name": "poisson_geometric", "mode": "poisson_geometric_gaps", "accounted_as": "poisson"}
    assert rec["noise_mechanism"] == "iid_gaussian_float64"
    assert priv["sampler_assumed"] == "poisson_users"  # accounted as Poisson, as it declares
    assert 0 < priv["epsilon"] <= 8.0 and not priv["sampling_warning"]
    assert {str(EXAMPLES / "geometric_poisson.py"), str(EXAMPLES / "float64_noise.py")} <= set(priv["plugins"])


@pytest.mark.slow
def test_a_plugin_noise_mechanism_with_state_across_steps_runs_through_userdp_train(tmp_path, tiny, monkeypatch):
    monkeypatch.setenv("USERDP_CACHE", str(tiny[0] / "cache"))
    monkeypatch.setenv("USERDP_BANDED_COEFFICIENTS", "1,0.6")
    plugin = str(EXAMPLES / "banded_coefficients.py")
    sets = ["--set", "privacy.sampler=cyclic_poisson", "--set", "privacy.noise=banded_coefficients"]
    out, priv = _train(tmp_path, tiny[1], "--plugin", plugin, *sets, "--set", "privacy.bands=2")
    eng = priv["engine_record"]
    assert eng["noise_mechanism"] == "banded_coefficients" and eng["cycle"]["bands"] == 2 and plugin in priv["plugins"]
    assert eng["correlated_noise"]["coefficients"] == pytest.approx([1 / math.hypot(1, 0.6), 0.6 / math.hypot(1, 0.6)])
    assert priv["dp_event"]["count"] == -(-priv["steps_taken"] // 2)  # accounted as BandMF: one event per cycle
    assert main(["report", str(out), "--plugin", plugin]) == 0
    # what the accounting assumes of a plugin's coefficients is checked: b of them, column norm at most 1
    eng["correlated_noise"]["coefficients"] = [1.0, 0.6]
    (out / "privacy.json").write_text(json.dumps(priv))
    assert main(["report", str(out), "--plugin", plugin]) == 2


# ------------------------------------------------------------------------------ a distribution
@pytest.mark.slow
def test_a_plugin_distribution_runs_through_userdp_train_and_matches_the_replicated_run(tmp_path, tiny, monkeypatch):
    monkeypatch.setenv("USERDP_CACHE", str(tiny[0] / "cache"))
    plugin = str(EXAMPLES / "three_way_split.py")
    out_split, priv = _train(
        tmp_path / "split", tiny[1], "--plugin", plugin, "--set", "training.sharding=three_way_split"
    )
    assert plugin in priv["plugins"]  # the statement names the code its release ran through
    out_plain, _ = _train(tmp_path / "plain", tiny[1])
    a, b = (load_file(str(o / "model" / "model.safetensors")) for o in (out_split, out_plain))
    assert a.keys() == b.keys()
    for k in a:  # the same seed: the same cohorts and noise; only the order of float32 sums differs
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6)
