"""Issue 37's first brick, proven on CPU processes: per-unit clipping needs nothing from the weights.

Under FSDP2 (``fully_shard`` per block and at the root; two gloo processes) every parameter is a
DTensor shard, and the weights exist whole only while FSDP has gathered them, layer by layer. The
ghost strategy reads a layer's captured inputs and output gradients alone, so its per-unit norms and
clipped sums of a sharded model are the unsharded model's, bit for bit, on each rank's own units.
With a ``sink`` the strategy hands each parameter's sum over as soon as it is formed, one at a time
and in the parameters' order (the same on every rank: the collectives pair up), and the
reduce-scatter of those leaves each rank its shard of the total. The training loop on top of this
is tests/engine/test_fsdp_train.py."""

import pytest
import torch

from userdp.engine.clipping import StepClipping

from _engine_helpers import run_gloo_pair

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed (gloo)")


def _plain_and_sharded():
    """A tiny GPT-2, and the same one with each block and the root passed through ``fully_shard``."""
    from torch.distributed.fsdp import fully_shard

    from userdp.lm import models

    torch.manual_seed(0)
    plain = models.build_preset("tiny", vocab_size=64, n_positions=32).train()
    torch.manual_seed(0)
    sharded = models.build_preset("tiny", vocab_size=64, n_positions=32).train()
    for block in sharded.transformer.h:
        fully_shard(block)
    fully_shard(sharded)
    return plain, sharded


def _rank(rank: int) -> dict:
    from userdp.engine import ULS
    from userdp.engine.clipping import FlatClip
    from userdp.engine.distributed.sharding import GatheredCoverage
    from userdp.engine.ghost import GhostPerUnit
    from userdp.engine.precision import Precision
    from userdp.lm.models import causal_lm_loss

    plain, sharded = _plain_and_sharded()
    kinds = sorted({type(p).__name__ for p in sharded.parameters()})
    ids = torch.randint(0, 64, (4, 2, 12), generator=torch.Generator().manual_seed(10 + rank))  # rank's own units
    batch, mask = {"input_ids": ids, "labels": ids.clone()}, torch.ones(4, 2)
    out = {}
    for name, model in (("plain", plain), ("sharded", sharded)):
        coverage = GatheredCoverage if name == "sharded" else None  # the distribution's part
        st = GhostPerUnit(model, causal_lm_loss, ULS(2, 0.5), Precision("float32"), coverage=coverage)
        if name == "sharded":
            st.coverage.unchecked = []  # the coverage check of DTensor gradients is the next test
        per_unit = []
        for u in range(4 if name == "sharded" else 0):  # each unit alone: its clipped contribution
            w = torch.zeros(4)
            w[u] = 1.0
            sums, norms, _, bad = st.clipped_sum(
                batch, mask, w, StepClipping(FlatClip(0.5), {"clip_norm": 0.5}, torch.float32)
            )
            per_unit.append(float(torch.sqrt(sum((s.double() ** 2).sum() for s in sums))))
        sums, norms, _, bad = st.clipped_sum(
            batch, mask, torch.ones(4), StepClipping(FlatClip(0.5), {"clip_norm": 0.5}, torch.float32)
        )
        out[name] = ([s.clone() for s in sums], norms.clone(), per_unit, bool(bad.any()))
    (plain_sums, plain_norms, _, _), (sums, norms, per_unit, bad) = out["plain"], out["sharded"]
    return {
        "kinds": kinds,
        "same_sums": all(torch.equal(a, b) for a, b in zip(plain_sums, sums, strict=True)),
        "same_norms": torch.equal(plain_norms, norms),
        "norms": norms.tolist(),
        "per_unit": per_unit,
        "bad": bad,
        "shapes": [tuple(s.shape) for s in sums][:2],
    }


def test_ghost_norms_and_clipped_sums_of_a_fully_sharded_model_are_the_unsharded_models():
    results = run_gloo_pair(_rank)
    for rank, r in results.items():
        assert r["kinds"] == ["DTensor"]  # every parameter is a shard
        assert r["same_norms"] and r["same_sums"], rank  # bit for bit, on this rank's own units
        assert r["shapes"][0] == (64, 128)  # without a sink the sums are whole (the sink's test is below)
        assert not r["bad"] and min(r["norms"]) > 0.5  # every unit is clipped ...
        assert max(r["per_unit"]) <= 0.5 * (1 + 1e-6)  # ... and adds at most C
    assert results[0]["norms"] != results[1]["norms"]  # the ranks held different units


def _sink_rank(rank: int) -> dict:
    import torch.distributed as dist

    from userdp.engine import ULS
    from userdp.engine.clipping import FlatClip
    from userdp.engine.distributed.sharding import GatheredCoverage, reduce_scatter
    from userdp.engine.ghost import GhostPerUnit
    from userdp.engine.precision import Precision
    from userdp.lm.models import causal_lm_loss

    plain, sharded = _plain_and_sharded()
    ids = torch.randint(0, 64, (4, 2, 12), generator=torch.Generator().manual_seed(10 + rank))
    batch, mask, w = {"input_ids": ids, "labels": ids.clone()}, torch.ones(4, 2), torch.ones(4)
    ref, _, _, _ = GhostPerUnit(plain, causal_lm_loss, ULS(2, 0.5), Precision("float32")).clipped_sum(
        batch, mask, w, StepClipping(FlatClip(0.5), {"clip_norm": 0.5}, torch.float32)
    )
    for x in ref:
        dist.all_reduce(x)  # the replicated run's total, whole
    st = GhostPerUnit(sharded, causal_lm_loss, ULS(2, 0.5), Precision("float32"), coverage=GatheredCoverage)
    params = list(st.params)
    order, sizes, shards = [], [], {}
    groups, verified = [], []  # the coverage check's groups (a share of the model a chunk)
    pick = st.coverage.start

    def recorded(weights):
        check = pick(weights)
        if check is not None:
            groups.append(sorted(check.group))
        return check

    st.coverage.start = recorded

    def sink(j, x):
        order.append(j)
        sizes.append(tuple(x.shape) == tuple(params[j].shape))
        shards[j] = reduce_scatter(x, params[j])

    sums, norms, _, _ = st.clipped_sum(
        batch, mask, w, StepClipping(FlatClip(0.5), {"clip_norm": 0.5}, torch.float32), sink=sink
    )
    verified.append(st.coverage.verified)
    for chunk in range(1, 4):  # more chunks: the coverage check goes on, a share at a time
        more = torch.randint(0, 64, (4, 2, 12), generator=torch.Generator().manual_seed(100 * rank + chunk))
        st.clipped_sum(
            {"input_ids": more, "labels": more.clone()},
            mask,
            w,
            StepClipping(FlatClip(0.5), {"clip_norm": 0.5}, torch.float32),
        )
        verified.append(st.coverage.verified)
    gap = 0.0
    for j, r in enumerate(ref):  # this rank's rows of the whole total
        local = shards[j].to_local()
        rows = -(-r.shape[0] // 2)
        gap = max(
            gap, float((local - r[rank * rows : rank * rows + local.shape[0]]).abs().max()) if local.numel() else 0.0
        )
    return {
        "groups": groups,
        "verified": verified,
        "group_sizes": [sum(params[j].numel() for j in g) for g in groups],
        "budget": st.coverage._budget,
        "largest": max(p.numel() for p in params),
        "returned": sums,
        "order": order,
        "n": len(params),
        "one_param_each": all(sizes),
        "gap": gap,
        "scale": max(float(r.abs().max()) for r in ref),
        "local_numel": sum(shards[j].to_local().numel() for j in shards),
        "whole_numel": sum(p.numel() for p in params),
    }


@pytest.fixture(scope="module")
def sink_ranks() -> dict:
    return run_gloo_pair(_sink_rank)


def test_a_sinks_sums_come_one_parameter_at_a_time_and_reduce_scatter_to_the_total(sink_ranks):
    results = sink_ranks
    for rank, r in results.items():
        assert r["returned"] is None  # nothing whole is returned: the sink had every sum
        assert r["order"] == list(range(r["n"]))  # each parameter once, in order (the same on every rank)
        assert r["one_param_each"]  # one parameter's sum a call, never a stacked group's
        assert r["gap"] <= 1e-6 * r["scale"], rank  # the shard is this rank's rows of the two ranks' total
    assert results[0]["local_numel"] + results[1]["local_numel"] == results[0]["whole_numel"]  # 1/W each


def test_a_sharded_rank_checks_coverage_a_share_of_the_model_at_a_time(sink_ranks):
    """The first-chunk coverage check differentiates with respect to the gathered weights: whole
    batch gradients. A sharded rank compares 1/W of the parameters a chunk (at least the largest),
    so the check never holds the model's whole gradient, and every parameter is checked once."""
    for rank, r in sink_ranks.items():
        total = r["whole_numel"]
        assert r["budget"] == max(r["largest"], -(-total // 2))
        assert all(s <= r["budget"] for s in r["group_sizes"]), rank  # never more than a rank's share at once
        assert len(r["groups"]) >= 2 and r["verified"][0] is False  # not all on the first chunk
        flat = [j for g in r["groups"] for j in g]
        assert sorted(flat) == list(range(r["n"]))  # each parameter compared exactly once ...
        assert r["verified"][len(r["groups"]) - 1 :] == [True] * (5 - len(r["groups"]))  # ... then no more checks
