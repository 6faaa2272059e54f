"""The neighbour test (issue 34): the same seeded step with and without one adversarial user
releases sums that differ by at most C, on every path that releases a noisy sum.

The adversaries: records whose per-token gradients cancel (the Gram-form norm loses the unit's
norm to rounding: before the bound, one user reached 3x C in float32), huge values, one record
repeated, a user with many records, non-finite values."""

import numpy as np
import pytest
import torch
from _neighbours import ADVERSARIES, Reg, builder, cancelling, honest, reg_loss

from userdp.engine import ELS, ULS, FedAvg, FlatClip, PerLayerClip, contraction
from userdp.engine.ghost import bound as ghost_bound
from userdp.engine.ghost import stacks as ghost_stacks
from userdp.engine.neighbour import join, neighbour_gap
from userdp.engine.performance import Performance
from userdp.engine.run.step import EngineRun

from _engine_helpers import run_gloo_pair, train_config


def config(algorithm="uls", g=2, per_unit="ghost", clip=None, seed=11, rate=1.0, **kw):
    algo = {
        "uls": ULS(group_size=g, sampling_rate=rate),
        "els": ELS(group_size=g, sampling_rate=rate),
        "fedavg": FedAvg(group_size=g, sampling_rate=rate),
    }[algorithm]
    return train_config(
        algorithm=algo,
        steps=1,
        noise_multiplier=1.0,
        clipping=clip or FlatClip(1.0),
        seed=seed,
        performance=Performance(per_unit=per_unit),
        **kw,
    )


@pytest.mark.parametrize("big", [1e2, 3e3, 1e4, 3e4])
def test_cancelling_records_cannot_buy_more_than_c_under_the_default_strategy(big):
    gap = neighbour_gap(builder(), honest(), cancelling(big), reg_loss, config(per_unit="auto"))
    assert gap.within(), f"one user's share of the sum is {gap.ratio:.4f} x C"


def test_without_the_bound_the_cancelling_user_reaches_3x_c(monkeypatch):
    """The construction of issue 34 (C1) against the estimate alone: the test above would fail."""
    monkeypatch.setattr(ghost_bound, "BOUND", False)
    gap = neighbour_gap(builder(), honest(), cancelling(3e4), reg_loss, config(per_unit="ghost"))
    assert gap.ratio > 2.0


def test_cancelling_records_in_float64_and_in_a_stack_of_layers(monkeypatch):
    monkeypatch.setattr(ghost_stacks, "STACK_FACTORS", "on")
    data64 = honest(dtype=torch.float64)
    gap = neighbour_gap(
        builder(dtype=torch.float64), data64, cancelling(1e9, torch.float64), reg_loss, config(per_unit="ghost")
    )
    assert gap.within(), gap
    lay = Reg  # three same-shaped layers: stacked on the GPU stand-in
    gap = neighbour_gap(builder(layers=3), honest(), cancelling(3e4), reg_loss, config(per_unit="ghost"))
    assert gap.within(), gap
    assert lay is Reg


@pytest.mark.parametrize("operand", ["split", "rounded"])
def test_cancelling_records_on_tensor_cores_emulated(monkeypatch, operand):
    monkeypatch.setattr(contraction, "TENSOR_CORES", "on")
    monkeypatch.setattr(contraction, "SUM_OPERAND", operand)
    gap = neighbour_gap(
        builder(layers=2), honest(), cancelling(3e4), reg_loss, config(per_unit="ghost", precision="bfloat16")
    )
    assert gap.within(), gap


@pytest.mark.parametrize("adversary", sorted(ADVERSARIES))
@pytest.mark.parametrize(
    "algorithm,per_unit,clip",
    [
        ("uls", "ghost", "flat"),
        ("uls", "vmap", "flat"),
        ("uls", "auto", "per_layer"),
        ("els", "ghost", "flat"),
        ("els", "vmap", "per_layer"),
        ("fedavg", "vmap", "flat"),
    ],
)
def test_no_adversarial_user_moves_the_released_sum_by_more_than_its_bound(adversary, algorithm, per_unit, clip):
    clipping = FlatClip(1.0) if clip == "flat" else PerLayerClip(1.0)
    cfg = config(algorithm, g=4, per_unit=per_unit, clip=clipping)
    gap = neighbour_gap(builder(layers=2), honest(g=4), ADVERSARIES[adversary](), reg_loss, cfg)
    assert gap.within(), f"{adversary}: {gap.ratio:.4f} x the bound"


@pytest.mark.parametrize("algorithm", ["uls", "els", "fedavg"])
def test_an_added_user_moves_no_other_users_membership(algorithm):
    """One user never changes another user's membership: with an author of more than G records
    appended, every other unit's records (ELS's D') and its Poisson draw at every step are the
    same. (ELS once drew D' from the cohort's generator, so the added user's draws moved every
    later cohort; a neighbour test at rate 1 could not see it.)"""
    data = honest(n_users=12, g=6)  # every user holds more than G records: D' draws for each
    bigger = join(data, ADVERSARIES["repeated"]())  # 8 records, more than G
    cfg = config(algorithm, g=2, rate=0.5, per_unit="auto")
    small, big = (EngineRun(builder()(), d, reg_loss, cfg) for d in (data, bigger))
    try:
        n = small.n_units
        assert big.n_units > n
        assert np.array_equal(big.table.users[:n], small.table.users)
        if small.table.records is not None:
            assert np.array_equal(big.table.records[:n], small.table.records)
        drawn = 0
        for step in range(25):
            a = small.sampler.sample(
                small.n_units, small.rate, step, small.chunks.cohort_rng(step), small.sampler_state
            )
            b = big.sampler.sample(big.n_units, big.rate, step, big.chunks.cohort_rng(step), big.sampler_state)
            assert np.array_equal(np.sort(a), np.sort(b[b < n])), f"step {step}: the others' cohort moved"
            drawn += len(a)
        assert 0.3 * 25 * n < drawn < 0.7 * 25 * n  # sampled at q = 0.5, not all or none
    finally:
        for run in (small, big):
            run.chunks.close()


@pytest.mark.parametrize("adversary", ["repeated", "many_records", "cancelling_many"])
@pytest.mark.parametrize("algorithm", ["uls", "els"])
def test_below_rate_one_an_adversarial_user_moves_the_sum_by_at_most_its_bound(adversary, algorithm):
    # at q < 1 the cohort is a draw: the neighbour test must hold there too, for users of more than G records
    cfg = config(algorithm, g=2, rate=0.5)
    gap = neighbour_gap(builder(layers=2), honest(n_users=12, g=6), ADVERSARIES[adversary](), reg_loss, cfg)
    assert gap.within(), f"{adversary}: {gap.ratio:.4f} x the bound"


@pytest.mark.parametrize("adversary", ["cancelling", "huge", "nonfinite"])
@pytest.mark.parametrize("algorithm,per_unit", [("uls", "auto"), ("els", "ghost"), ("fedavg", "vmap")])
def test_a_loop_written_around_make_private_releases_no_more_than_the_bound(adversary, algorithm, per_unit):
    # the caller's own loop (step.backward()) is a release path of its own: held to the same bound
    cfg = config(algorithm, g=4, per_unit=per_unit)
    gap = neighbour_gap(builder(layers=2), honest(g=4), ADVERSARIES[adversary](), reg_loss, cfg, entry="make_private")
    assert gap.within(), f"{adversary}: {gap.ratio:.4f} x the bound"
    same = neighbour_gap(builder(layers=2), honest(g=4), ADVERSARIES[adversary](), reg_loss, cfg)
    assert abs(same.gap - gap.gap) <= 1e-6 * max(1.0, gap.gap)  # the same release as train's


TWO_RANK_CASES = [
    ("uls", "auto", "cancelling", "none"),
    ("uls", "ghost", "huge", "none"),
    ("els", "ghost", "cancelling", "none"),
    ("fedavg", "vmap", "nonfinite", "none"),
    ("uls", "auto", "cancelling", "fsdp"),
    ("uls", "ghost", "nonfinite", "fsdp"),
    ("els", "ghost", "cancelling", "fsdp"),
    ("els", "ghost", "many_records", "fsdp"),
]


def _gloo_rank(rank: int) -> list:
    """One of two gloo processes: the neighbour gap of each two-rank case (run_gloo_pair)."""
    from userdp.engine.distributed.processes import TorchDistributedCombiner

    out = []
    for algorithm, per_unit, adversary, sharding in TWO_RANK_CASES:
        gap = neighbour_gap(
            builder(layers=2),
            honest(g=4),
            ADVERSARIES[adversary](),
            reg_loss,
            config(algorithm, g=4, per_unit=per_unit, sharding=sharding),
            combiner=TorchDistributedCombiner(),
        )
        out.append((gap.gap, gap.within()))
    return out


@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed (gloo)")
def test_two_gloo_ranks_that_split_the_cohort_release_no_more_than_the_bound():
    # each rank clips its share of the cohort; the shares are all-reduced over gloo (sharding: none), or
    # reduce-scattered to the ranks' halves of each parameter (sharding: fsdp, FSDP2; the sum gathered whole
    # to measure it)
    results = run_gloo_pair(_gloo_rank)
    for (gap0, ok0), (gap1, ok1), case in zip(results[0], results[1], TWO_RANK_CASES, strict=True):
        assert ok0 and ok1, f"{case}: {gap0:.4f} / {gap1:.4f} x the bound"
        assert gap0 == gap1  # both ranks release the one all-reduced sum


def lora_builder(layers=2):
    """The regression stack with LoRA adapters (r = 2) on every layer: only the adapters train."""
    from peft import LoraConfig, get_peft_model

    def build():
        torch.manual_seed(3)
        base = Reg(layers)
        model = get_peft_model(base, LoraConfig(r=2, lora_alpha=4, target_modules=["0", "1"], lora_dropout=0.0))
        torch.manual_seed(4)
        for n, p in model.named_parameters():  # B = 0 at init would make the adapters' gradient trivial
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.5)
        return model

    return build


@pytest.mark.parametrize("adversary", ["cancelling", "huge", "many_records", "nonfinite"])
@pytest.mark.parametrize("algorithm,per_unit", [("uls", "auto"), ("els", "ghost"), ("uls", "vmap")])
def test_lora_adapters_release_no_more_than_the_bound(adversary, algorithm, per_unit):
    pytest.importorskip("peft")
    cfg = config(algorithm, g=4, per_unit=per_unit)
    gap = neighbour_gap(lora_builder(), honest(g=4), ADVERSARIES[adversary](), reg_loss, cfg)
    assert gap.within(), f"{adversary}: {gap.ratio:.4f} x the bound"


def test_the_gap_of_a_run_against_itself_is_zero():
    gap = neighbour_gap(builder(), honest(), None, reg_loss, config())
    assert gap.gap == 0.0
