"""The loop does what the algorithms say: GD equivalence, vmap = per-unit loop reference,
FedAvg local SGD, adaptive clipping convergence (A8), exact resume after a crash."""

import dataclasses
import itertools
import math

import numpy as np
import pytest
import torch

from userdp.engine import (
    ELS,
    SGD,
    ULS,
    Adafactor,
    Adam,
    AdaptiveClip,
    FedAvg,
    FedSGD,
    FlatClip,
    RunOptions,
    TensorUserData,
    TrainConfig,
    train,
)
from userdp.engine.per_unit import PerUnit
from userdp.engine.performance import Performance
from userdp.errors import UserError

from _engine_helpers import (
    MLP,
    Crash,
    Mean,
    ce_loss,
    crash_at,
    ctrl_c_at,
    linear_loss,
    mlp_data,
    sigint_raises,
    sq_loss,
    train_config,
    user_data,
)


def _manual_user_avg_gd(model, data, steps, lr):
    sizes = data.sizes()
    for _ in range(steps):
        model.zero_grad()
        total = 0.0
        for u in range(data.num_users):
            b = data.gather(np.full(sizes[u], u), np.arange(sizes[u]))
            total = total + ce_loss(model, b).mean()
        (total / data.num_users).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad


def test_sigma0_no_clipping_uls_is_gradient_descent_on_user_averaged_loss():
    sizes = [1, 4, 2, 7, 3, 5]
    data = mlp_data(sizes, seed=4)
    torch.manual_seed(0)
    a = MLP()
    b = MLP()
    b.load_state_dict(a.state_dict())
    cfg = TrainConfig(
        algorithm=ULS(group_size=max(sizes), sampling_rate=1.0),
        steps=5,
        clipping=FlatClip(1e9),
        optimizer=SGD(lr=0.3),
        noise_multiplier=0.0,
        seed=0,
        performance=Performance(chunk_size=4, track_epsilon=False),
    )
    res = train(a, data, ce_loss, cfg)
    _manual_user_avg_gd(b, data, 5, 0.3)
    for (n, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.allclose(pa, pb, atol=1e-5), n
    assert res.epsilon == math.inf and "NOT differentially private" in res.record["warning"]
    assert all(h["units"] == len(sizes) for h in res.history)


def test_vmapped_per_unit_gradients_equal_a_python_loop():
    sizes = [3, 1, 5, 2]
    G = 4
    data = mlp_data(sizes, seed=1)
    torch.manual_seed(1)
    model = MLP()
    pu = PerUnit(model, ce_loss, ULS(G, 0.5))
    batch, mask = data.draw_records(np.arange(4), G, np.random.default_rng(0))
    updates, losses = pu(batch, mask)
    for u in range(4):
        n = int(mask[u].sum())
        b = {k: v[u, :n] for k, v in batch.items()}
        model.zero_grad()
        loss = ce_loss(model, b).mean()
        loss.backward()
        for j, p in enumerate(pu.params):
            assert torch.allclose(updates[j][u], p.grad, atol=1e-6)
        assert losses[u].item() == pytest.approx(loss.item(), rel=1e-5)
    # a padding unit (mask all zero) contributes exactly nothing
    batch0 = {k: v[:1] for k, v in batch.items()}
    ups0, _ = pu(batch0, torch.zeros(1, G))
    assert all(float(u.abs().sum()) == 0.0 for u in ups0)


def test_fedavg_update_equals_local_sgd_loop():
    sizes = [5, 2, 6]
    G, E, B, lr = 4, 2, 2, 0.2
    data = mlp_data(sizes, seed=2)
    torch.manual_seed(2)
    model = MLP()
    algo = FedAvg(G, 0.5, local_epochs=E, local_lr=lr, local_batch_size=B)
    pu = PerUnit(model, ce_loss, algo)
    from userdp.engine.per_unit import fedavg_epoch_batches

    batch, mask = data.draw_records(np.arange(3), G, np.random.default_rng(0))
    eb, em = fedavg_epoch_batches(batch, mask, E, np.random.default_rng(1))
    assert (em[:, :, :2] == 1).all()  # real records first in every epoch
    updates, _ = pu(eb, em)
    for u in range(3):
        local = MLP()
        local.load_state_dict(model.state_dict())
        for e in range(E):
            for s in range(0, G, B):
                m = em[u, e, s : s + B]
                if m.sum() == 0:
                    continue
                b = {k: v[u, e, s : s + B][m > 0] for k, v in eb.items()}
                local.zero_grad()
                ce_loss(local, b).mean().backward()
                with torch.no_grad():
                    for p in local.parameters():
                        p -= lr * p.grad
        for j, (p0, p1) in enumerate(zip(model.parameters(), local.parameters(), strict=True)):
            assert torch.allclose(updates[j][u], (p0 - p1).detach(), atol=1e-5)


def test_fedavg_reprojection_keeps_every_local_iterate_within_c():
    data = mlp_data([6, 6, 6], seed=3)
    torch.manual_seed(3)
    model = MLP()
    batch, mask = data.draw_records(np.arange(3), 6, np.random.default_rng(0))
    from userdp.engine.per_unit import fedavg_epoch_batches

    eb, em = fedavg_epoch_batches(batch, mask, 3, np.random.default_rng(1))
    C = 0.05
    free, _ = PerUnit(model, ce_loss, FedAvg(6, 0.5, local_epochs=3, local_lr=0.5, local_batch_size=2))(eb, em)
    proj, _ = PerUnit(model, ce_loss, FedAvg(6, 0.5, local_epochs=3, local_lr=0.5, local_batch_size=2, reproject=True))(
        eb, em, reproject=[C]
    )
    n_free = torch.sqrt(sum((u.reshape(3, -1) ** 2).sum(1) for u in free))
    n_proj = torch.sqrt(sum((u.reshape(3, -1) ** 2).sum(1) for u in proj))
    assert (n_free > C).all() and (n_proj <= C * (1 + 1e-5)).all()
    # not just the final clip: projecting every step changes the direction of the delta
    clipped = [u * (C / n_free).view(3, *[1] * (u.dim() - 1)) for u in free]
    assert max(float((a - b).abs().max()) for a, b in zip(clipped, proj, strict=True)) > 1e-4


def test_fedsgd_with_lr_eta_equals_uls_step():
    data = user_data([3, 2, 4, 1], d=3, seed=3)
    init = torch.tensor([0.5, -1.0, 2.0])
    a, b = Mean(3, init), Mean(3, init)
    common = dict(
        steps=3, clipping=FlatClip(0.5), noise_multiplier=0.7, delta=1e-5, seed=9, track_epsilon=False, accountant="rdp"
    )
    train(a, data, sq_loss, train_config(algorithm=ULS(4, 0.6), optimizer=SGD(0.4), **common))
    train(b, data, sq_loss, train_config(algorithm=FedSGD(4, 0.6), optimizer=SGD(0.4), **common))
    assert torch.allclose(a.theta, b.theta, atol=1e-6)


@pytest.mark.heavy(counterpart="tests/engine/test_clipping.py::test_adaptive_quantile_toy_fig1")
@pytest.mark.slow
def test_adaptive_clipping_tracks_the_quantile_of_lognormal_norms():
    """A8: unit norms log-normal(0, 0.5); C converges near their gamma-quantile despite count noise."""
    N, d = 2000, 4
    rng = np.random.default_rng(0)
    norms = np.exp(rng.normal(0.0, 0.5, N))
    dirs = rng.normal(size=(N, d))
    x = torch.from_numpy(dirs / np.linalg.norm(dirs, axis=1, keepdims=True) * norms[:, None]).float()
    data = TensorUserData({"x": x}, np.arange(N + 1))
    for gamma in (0.5, 0.8):
        q_true = float(np.exp(0.5 * __import__("scipy").stats.norm.ppf(gamma)))
        res = train(
            Mean(d),
            data,
            linear_loss,
            TrainConfig(
                algorithm=ULS(1, 0.05),
                steps=160,
                optimizer=SGD(1e-9),
                clipping=AdaptiveClip(initial_norm=0.1, target_quantile=gamma),
                noise_multiplier=1.0,
                delta=1e-6,
                seed=1,
                accountant="rdp",
                performance=Performance(chunk_size=128, track_epsilon=False),
            ),
        )
        tail = np.array([h["clip_norm"] for h in res.history[-60:]])
        assert np.median(tail) == pytest.approx(q_true, rel=0.12)
        frac = np.mean([1 - h["fraction_clipped"] for h in res.history[-60:]])
        assert frac == pytest.approx(gamma, abs=0.05)


@pytest.mark.parametrize("opt", [SGD(0.1, momentum=0.9), Adam(0.05), Adafactor(0.3)])
def test_optimizers_consume_the_private_gradient_and_learn(opt):
    data = user_data([4] * 100, d=3, shift=2.0, scale=0.5, seed=5)
    m = Mean(3, torch.ones(3))  # Adafactor's step is relative to the parameters' RMS
    res = train(
        m,
        data,
        sq_loss,
        TrainConfig(
            algorithm=ULS(4, 0.2),
            steps=80,
            optimizer=opt,
            clipping=FlatClip(5.0),
            noise_multiplier=0.5,
            delta=1e-5,
            seed=0,
            accountant="rdp",
            performance=Performance(track_epsilon=False),
        ),
    )
    assert float((m.theta.detach() - 2.0).abs().max()) < 0.4
    assert res.history[-1]["loss"] < res.history[0]["loss"]


def _resume_cfg(seed, algo):
    return TrainConfig(
        algorithm=algo,
        steps=10,
        optimizer=Adam(0.05),
        clipping=AdaptiveClip(initial_norm=0.5),
        noise_multiplier=0.6,
        delta=1e-5,
        seed=seed,
        accountant="rdp",
        performance=Performance(checkpoint_every=3, track_epsilon=True, chunk_size=8),
    )


@pytest.mark.slow
@pytest.mark.parametrize("algo", [ULS(3, 0.3), ELS(2, 0.2), FedAvg(3, 0.3, local_epochs=2, local_batch_size=2)])
def test_interrupted_and_resumed_run_counts_its_lost_steps_and_is_reproducible(tmp_path, algo):
    """A seeded run crashed after step 5 (last checkpoint at step 3): steps 4-5 were released and
    are counted; the resume draws new noise and cohorts for what follows (issue 34, H1: a replay
    under the same noise is another release when anything differs), so it is not the uninterrupted
    run, but the same crash and resume give the same model again."""
    data = mlp_data([3, 5, 2, 7, 1, 4, 6, 2, 3, 8] * 4, seed=6)
    torch.manual_seed(0)
    ref = MLP()
    init = {k: v.clone() for k, v in ref.state_dict().items()}
    r_ref = train(ref, data, ce_loss, _resume_cfg(42, algo))
    models = []
    for d in ("a", "b"):
        m = MLP()
        m.load_state_dict(init)
        with pytest.raises(Crash):  # crash after step 5: last checkpoint at step 3, steps 4-5 begun
            train(
                m,
                data,
                ce_loss,
                _resume_cfg(42, algo),
                RunOptions(checkpoint_dir=str(tmp_path / d), callbacks=[crash_at(5)]),
            )
        m2 = MLP()
        m2.load_state_dict(init)
        with pytest.raises(UserError, match="resume=True"):
            train(m2, data, ce_loss, _resume_cfg(42, algo), RunOptions(checkpoint_dir=str(tmp_path / d)))
        r = train(m2, data, ce_loss, _resume_cfg(42, algo), RunOptions(checkpoint_dir=str(tmp_path / d), resume=True))
        assert r.steps == 10 and r.record["steps_accounted"] == 12 and r.record["steps_lost_to_crashes"] == 2
        assert r.epsilon > r_ref.epsilon
        models.append(m2)
    assert not all(torch.equal(a, b) for a, b in zip(ref.parameters(), models[0].parameters(), strict=True))
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(a, b)


def test_unseeded_crash_counts_the_lost_steps(tmp_path):
    data = mlp_data([3, 5, 2, 7] * 10, seed=7)
    torch.manual_seed(0)
    m = MLP()
    cfg = _resume_cfg(None, ULS(3, 0.3))
    with pytest.raises(Crash):
        train(m, data, ce_loss, cfg, RunOptions(checkpoint_dir=str(tmp_path), callbacks=[crash_at(5)]))
    r = train(m, data, ce_loss, cfg, RunOptions(checkpoint_dir=str(tmp_path), resume=True))
    # steps 4 and 5 ran with secret randomness that is gone: they may have been seen, so they count
    assert r.steps == 10 and r.record["steps_accounted"] == 12 and r.record["steps_lost_to_crashes"] == 2
    from userdp.engine import checkpoint

    assert "noise_rng" not in checkpoint.load(str(tmp_path))  # secret random state never written


def test_crash_before_the_first_checkpoint_still_counts(tmp_path):
    data = mlp_data([3, 5, 2, 7] * 10, seed=7)
    cfg = _resume_cfg(None, ULS(3, 0.3))
    with pytest.raises(Crash):
        train(MLP(), data, ce_loss, cfg, RunOptions(checkpoint_dir=str(tmp_path), callbacks=[crash_at(2)]))
    with pytest.raises(UserError, match="resume=True"):
        train(MLP(), data, ce_loss, cfg, RunOptions(checkpoint_dir=str(tmp_path)))
    r = train(MLP(), data, ce_loss, cfg, RunOptions(checkpoint_dir=str(tmp_path), resume=True))
    assert r.record["steps_accounted"] == 12 and r.record["steps_lost_to_crashes"] == 2


def test_resume_refuses_a_different_config(tmp_path):
    data = user_data([2] * 20, d=2)
    cfg = TrainConfig(
        algorithm=ULS(2, 0.3),
        steps=2,
        noise_multiplier=1.0,
        delta=1e-5,
        seed=0,
        accountant="rdp",
        performance=Performance(track_epsilon=False),
    )
    train(Mean(2), data, sq_loss, cfg, RunOptions(checkpoint_dir=str(tmp_path)))
    with pytest.raises(UserError, match="different config"):
        train(
            Mean(2),
            data,
            sq_loss,
            dataclasses.replace(cfg, noise_multiplier=2.0),
            RunOptions(checkpoint_dir=str(tmp_path), resume=True),
        )


def test_callbacks_get_metrics_and_loss_fn_shape_is_checked():
    data = user_data([2] * 30, d=2)
    seen = []
    train(
        Mean(2),
        data,
        sq_loss,
        TrainConfig(algorithm=ELS(2, 0.2), steps=4, noise_multiplier=1.0, delta=1e-5, seed=0, accountant="rdp"),
        RunOptions(callbacks=[seen.append]),
    )
    assert [m["step"] for m in seen] == [1, 2, 3, 4]
    for k in ["loss", "epsilon_spent", "fraction_clipped", "units", "units_per_s", "clip_norm"]:
        assert k in seen[0]
    assert all(b["epsilon_spent"] >= a["epsilon_spent"] for a, b in itertools.pairwise(seen))
    with pytest.raises(UserError, match="one loss per record"):
        train(
            Mean(2),
            data,
            lambda m, b: sq_loss(m, b).sum(),
            TrainConfig(algorithm=ULS(2, 0.5), steps=1, noise_multiplier=1.0, delta=1e-5, accountant="rdp"),
        )


def test_ctrl_c_finishes_the_step_saves_it_and_resume_loses_nothing(tmp_path):
    """SIGINT mid-run (before any periodic checkpoint): the step in flight completes, a checkpoint
    is written, and an unseeded resume continues with no step lost or counted twice."""
    import signal

    data = mlp_data([3, 5, 2, 7] * 10, seed=7)
    cfg = _resume_cfg(None, ULS(3, 0.3))  # unseeded: a lost step would be counted as spent
    with sigint_raises():  # the press is delivered to the engine's deferred handler
        with pytest.raises(KeyboardInterrupt) as info:
            train(MLP(), data, ce_loss, cfg, RunOptions(checkpoint_dir=str(tmp_path), callbacks=[ctrl_c_at(2)]))
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handler restored
    assert info.value.record["stopped"] == "interrupted" and info.value.steps == 2
    r = train(MLP(), data, ce_loss, cfg, RunOptions(checkpoint_dir=str(tmp_path), resume=True))
    assert r.steps == 10 and r.record["steps_accounted"] == 10 and r.record["steps_lost_to_crashes"] == 0
