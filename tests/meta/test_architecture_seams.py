"""The seams of issue 10: one run plan, one event mapping, registered accountants, per-unit
strategies and noise mechanisms, heterogeneous composition in the ledger, shared validation.
Each test asserts behaviour that the old code did not have or got wrong."""

import dataclasses
import json
import math

import dp_accounting
import numpy as np
import pytest
import torch
from _paths import REPO
from dp_accounting import dp_event as dpe
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

from userdp import accounting
from userdp.engine import ELS, ULS, AdaptiveClip, FedAvg, FlatClip, PerLayerClip, RunOptions, TrainConfig, train
from userdp.engine import checkpoint as ckpt
from userdp.engine import per_unit as per_unit_mod
from userdp.engine.clipping import per_tensor_norms
from userdp.engine.ledger import PrivacyLedger
from userdp.engine.noise.mechanism import NOISE_MECHANISMS, IIDGaussian
from userdp.engine.performance import Performance
from userdp.engine.plan import make_plan, privacy_repr
from userdp.engine.run.step import EngineRun
from userdp.errors import UserError
from userdp.validation import check_choice, check_int, check_rate

from _engine_helpers import MLP, Mean, ce_loss, linear_loss, mlp_data, sq_loss, user_data

PLUGINS = REPO / "examples" / "plugins"


def _plugin(name):
    """Import examples/plugins/<name>.py by path (an unrelated 'examples' package may be installed)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"userdp_example_{name}", PLUGINS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ------------------------------------------------------------------------------ the run plan
@pytest.mark.parametrize(
    "algo,sampling,kind",
    [
        (ELS(3, 0.2), "poisson", "els"),
        (ULS(2, 0.25), "poisson", "uls"),
        (FedAvg(2, 0.25), "poisson", "uls"),
        (ULS(2, 0.25), "fixed_size", "fixed_cohort"),
        (ELS(3, 0.2), "shuffle", "no_amplification"),
        (ULS(2, 0.25), "shuffle", "no_amplification"),
    ],
)
def test_plan_builds_the_step_event_at_its_own_noise_multiplier(algo, sampling, kind):
    cfg = TrainConfig(
        algorithm=algo,
        steps=5,
        noise_multiplier=1.7,
        sampling=sampling,
        accountant="rdp" if sampling == "fixed_size" else "pld",
    )
    plan = make_plan(cfg, num_users=40, num_units=80)
    assert plan.mechanism.kind == kind and plan.mechanism.noise_multiplier == 1.7
    ev = plan.step_event
    z = (
        ev.event.noise_multiplier
        if hasattr(ev, "event")
        else getattr(ev, "standard_deviation", None) or ev.noise_multiplier
    )
    owned = algo.group_size if (kind == "no_amplification" and algo.unit == "record") else 1
    assert z == pytest.approx(1.7 / owned)


def test_calibrated_plan_is_a_new_plan_that_meets_the_target():
    cfg = TrainConfig(algorithm=ULS(2, 0.1), steps=50, target_epsilon=2.0, delta=1e-5)
    plan = make_plan(cfg, num_users=200, num_units=200)
    assert plan.safe_steps == 50 and plan.noise_multiplier > 0
    assert plan.mechanism.noise_multiplier == plan.noise_multiplier  # the event is at the plan's sigma
    assert accounting.epsilon(plan.mechanism.event(), 1e-5) <= 2.0
    tighter = plan.calibrated(1.0)
    assert (
        tighter.noise_multiplier > plan.noise_multiplier and plan.mechanism.noise_multiplier < tighter.noise_multiplier
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.noise_multiplier = 3.0


def test_adaptive_plan_splits_the_noise_by_theorem_one():
    cfg = TrainConfig(algorithm=ULS(2, 0.5), steps=5, noise_multiplier=1.0, clipping=AdaptiveClip(0.1))
    plan = make_plan(cfg, num_users=100, num_units=100)
    sb = 50 / 20
    assert plan.count_stddev == sb
    assert (plan.update_noise_multiplier**-2 + (2 * sb) ** -2) ** -0.5 == pytest.approx(1.0)


@pytest.mark.slow
def test_the_record_step_event_is_the_mechanisms():
    data = user_data([3] * 20, d=3)
    for algo, sampling in [(ELS(2, 0.3), "poisson"), (ULS(2, 0.3), "fixed_size"), (ELS(2, 0.3), "shuffle")]:
        cfg = TrainConfig(
            algorithm=algo,
            steps=2,
            noise_multiplier=1.3,
            seed=0,
            sampling=sampling,
            accountant="rdp" if sampling == "fixed_size" else "pld",
        )
        rec = train(Mean(3), data, sq_loss, cfg).record
        n_units = 40 if algo.unit == "record" else 20
        mech = accounting.Mechanism.for_training(algo, sampling, 1.3, 2, n_units)  # cohorts of round(0.3 * n)
        assert rec["step_event"] == accounting.event_to_dict(mech.step_event())


def test_lm_budget_check_honours_the_sampler(tmp_path):
    # shuffled batches have no amplification: a sigma whose Poisson epsilon fits the target must
    # still be refused when the no-amplification epsilon passes it (the old check assumed Poisson)
    from userdp.lm import config as C
    from userdp.lm.job_plan import check_budget

    from _lm_corpus import tiny_config, write_tiny_corpus

    data, public = write_tiny_corpus(tmp_path)
    (tmp_path / "c.yaml").write_text(tiny_config(data, public, privacy_extra="  noise_multiplier: 3.0\n"))
    poisson = C.load_config(str(tmp_path / "c.yaml"), ["privacy.epsilon=0.5"])
    assert check_budget(poisson, 32, 32) is None  # Poisson: 4 steps at q = 1/4, sigma 3: within 0.5
    shuffled = C.load_config(str(tmp_path / "c.yaml"), ["privacy.sampler=shuffle", "privacy.epsilon=0.5"])
    with pytest.raises(UserError, match="spend epsilon"):
        check_budget(shuffled, 32, 32)


def test_resolve_takes_the_chunk_as_a_value_and_makes_the_one_plan_its_budget_check_asks(tmp_path, monkeypatch):
    """Issue 59, property 6: the chunk choice is a value ``resolve`` takes; the budget check asks the
    plan ``resolve`` makes (one mechanism plan, then its Performance); the job context is frozen and
    a phase adds to it by returning a new one."""
    import torch

    from userdp.lm import config as C
    from userdp.lm import job_plan as JP
    from userdp.lm.job_context import JobContext

    from _lm_corpus import tiny_config, write_tiny_corpus

    data, public = write_tiny_corpus(tmp_path)
    (tmp_path / "c.yaml").write_text(tiny_config(data, public, privacy_extra="  noise_multiplier: 3.0\n"))
    rdp = "privacy.accountant=rdp"  # the property is the plan's, whichever accountant (RDP: milliseconds)
    cfg = C.load_config(str(tmp_path / "c.yaml"), ["privacy.epsilon=5", "training.chunk_size=auto", rdp])
    with pytest.raises(TypeError):
        JP.resolve(cfg, 32, 32)  # no chunk, no plan: the auto choice must have been made
    asked = []
    real = JP.check_plan_budget
    monkeypatch.setattr(JP, "check_plan_budget", lambda c, plan, prior=(): asked.append(plan) or real(c, plan, prior))
    job = JP.resolve(cfg, 32, 32, None, torch.device("cpu"), chunk_size=4)
    assert job.engine.performance.chunk_size == 4 and job.training.chunk_size == 4
    assert len(asked) == 1 and asked[0].mechanism is job.engine.mechanism  # the same plan, not a second one
    assert asked[0].config == job.engine.config  # they differ in the Performance alone
    tight = C.load_config(str(tmp_path / "c.yaml"), ["privacy.epsilon=0.01", rdp])
    with pytest.raises(UserError, match="spend epsilon"):
        JP.resolve(tight, 32, 32, None, torch.device("cpu"), chunk_size=4)
    ctx = JobContext(world=None, log=print, progress=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.device = torch.device("cpu")  # type: ignore[misc]
    later = ctx.noted(chunk_size={"chunk_size": 4}).noted(sample="a note")
    assert dict(later.notes) == {"chunk_size": {"chunk_size": 4}, "sample": "a note"} and dict(ctx.notes) == {}
    with pytest.raises(TypeError):
        later.notes["x"] = 1  # type: ignore[index]


# ------------------------------------------------------------------------------ accountants
def test_a_registered_accountant_is_used_everywhere_by_name():
    ORDERS = _plugin("integer_rdp").ORDERS

    try:
        step = accounting.uls_step_event(1.1, 0.05)
        ref = rdp_lib.RdpAccountant(orders=list(ORDERS))
        ref.compose(step, 100)
        want = ref.get_epsilon(1e-6)
        assert accounting.epsilon(accounting.compose(step, 100), 1e-6, "rdp_integer") == pytest.approx(want, rel=1e-12)
        # calibration and training take it by name; the ledger reports with it
        z = accounting.calibrate_noise_multiplier(
            lambda s: accounting.uls_step_event(s, 0.05), 100, want, 1e-6, "rdp_integer"
        )
        assert z == pytest.approx(1.1, rel=0.01) and z >= 1.1 * (1 - 1e-9)
        res = train(
            Mean(3),
            user_data([2] * 40, d=3),
            sq_loss,
            TrainConfig(
                algorithm=ULS(2, 0.05), steps=3, noise_multiplier=1.1, delta=1e-6, seed=0, accountant="rdp_integer"
            ),
        )
        ref3 = rdp_lib.RdpAccountant(orders=list(ORDERS))
        ref3.compose(step, 3)
        assert res.epsilon == pytest.approx(ref3.get_epsilon(1e-6), rel=1e-12)
        assert res.record["accountant"] == "rdp_integer"
    finally:
        accounting.ACCOUNTANTS.pop("rdp_integer", None)
    with pytest.raises(UserError, match="accountant must be one of pld, rdp|accountant must be one of rdp, pld"):
        accounting.get_accountant("rdp_integer")
    with pytest.raises(UserError, match="already registered"):
        accounting.register_accountant(accounting.RDPAccountant())


# ------------------------------------------------------------------------------ ledger composition
def _built(*parts):
    b = dp_accounting.DpEventBuilder()
    for ev, n in parts:
        b.compose(ev, n)
    return b.build()


@pytest.mark.slow
def test_ledger_composes_heterogeneous_events():
    step = accounting.uls_step_event(1.0, 0.1)
    median = dpe.GaussianDpEvent(8.0)  # e.g. a Gaussian query spent planning the run
    led = PrivacyLedger(step, 1e-6, target_epsilon=8.0)
    for _ in range(5):
        led.record_step()
    led.spend_event(median)
    total = led.total_event()
    want = _built((median, 1), (step, 5))
    assert total == want
    assert led.epsilon() == pytest.approx(accounting.epsilon(want, 1e-6), rel=1e-12)
    assert led.epsilon() > accounting.epsilon(accounting.compose(step, 5), 1e-6)
    # a new sigma from here on: the old steps keep their event
    new = accounting.uls_step_event(2.0, 0.1)
    led.rebase(new)
    led.record_step()
    want2 = _built((median, 1), (step, 5), (new, 1))
    assert led.total_event() == want2 and led.spent == 6
    assert led.epsilon() == pytest.approx(accounting.epsilon(want2, 1e-6), rel=1e-12)
    # the budget counts the extra events; state round-trips
    st = json.loads(json.dumps(led.state_dict()))
    again = PrivacyLedger(new, 1e-6, target_epsilon=8.0)
    again.load_state_dict(st, replayable=True)
    assert again.total_event() == want2


@pytest.mark.slow
def test_ledger_budget_includes_spent_events():
    step = accounting.uls_step_event(1.0, 0.1)
    plain = PrivacyLedger(step, 1e-6, target_epsilon=3.0)
    charged = PrivacyLedger(step, 1e-6, target_epsilon=3.0)
    charged.spend_event(dpe.GaussianDpEvent(3.0))
    assert 0 < charged.max_steps() < plain.max_steps()
    assert accounting.epsilon(charged.total_event(charged.max_steps()), 1e-6) <= 3.0
    assert accounting.epsilon(charged.total_event(charged.max_steps() + 1), 1e-6) > 3.0
    with pytest.raises(UserError):
        charged.spend_event(dpe.GaussianDpEvent(0.5))  # would pass the target on its own


# ------------------------------------------------------------------------------ per-unit strategies
@pytest.mark.slow
def test_a_registered_per_unit_strategy_is_chosen_by_configuration():
    calls = []

    class Counting(per_unit_mod.VmapPerUnit):
        name = "counting"

        def clipped_sum(self, *a, **k):
            calls.append(1)
            return super().clipped_sum(*a, **k)

    per_unit_mod.PER_UNIT_STRATEGIES["counting"] = Counting
    try:
        data = mlp_data([3, 1, 4, 2, 5] * 4)
        out = {}
        for name in ("vmap", "counting"):
            torch.manual_seed(0)
            model = MLP()
            train(
                model,
                data,
                ce_loss,
                TrainConfig(
                    algorithm=ULS(3, 0.4),
                    steps=3,
                    noise_multiplier=1.0,
                    seed=5,
                    performance=Performance(per_unit=name, chunk_size=4),
                ),
            )
            out[name] = torch.cat([p.detach().flatten() for p in model.parameters()])
        assert calls and torch.equal(out["vmap"], out["counting"])
    finally:
        per_unit_mod.PER_UNIT_STRATEGIES.pop("counting")
    with pytest.raises(UserError, match="per_unit must be one of"):
        TrainConfig(
            algorithm=ULS(3, 0.4), steps=3, noise_multiplier=1.0, performance=Performance(per_unit="ghost-not-yet")
        )


@pytest.mark.parametrize(
    "clip",
    [
        FlatClip(0.7),
        PerLayerClip(0.7),
        FlatClip(0.7, normalized=True),
        AdaptiveClip(0.3),
        PerLayerClip(1.0, layer_norms=(0.1, 2.0, 0.5)),
    ],
)
def test_clipping_consumes_norms_alone(clip):
    rng = torch.Generator().manual_seed(0)
    ups = [torch.randn(6, 4, generator=rng), torch.randn(6, 2, 3, generator=rng), torch.randn(6, 1, generator=rng)]
    st = clip.initial_state()
    f1, n1 = clip.factors(ups, st)
    f2, n2 = clip.factors_from_norms(per_tensor_norms(ups), st)
    assert torch.equal(f1, f2) and torch.equal(n1, n2)
    clipped = torch.sqrt(
        sum(((f2[:, j].view(-1, *[1] * (u.dim() - 1)) * u) ** 2).flatten(1).sum(1) for j, u in enumerate(ups))
    )
    assert bool((clipped <= clip.sensitivity(st, len(ups)) * (1 + 1e-6)).all())
    assert len(clip.reproject_bounds(st, len(ups))) in (1, len(ups))
    assert clip.update(st, 0.9)["clip_norm"] != st["clip_norm"] if clip.adaptive else clip.update(st, 0.9) == st


# ------------------------------------------------------------------------------ noise mechanisms
def test_a_registered_noise_mechanism_gets_the_std_on_the_sum_and_its_state_across_steps(tmp_path):
    asked = []

    class Recording(IIDGaussian):
        """A transform whose state (the steps it noised) is the run's, passed in and returned."""

        name = "recording"

        def init(self, numel, dtype, device):
            return {"steps": 0, "numel": numel}

        def update(self, sums, state, std):
            asked.append((std, dict(state)))
            sums, _ = super().update(sums, None, std)
            return sums, {**state, "steps": state["steps"] + 1}

        def state_dict(self, state):
            return {**super().state_dict(state), "steps": state["steps"]}

    NOISE_MECHANISMS["recording"] = Recording
    try:
        cfg = TrainConfig(
            algorithm=ULS(2, 0.5),
            steps=2,
            noise_multiplier=2.0,
            clipping=FlatClip(0.5),
            seed=3,
            noise="recording",
            delta=1e-5,
        )
        data = user_data([2] * 20, d=3)
        res = train(Mean(3), data, sq_loss, cfg, RunOptions(checkpoint_dir=str(tmp_path)))
        # the noise goes on the clipped SUM (on rank 0, before the all-reduce): std z * C; the noised
        # sum is then divided by the fixed denominator q * N = 10
        assert [a[0] for a in asked] == [pytest.approx(2.0 * 0.5)] * 2 and res.steps == 2
        assert [a[1] for a in asked] == [{"steps": 0, "numel": 3}, {"steps": 1, "numel": 3}]  # each step's state
        st = ckpt.load(str(tmp_path))
        assert st["noise"]["source"] is not None  # seeded: the mechanism's state travels with the checkpoint
        assert st["noise"]["steps"] == 2
    finally:
        NOISE_MECHANISMS.pop("recording")


# ------------------------------------------------------------------------------ the example algorithm
def test_a_new_algorithm_in_one_file_trains_under_uls_accounting():
    ULSRecent = _plugin("recent_records").ULSRecent

    data = user_data([5, 1, 3, 7], d=2, seed=1)
    algo = ULSRecent(group_size=2, sampling_rate=1.0)
    batch, mask = algo.load(data, algo.units(data, np.random.default_rng(0)), np.arange(4), None)
    x = data.tensors["x"]
    # user 0: records 3, 4; user 1: record 0 (one real); user 3: records 5, 6 of its 7
    assert torch.equal(batch["x"][0], x[3:5]) and torch.equal(batch["x"][3], x[9 + 5 : 9 + 7])
    assert mask.tolist() == [[1, 1], [1, 0], [1, 1], [1, 1]]
    res = train(
        Mean(2), data, linear_loss, TrainConfig(algorithm=algo, steps=2, noise_multiplier=1.0, seed=0, delta=1e-3)
    )
    assert res.record["step_event"] == accounting.event_to_dict(accounting.uls_step_event(1.0, 1.0))


# ------------------------------------------------------------------------------ errors
def test_user_errors_are_value_errors_that_name_the_parameter():
    with pytest.raises(ValueError, match=r"group size G must be an integer >= 1 \(got 0\)"):
        ULS(0, 0.5)
    with pytest.raises(ValueError, match=r"ULS user sampling rate q must be in \(0, 1\]"):
        ULS(2, 1.5)
    with pytest.raises(ValueError, match="steps must be an integer >= 1"):
        check_int(True, "steps")
    with pytest.raises(ValueError, match="must be in"):
        check_rate(math.nan, "q")
    assert check_choice("pld", "accountant", accounting.ACCOUNTANTS) == "pld"


def test_the_performance_settings_are_one_object_outside_the_config_and_the_yaml_names_them_too():
    """Issue 59: how a run computes is a Performance apart from what it releases (no tuple of names
    inside TrainConfig): not a TrainConfig field of its own, not in its equality or repr, and the
    YAML's performance keys (those a ``--resume --set`` may change) name each of its settings."""
    from userdp.engine.performance import PERFORMANCE_FIELDS
    from userdp.lm.config import PERFORMANCE_KEYS

    names = {f.name for f in dataclasses.fields(TrainConfig)}
    assert not names & set(PERFORMANCE_FIELDS) and "performance" in names
    field = next(f for f in dataclasses.fields(TrainConfig) if f.name == "performance")
    assert not field.compare and not field.repr
    assert set(PERFORMANCE_FIELDS) - {"track_epsilon"} <= set(PERFORMANCE_KEYS["training"])
    with pytest.raises(UserError, match="performance"):
        TrainConfig(algorithm=ULS(2, 0.5), steps=2, noise_multiplier=1.0, performance={"chunk_size": 8})
    with pytest.raises(UserError, match="chunk_size"):
        Performance(chunk_size=0)
    # a 0.9 call names where its setting went, in one line (not an unexpected-keyword TypeError)
    with pytest.raises(UserError, match=r"performance=Performance\(chunk_size=8, per_unit='vmap'\)") as info:
        TrainConfig(algorithm=ULS(2, 0.5), steps=2, noise_multiplier=1.0, chunk_size=8, per_unit="vmap")
    assert "\n" not in str(info.value)
    cfg = TrainConfig(algorithm=ULS(2, 0.5), steps=2, noise_multiplier=1.0)
    with pytest.raises(UserError, match="since userdp 0.10"):
        dataclasses.replace(cfg, sharding="fsdp")
    assert dataclasses.replace(cfg, steps=3).steps == 3 and isinstance(cfg, TrainConfig)
    # a checkpoint of 0.9 carries its performance settings in the config's repr: its resume is
    # refused as a 0.9 run (resume it there), not as "a different config"
    from userdp.engine.plan import held_performance

    old = privacy_repr(cfg)[:-1] + ", chunk_size=64, checkpoint_every=0, track_epsilon=True, per_unit='auto')"
    assert held_performance(old) and not held_performance(privacy_repr(cfg))
    assert not held_performance(privacy_repr(dataclasses.replace(cfg, steps=3)))


def test_the_plan_holds_its_parts_and_the_run_uses_them():
    """make_plan resolves the sampler and the noise mechanism once (a plugin's included); the run
    draws with the plan's sampler and adds the plan's noise; the performance settings stand apart
    from what the journal is bound to."""
    sampler = _plugin("geometric_poisson").GeometricPoisson
    _plugin("float64_noise")
    data = user_data([2] * 40, d=2)
    cfg = TrainConfig(
        algorithm=ULS(2, 0.25),
        steps=2,
        noise_multiplier=1.0,
        delta=1e-5,
        seed=0,
        sampling="poisson_geometric",
        noise="iid_gaussian_float64",
        performance=Performance(chunk_size=8),
    )
    plan = make_plan(cfg, num_users=40, num_units=40)
    assert isinstance(plan.sampler, sampler) and plan.accounted_sampling == "poisson"
    assert plan.noise_mechanism is NOISE_MECHANISMS.lookup("iid_gaussian_float64")
    assert plan.performance == Performance(chunk_size=8)
    other = dataclasses.replace(cfg, performance=Performance(chunk_size=64, per_unit="vmap", track_epsilon=False))
    assert privacy_repr(cfg) == privacy_repr(other) and cfg == other  # outside the journal's binding and equality
    assert "chunk_size" not in privacy_repr(cfg) and "8" not in privacy_repr(cfg).split("seed=0")[-1]
    assert privacy_repr(cfg) != privacy_repr(dataclasses.replace(cfg, steps=3))
    run = EngineRun(Mean(2), data, sq_loss, plan)
    assert run.sampler is plan.sampler and type(run.noise) is plan.noise_mechanism
    res = train(Mean(2), data, sq_loss, plan)
    assert res.record["sampler"]["mode"] == sampler.mode and res.record["noise_mechanism"] == "iid_gaussian_float64"
