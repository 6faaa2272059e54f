"""make_private: user-level DP in the caller's own loop, step for step the engine's train()."""

import json
import os

import numpy as np
import pytest
import torch
from _paths import REPO

from userdp import accounting
from userdp.engine import ELS, SGD, ULS, Adam, FedAvg, FlatClip, RunOptions, TrainConfig, make_private, train
from userdp.engine.journal import JOURNAL, steps_begun
from userdp.errors import UserError

from _engine_helpers import MLP, Mean, ce_loss, mlp_data, sq_loss, train_config, user_data

SIZES = np.random.default_rng(3).integers(1, 9, 60)


def _cfg(algorithm, optimizer, **kw):
    base = dict(
        algorithm=algorithm,
        steps=6,
        clipping=FlatClip(0.5),
        optimizer=optimizer,
        noise_multiplier=1.3,
        delta=1e-4,
        seed=11,
        chunk_size=4,
    )
    base.update(kw)
    return train_config(**base)


def _own_loop(model, optimizer, data, cfg, **kw):
    metrics = []
    with make_private(model, optimizer, data, ce_loss, cfg, **kw) as private:
        for step in private:
            optimizer.zero_grad()
            metrics.append(step.backward())
            optimizer.step()
        return private, metrics


@pytest.mark.parametrize(
    "algorithm,opt,torch_opt",
    [
        (
            ULS(group_size=3, sampling_rate=0.3),
            SGD(lr=0.2, momentum=0.9),
            lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.9),
        ),
        pytest.param(
            ELS(group_size=2, sampling_rate=0.2),
            Adam(lr=0.01),
            lambda ps: torch.optim.Adam(ps, lr=0.01),
            marks=pytest.mark.slow,
        ),
        pytest.param(
            FedAvg(group_size=3, sampling_rate=0.3, local_lr=0.1),
            SGD(lr=1.0),
            lambda ps: torch.optim.SGD(ps, lr=1.0),
            marks=pytest.mark.slow,
        ),
    ],
)
def test_same_seed_same_model_as_train(algorithm, opt, torch_opt):
    data = mlp_data(SIZES)
    cfg = _cfg(algorithm, opt)
    torch.manual_seed(0)
    reference = MLP()
    mine = MLP()
    mine.load_state_dict(reference.state_dict())
    res = train(reference, data, ce_loss, cfg)
    private, metrics = _own_loop(mine, torch_opt(list(mine.parameters())), data, cfg)
    for a, b in zip(reference.parameters(), mine.parameters(), strict=True):
        assert torch.equal(a, b)
    assert [m["units"] for m in metrics] == [m["units"] for m in res.history]
    assert [m["loss"] for m in metrics] == [m["loss"] for m in res.history]
    rec = private.record()
    assert rec["epsilon"] == res.epsilon and rec["steps_applied"] == res.steps == 6
    assert rec["stopped"] == "completed" and rec["step_event"] == res.record["step_event"]
    assert rec["optimizer"]["type"].startswith("torch.optim.") and rec["optimizer"]["source"].startswith("the caller")


def test_the_update_is_noisy_and_a_different_seed_gives_another_model():
    data = mlp_data(SIZES)
    cfg = _cfg(ULS(group_size=3, sampling_rate=0.3), SGD(lr=0.2))
    models = []
    for seed in (1, 2):
        torch.manual_seed(0)
        m = MLP()
        opt = torch.optim.SGD(m.parameters(), lr=0.2)
        _own_loop(m, opt, data, train_config(**{**cfg.__dict__, "seed": seed}))
        models.append(torch.cat([p.detach().flatten() for p in m.parameters()]))
    assert not torch.equal(models[0], models[1])


def test_grad_is_replaced_not_accumulated_and_stray_grads_never_leak():
    """A gradient the caller's code left in p.grad (e.g. from a backward on private data) is
    replaced by the release, never added to it."""
    data = user_data([3] * 40, d=4)
    cfg = TrainConfig(
        algorithm=ULS(group_size=2, sampling_rate=0.5),
        steps=2,
        clipping=FlatClip(1.0),
        noise_multiplier=1.0,
        delta=1e-4,
        seed=5,
    )
    model = Mean(4)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    grads = []
    with make_private(model, opt, data, sq_loss, cfg) as private:
        for step in private:
            model.theta.grad = torch.full((4,), 1e6)  # stray
            step.backward()
            grads.append(model.theta.grad.clone())
            opt.step()
    ref_model = Mean(4)
    ref = []
    with make_private(ref_model, torch.optim.SGD(ref_model.parameters(), lr=0.0), data, sq_loss, cfg) as private:
        for step in private:
            step.backward()
            ref.append(ref_model.theta.grad.clone())
    for a, b in zip(grads, ref, strict=True):
        assert torch.equal(a, b) and float(a.abs().max()) < 1e3


@pytest.mark.slow
def test_budget_stops_the_loop_before_the_step_that_would_pass_it():
    data = mlp_data(SIZES)
    cfg = _cfg(ULS(group_size=3, sampling_rate=0.5), SGD(lr=0.1), steps=400, noise_multiplier=2.0, target_epsilon=4.0)
    torch.manual_seed(0)
    model = MLP()
    private, metrics = _own_loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data, cfg)
    assert private.stopped == "budget"
    assert 0 < len(metrics) < 400
    assert private.epsilon() <= 4.0
    # one more step would have passed the target
    more = accounting.compose(private.plan.step_event, len(metrics) + 1)
    assert accounting.epsilon(more, private.delta) > 4.0


def test_epsilon_at_another_delta_is_rederived_from_the_event():
    data = mlp_data(SIZES)
    cfg = _cfg(ELS(group_size=2, sampling_rate=0.2), SGD(lr=0.1))
    torch.manual_seed(0)
    model = MLP()
    private, _ = _own_loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data, cfg)
    total = accounting.compose(private.plan.step_event, 6)
    assert private.epsilon() == pytest.approx(accounting.epsilon(total, 1e-4), rel=1e-9)
    assert private.epsilon(1e-6) == pytest.approx(accounting.epsilon(total, 1e-6), rel=1e-9)
    assert private.epsilon(1e-6) > private.epsilon()


def test_backward_twice_or_never_is_refused():
    data = mlp_data(SIZES)
    cfg = _cfg(ULS(group_size=3, sampling_rate=0.3), SGD(lr=0.1))
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with make_private(model, opt, data, ce_loss, cfg) as private:
        for step in private:
            step.backward()
            with pytest.raises(UserError, match="already released"):
                step.backward()
            break
        assert private._run.ledger.spent == 1  # the refused call released nothing
    m = MLP()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with make_private(m, opt, data, ce_loss, cfg) as private:
        with pytest.raises(UserError, match="without step.backward"):
            for _step in private:
                pass
    held = None
    with make_private(m, opt, data, ce_loss, cfg) as private:
        for step in private:
            held = step
            step.backward()
            opt.step()
        with pytest.raises(UserError, match="step is over"):
            held.backward()


def test_the_optimizer_must_hold_exactly_the_trainable_parameters():
    data = mlp_data(SIZES)
    cfg = _cfg(ULS(group_size=3, sampling_rate=0.3), SGD(lr=0.1))
    model = MLP()
    params = list(model.parameters())
    with pytest.raises(UserError, match="exactly the model's 6 trainable"):
        make_private(model, torch.optim.SGD(params[:-1], lr=0.1), data, ce_loss, cfg)
    with pytest.raises(UserError, match="exactly"):
        make_private(model, torch.optim.SGD(params + [torch.nn.Parameter(torch.zeros(2))], lr=0.1), data, ce_loss, cfg)
    with pytest.raises(UserError, match="torch.optim.Optimizer"):
        make_private(model, SGD(lr=0.1), data, ce_loss, cfg)
    half = MLP().to(torch.bfloat16)
    with pytest.raises(UserError, match="bfloat16"):
        make_private(half, torch.optim.SGD(half.parameters(), lr=0.1), data, ce_loss, cfg)
    # frozen parameters are not the optimizer's business
    model.net[0].weight.requires_grad_(False)
    rest = [p for p in model.parameters() if p.requires_grad]
    make_private(model, torch.optim.SGD(rest, lr=0.1), data, ce_loss, cfg).close()


def test_journal_checkpoints_and_a_resume_that_never_reuses_noise(tmp_path):
    """Issue 34 (H1): steps begun after the checkpoint were replayed under the same seeded noise,
    but the caller's loop state (a scheduler, an EMA) is not in the checkpoint, so the replay took
    a gradient at other parameters: two releases of one step differing by a noiseless function,
    counted once. Now those steps are counted as spent and the run is keyed anew (seed + steps
    begun): the resumed model differs from the uncrashed one, and every step is in the ledger."""
    data = mlp_data(SIZES)
    cfg = _cfg(ULS(group_size=3, sampling_rate=0.3), SGD(lr=0.2, momentum=0.9), steps=8, checkpoint_every=3)
    torch.manual_seed(0)
    init = MLP().state_dict()

    whole = MLP()
    whole.load_state_dict(init)
    _own_loop(whole, torch.optim.SGD(whole.parameters(), lr=0.2, momentum=0.9), data, cfg)

    ck = str(tmp_path / "ck")
    cut = MLP()
    cut.load_state_dict(init)
    opt = torch.optim.SGD(cut.parameters(), lr=0.2, momentum=0.9)
    with make_private(cut, opt, data, ce_loss, cfg, RunOptions(checkpoint_dir=ck)) as private:
        for step in private:
            step.backward()
            opt.step()
            if step.index == 5:  # a crash after step 5: the checkpoint holds step 3, the journal 5 steps
                break
    assert steps_begun(os.path.join(ck, JOURNAL)) == 5
    with pytest.raises(UserError, match="already holds a checkpoint|already private"):
        make_private(cut, opt, data, ce_loss, cfg, RunOptions(checkpoint_dir=ck))

    again = MLP()  # a fresh process: the model and optimizer come back from the checkpoint
    opt2 = torch.optim.SGD(again.parameters(), lr=0.2, momentum=0.9)
    grads = []
    with make_private(again, opt2, data, ce_loss, cfg, RunOptions(checkpoint_dir=ck, resume=True)) as private:
        assert private.step == 3 and private._run.rekeyed_at == 5
        for step in private:
            step.backward()
            grads.append([p.grad.clone() for p in again.parameters()])
            opt2.step()
        rec = private.record()
    assert not all(torch.equal(a, b) for a, b in zip(whole.parameters(), again.parameters(), strict=True))
    # steps 4 and 5 were released before the crash and are counted; the 5 steps after the checkpoint
    # ran under new noise; the ledger holds every release
    assert rec["steps_lost_to_crashes"] == 2 and rec["steps_accounted"] == 10 and rec["journal"] is not None
    assert steps_begun(os.path.join(ck, JOURNAL)) == 10
    json.dumps(rec.to_dict(), allow_nan=False)  # the record is strict JSON
    # reproducible all the same: the same crash and resume give the same model
    ck2 = str(tmp_path / "ck2")
    cut2 = MLP()
    cut2.load_state_dict(init)
    o = torch.optim.SGD(cut2.parameters(), lr=0.2, momentum=0.9)
    with make_private(cut2, o, data, ce_loss, cfg, RunOptions(checkpoint_dir=ck2)) as private:
        for step in private:
            step.backward()
            o.step()
            if step.index == 5:
                break
    third = MLP()
    o3 = torch.optim.SGD(third.parameters(), lr=0.2, momentum=0.9)
    with make_private(third, o3, data, ce_loss, cfg, RunOptions(checkpoint_dir=ck2, resume=True)) as private:
        for step in private:
            step.backward()
            o3.step()
    assert all(torch.equal(a, b) for a, b in zip(again.parameters(), third.parameters(), strict=True))


def test_a_nonprivate_config_says_so():
    data = mlp_data(SIZES)
    cfg = _cfg(ULS(group_size=3, sampling_rate=0.3), SGD(lr=0.1), noise_multiplier=0.0)
    model = MLP()
    private, _ = _own_loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data, cfg)
    assert private.epsilon() == float("inf") and private.epsilon(1e-6) == float("inf")
    assert "NOT differentially private" in private.record()["warning"]


@pytest.mark.slow
def test_the_examples_run_as_documented(capsys, monkeypatch):
    """examples/own_loop.py and examples/engine_quickstart.py as the README runs them (in this
    process: the imports are already paid)."""
    import runpy
    import sys

    root = str(REPO)
    for name, expect in (("own_loop.py", "(completed)"), ("engine_quickstart.py", "spent epsilon")):
        path = os.path.join(root, "examples", name)
        monkeypatch.setattr(sys, "argv", [path])
        runpy.run_path(path, run_name="__main__")
        out = capsys.readouterr().out
        assert expect in out
    eps = float(out.split("spent epsilon = ")[1].split()[0])
    assert 0 < eps <= 2.0


def test_two_ranks_of_the_own_loop_give_one_process_model():
    from test_distributed import SIZES as DSIZES
    from test_distributed import _cfg as dcfg

    from _engine_helpers import run_ranks as _run_ranks

    def loop(model, combiner=None):
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        with make_private(
            model, opt, user_data(DSIZES, d=64, seed=2), sq_loss, dcfg(), RunOptions(combiner=combiner)
        ) as p:
            for step in p:
                opt.zero_grad()
                step.backward()
                opt.step()
            return p.record()

    models = [Mean(64) for _ in range(2)]
    records, shared = _run_ranks(2, lambda r, comb: loop(models[r], comb))
    single = Mean(64)
    ref = loop(single)
    assert shared["calls"] == [8, 8]  # per step: the statistics, then the noised clipped sum
    for r in range(2):
        assert torch.allclose(models[r].theta, single.theta, atol=1e-6)
        assert records[r]["steps_accounted"] == ref["steps_accounted"] == 4


def test_make_private_twice_on_one_model_is_refused_once_a_step_was_released():
    """Issue 34 (L1): a second make_private started a fresh ledger (nine releases reported as the
    last call's epsilon alone)."""
    data = mlp_data(SIZES)
    cfg = _cfg(ULS(group_size=3, sampling_rate=0.3), SGD(lr=0.1))
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with make_private(model, opt, data, ce_loss, cfg) as private:
        for step in private:
            step.backward()
            opt.step()
            break
    with pytest.raises(UserError, match="already private"):
        make_private(model, opt, data, ce_loss, cfg)


def test_a_loop_that_puts_batchnorm_back_in_training_mode_is_refused_at_the_release():
    """Issue 34 (H2): the linter ran once, at build; a model put in eval() before make_private and
    train() in the loop (the PyTorch idiom) updated running statistics from the un-noised cohort."""

    class BNNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(6, 3)
            self.bn = torch.nn.BatchNorm1d(3)

        def forward(self, x):
            return self.bn(self.lin(x))

    data = mlp_data(SIZES)
    cfg = _cfg(ULS(group_size=3, sampling_rate=0.3), SGD(lr=0.1), per_unit="vmap")
    model = BNNet().eval()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    with make_private(model, opt, data, ce_loss, cfg) as private:
        for step in private:
            model.train()
            with pytest.raises(UserError, match="training mode at a private step"):
                step.backward()
            break
        assert private._run.ledger.spent == 0  # refused before the ledger counted anything
