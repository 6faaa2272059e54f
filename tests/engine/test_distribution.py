"""The distribution part (userdp.engine.distributed.distribution): the loop asks it how the sums accumulate
and how the noised sum is released, and branches on none of it; a new distribution is one file
(examples/plugins/three_way_split.py, three ranks' partial sums dealt out in one process) that a
run takes by name, releases the replicated run's sum and passes the neighbour test."""

import ast

import numpy as np
import pytest
import torch
from _neighbours import ADVERSARIES, builder, honest, reg_loss
from _paths import REPO

from userdp import plugins
from userdp.engine import ELS, SGD, ULS, FedAvg, FlatClip, train
from userdp.engine.distributed.distribution import DISTRIBUTIONS, Replicated, Sharded
from userdp.engine.neighbour import neighbour_gap
from userdp.engine.noise.mechanism import IIDGaussian
from userdp.errors import UserError

from _engine_helpers import MLP, ce_loss, mlp_data, train_config

EXAMPLE = REPO / "examples" / "plugins" / "three_way_split.py"


def _config(algorithm="uls", sharding="none", **kw):
    alg = {"uls": ULS(2, 1.0), "els": ELS(2, 1.0), "fedavg": FedAvg(2, 1.0, local_epochs=1, local_lr=0.1)}[algorithm]
    base = dict(
        algorithm=alg,
        steps=2,
        clipping=FlatClip(1.0),
        optimizer=SGD(lr=0.1),
        noise_multiplier=1.0,
        delta=1e-5,
        seed=11,
        chunk_size=2,
        sharding=sharding,
    )
    return train_config(**{**base, **kw})


def test_no_engine_module_but_the_distribution_decides_by_the_sharding():
    """No engine module but distribution.py (and sharding.py, FSDP2's own tools) compares a sharding
    name, reads a ``sharded`` flag or names a DTensor: the loop asks its distribution part."""
    engine = REPO / "src" / "userdp" / "engine"
    for path in sorted(engine.glob("*.py")):
        if path.name in ("distribution.py", "sharding.py"):
            continue
        code = ast.unparse(ast.parse(path.read_text()))  # the code, without comments
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.Constant) and node.value == "fsdp":
                raise AssertionError(f"{path.name}: compares the sharding name 'fsdp'")
            if isinstance(node, ast.Attribute) and node.attr in ("sharded", "to_local", "full_tensor"):
                raise AssertionError(f"{path.name}: reads .{node.attr}")


def test_the_built_in_distributions_differ_only_in_the_stages_they_override():
    r, s = Replicated(), Sharded()
    assert DISTRIBUTIONS.lookup("none") is Replicated and DISTRIBUTIONS.lookup("fsdp") is Sharded
    assert (r.per_unit("auto"), s.per_unit("auto"), s.per_unit("vmap")) == ("auto", "ghost", "vmap")
    assert r.chunks(7, 2, 2) is None and s.chunks(7, 2, 2) == 2  # every rank as many as the busiest
    assert r.draws_ahead() and not s.draws_ahead()  # a model-sized buffer a sharded rank must not hold
    assert not s.lazy_zeroing(torch.device("cpu")) and not r.lazy_zeroing(torch.device("cpu"))

    class WholeUpdate(IIDGaussian):  # a mechanism of its own update: where the model is whole only
        def update(self, sums, state, std):
            return sums, state

    class Old:  # the contract before 0.9: its add_noise would never be called
        def add_noise(self, tensors, std):
            pass

    r.check_noise(WholeUpdate(None))
    s.check_noise(IIDGaussian(None))
    with pytest.raises(UserError, match="overrides update"):
        s.check_noise(WholeUpdate(None))
    for dist in (r, s):
        with pytest.raises(UserError, match=r"Old defines add_noise\(\), the contract before userdp 0.9"):
            dist.check_noise(Old())

    class Bare:  # duck-typed, without the methods the run calls: refused now, not inside a step
        def update(self, sums, state, std):
            return sums, state

    for dist in (r, s):
        with pytest.raises(UserError, match=r"Bare has no init, begin_step, scalar, state_dict, load_state\(\)"):
            dist.check_noise(Bare())
    with pytest.raises(UserError, match=r"sharding must be one of none, fsdp"):
        _config(sharding="fsdb")


@pytest.fixture
def three_way(isolated_registries):
    plugins.load(str(EXAMPLE), source="--plugin")
    assert "three_way_split" in DISTRIBUTIONS


@pytest.mark.usefixtures("three_way")
@pytest.mark.parametrize("algorithm", ["uls", "els", "fedavg"])
def test_a_distribution_in_one_file_releases_the_replicated_runs_sum(algorithm):
    models, records = {}, {}
    sizes = np.random.default_rng(5).integers(1, 6, 40)
    for sharding in ("none", "three_way_split"):
        torch.manual_seed(0)
        model = MLP()
        res = train(model, mlp_data(sizes), ce_loss, _config(algorithm, sharding, chunk_size=3, steps=3))
        models[sharding] = [p.detach().clone() for p in model.parameters()]
        records[sharding] = res.record.to_dict()
    # the same cohorts and the same noise; only the order of the float32 additions differs
    for a, b in zip(models["none"], models["three_way_split"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    drop = {"journal"}
    assert {k: v for k, v in records["none"].items() if k not in drop} == {
        k: v for k, v in records["three_way_split"].items() if k not in drop
    }


@pytest.mark.usefixtures("three_way")
@pytest.mark.parametrize("adversary", ["cancelling", "huge", "many_records", "nonfinite"])
def test_a_distribution_in_one_file_passes_the_neighbour_test(adversary):
    cfg = _config("uls", "three_way_split", steps=1)
    gap = neighbour_gap(builder(layers=2), honest(n_users=7, g=2), ADVERSARIES[adversary](), reg_loss, cfg)
    assert gap.within(), f"{adversary}: {gap.ratio:.4f} x the bound"
