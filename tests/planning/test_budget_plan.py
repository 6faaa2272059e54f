"""Tests of the plan: the L(G) estimator on the engine's per-unit code, plan_for_budget, `userdp plan`."""

import math

import numpy as np
import pytest
import torch

from userdp.engine.user_data import TensorUserData
from userdp.experiments.mean_estimation import MeanModel, loss_fn
from userdp.planning import GradientNormEstimator, NormSample, PlanBudget, Sigmas, plan_for_budget, plan_for_training


def _gaussian_users(n_users, dim, sizes, seed=0):
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(rng.normal(size=(int(sizes.sum()), dim)).astype(np.float32))
    return TensorUserData({"x": x}, np.concatenate([[0], np.cumsum(sizes)]))


def test_l_of_g_follows_one_over_sqrt_g_for_nearly_orthogonal_gradients():
    # at theta = 0 the record gradient is -x with x ~ N(0, I_d): ||mean of G|| ~ sqrt(d/G)
    d = 256
    sizes = np.full(300, 32)
    est = GradientNormEstimator(
        MeanModel(d), _gaussian_users(300, d, sizes), loss_fn, NormSample(128), rng=np.random.default_rng(1)
    )
    assert len(est.users) == 128 and len(set(est.users)) == 128
    for g in (1, 4, 16):
        assert est(g) * math.sqrt(g) / math.sqrt(d) == pytest.approx(1.0, abs=0.05)
    # identical records within a user: averaging does not shrink the norm
    rng = np.random.default_rng(2)
    base = rng.normal(size=(200, d)).astype(np.float32)
    x = torch.from_numpy(np.repeat(base, 8, axis=0))
    same = TensorUserData({"x": x}, np.arange(0, 200 * 8 + 1, 8))
    est2 = GradientNormEstimator(MeanModel(d), same, loss_fn, NormSample(64), rng=rng)
    assert est2(8) == pytest.approx(est2(1), rel=1e-5)


def test_l_of_g_matches_a_direct_computation():
    d = 8
    sizes = np.array([3, 5, 1, 4])
    data = _gaussian_users(4, d, sizes, seed=3)
    model = MeanModel(d)
    with torch.no_grad():
        model.theta.fill_(0.5)
    est = GradientNormEstimator(model, data, loss_fn, NormSample(4), rng=np.random.default_rng(0))
    # G >= every user's size: each user's mean gradient is theta - mean(x_u), no sampling
    direct = [
        np.linalg.norm(0.5 - data.tensors["x"][a:b].numpy().mean(0))
        for a, b in zip(data.offsets[:-1], data.offsets[1:], strict=True)
    ]
    assert est(8) == pytest.approx(float(np.median(direct)), rel=1e-5)


def fake_sigma(m):
    return max(1.0, m / 16.0)


def test_plan_for_budget_with_injected_parts():
    sizes = np.array([1] * 50 + [9] * 40 + [500] * 30)  # median over users = 9
    calls = []

    def els_sigma(p, g):
        calls.append((p, g))
        return 3.0

    plan = plan_for_budget(
        sizes,
        PlanBudget(128, 1.0, 100, delta=1e-5),
        lambda g: 4.0 / math.sqrt(g),
        sigmas=Sigmas(fake_sigma, els_sigma),
        sample_users=32,
    )
    e, u = plan.els, plan.uls
    assert e["group_size"] == 9
    dprime = 50 * 1 + 40 * 9 + 30 * 9
    assert e["dataset_size"] == dprime
    assert e["expected_batch_size"] == 128 and e["sampling_rate"] == pytest.approx(128 / dprime)
    assert calls == [(pytest.approx(128 / dprime), 9)]
    assert u["cohort_size"] * u["group_size"] == 128 and u["cohort_size"] <= sizes.size
    assert (u["cohort_size"], u["group_size"]) == (16, 8)
    assert u["sampling_rate"] == pytest.approx(16 / 120)
    assert e["noise_std_proxy"] == pytest.approx(3.0 * 4.0 / 128)
    assert u["noise_std_proxy"] == pytest.approx(1.0 * (4.0 / math.sqrt(8)) / 16)
    assert plan.recommended == ("uls" if u["noise_std_proxy"] <= e["noise_std_proxy"] else "els")
    d = plan.to_dict()
    assert set(d) >= {"els", "uls", "recommended", "data_touches"}
    assert "non-private" in d["data_touches"] and "32 users" in d["data_touches"]
    assert plan.training_overrides("uls") == {
        "training.algorithm": "uls",
        "training.group_size": 8,
        "training.cohort_size": 16.0,
    }
    # the plan says what its choice means for the data (issue 28, 4)
    from userdp.planning import explain, format_plan

    words = " ".join(explain(plan))
    if plan.recommended == "uls":
        assert "up to 8 of their records" in words and "8/n" in words and "about 13 times" in words
    else:
        assert "at most G = 9 records" in words and "never used" in words
    assert "what this means for the data" in format_plan(plan)


def test_plan_for_budget_budget_not_a_power_of_two_and_few_users():
    plan = plan_for_budget(
        np.full(10, 50),
        PlanBudget(100, 1.0, 10, delta=1e-5),
        lambda g: 1.0 / math.sqrt(g),
        sigmas=Sigmas(lambda m: 1.0, lambda p, g: 1.0),
    )
    u = plan.uls
    assert u["cohort_size"] <= 10
    assert u["cohort_size"] * u["group_size"] == pytest.approx(100) or u["cohort_size"] == 10
    assert any("power" in n for n in plan.notes)
    # ELS: budget above |D'| -> p = 1 and a note
    plan2 = plan_for_budget(
        np.full(4, 2),
        PlanBudget(64, 1.0, 10, delta=1e-5),
        lambda g: 1.0,
        sigmas=Sigmas(lambda m: 1.0, lambda p, g: 1.0),
    )
    assert plan2.els["sampling_rate"] == 1.0 and plan2.els["expected_batch_size"] == 8
    assert plan2.uls["cohort_size"] <= 4


@pytest.mark.slow
def test_plan_for_training_end_to_end_with_the_accountant():
    d = 64
    rng = np.random.default_rng(5)
    sizes = rng.integers(1, 4, size=400)  # small G_ELS keeps the MoG calibration cheap
    data = _gaussian_users(400, d, sizes, seed=5)
    plan = plan_for_training(
        data,
        MeanModel(d),
        loss_fn,
        PlanBudget(16, 2.0, 100, accountant="rdp"),  # RDP: cheap
        NormSample(64, seed=0),
    )
    u, e = plan.uls, plan.els
    assert u["cohort_size"] * u["group_size"] == 16
    assert e["group_size"] == int(math.ceil(np.median(sizes)))
    assert u["noise_multiplier"] > 0 and e["noise_multiplier"] > 0
    # orthogonal-ish gradients and a sigma(M) that is flat for small M: E&D grows M first
    assert plan.uls["estimate_and_double"]["trace"][0]["doubled"] == "M"
    assert plan.inputs["delta"] == pytest.approx(400**-1.1)


def test_cli_plan_rejects_bad_budget_in_one_line(capsys):
    from userdp.cli import main

    assert main(["plan", "--compute-budget", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--compute-budget" in err[0]


def test_l_of_g_of_a_language_model_comes_from_ghost_norms_equal_to_the_users_gradients():
    """The planner reads L(G) through the strategy training uses: for a GPT-2, ghost norms (no
    per-user gradient materialized), equal to the norms of the users' materialized mean gradients."""
    import copy

    from userdp.engine import ULS
    from userdp.engine.per_unit import PerUnit
    from userdp.lm import models

    torch.manual_seed(0)
    model = models.build_preset("tiny", vocab_size=64, n_positions=16)
    sizes = np.array([1, 3, 5, 2, 4, 6])
    ids = torch.randint(0, 64, (int(sizes.sum()), 12), generator=torch.Generator().manual_seed(1))
    data = TensorUserData({"input_ids": ids, "labels": ids.clone()}, np.concatenate([[0], np.cumsum(sizes)]))
    est = GradientNormEstimator(model, data, models.causal_lm_loss, NormSample(6), rng=np.random.default_rng(0))
    rng = copy.deepcopy(est.rng)  # the records the estimator is about to draw
    got = est.user_norms(3)
    assert est._per_unit.name == "ghost"
    batch, mask = data.draw_records(est.users, 3, rng)
    updates, _ = PerUnit(model, models.causal_lm_loss, ULS(group_size=1, sampling_rate=1.0))(batch, mask)
    want = torch.sqrt(sum(u.reshape(u.shape[0], -1).double().pow(2).sum(1) for u in updates)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4)
