"""The rounding bounds behind every clip factor (userdp.engine.rounding), and what the ghost
norm's bound costs an honest user."""

import numpy as np
import pytest
import torch

from userdp.engine.clipping import FlatClip, StepClipping
from userdp.engine.ghost import bound as ghost_bound
from userdp.engine.ghost import strategy as ghost_strategy
from userdp.engine.rounding import gamma, round_down_to, unit_roundoff
from userdp.errors import UserError


def test_round_down_never_rounds_up_and_keeps_exact_values():
    rng = np.random.default_rng(0)
    c = torch.from_numpy(rng.uniform(0, 2, 100_000))
    c[:3] = torch.tensor([1.0, 0.5, 0.0], dtype=torch.float64)
    out = round_down_to(c, torch.float32)
    assert out.dtype == torch.float32
    assert (out.double() <= c).all()
    assert torch.equal(out[:3], torch.tensor([1.0, 0.5, 0.0]))
    # at most one float32 ulp below: nothing is thrown away beyond the rounding
    assert ((c - out.double()) <= torch.finfo(torch.float32).eps * c.clamp(min=1e-30)).all()
    plain = c.float()
    assert (plain.double() > c).any(), "plain rounding does round some factors up (what the helper prevents)"


def test_gamma_is_the_classical_bound_and_refuses_what_it_cannot_bound():
    u = unit_roundoff(torch.float32, False)
    assert u == 2.0**-24 and unit_roundoff(torch.float32, True) == 2.0**-23
    assert unit_roundoff(torch.float64, False) == 2.0**-53
    assert gamma(1000, u) == pytest.approx(1000 * u / (1 - 1000 * u))
    # a float32 sum of n random terms stays inside gamma_n times the sum of magnitudes
    rng = np.random.default_rng(1)
    for n in (10, 1000, 100_000):
        x = rng.normal(size=n).astype(np.float32)
        exact = float(np.sum(x.astype(np.float64)))
        got = float(torch.from_numpy(x).sum())
        assert abs(got - exact) <= gamma(n, u) * float(np.abs(x).astype(np.float64).sum())
    with pytest.raises(UserError, match="chunk_size"):
        gamma(1 << 23, u)


def test_the_bound_costs_an_honest_gpt2_user_under_one_percent_of_its_clip():
    """The clip factor divides by an upper bound, not the estimate: on a GPT-2 (ULS, G = 4 x 32
    tokens) the flat bound exceeds the estimate by well under 1% (utility is kept)."""
    from userdp.lm import models

    torch.manual_seed(0)
    model = models.build_preset("tiny", vocab_size=512, n_positions=64).train()
    ids = torch.randint(0, 512, (4, 4, 32))
    st = ghost_strategy.GhostPerUnit(model, models.causal_lm_loss, type("A", (), {"update": "gradient"})())
    seen = {}
    real = ghost_bound.bounded_norms

    def spy(parts, m):
        seen["est"], seen["up"] = real(parts, m)
        return seen["est"], seen["up"]

    ghost_bound.bounded_norms = spy
    try:
        st.clipped_sum(
            {"input_ids": ids, "labels": ids.clone()},
            torch.ones(4, 4),
            torch.ones(4),
            StepClipping(FlatClip(1.0), {"clip_norm": 1.0}, torch.float32),
        )
    finally:
        ghost_bound.bounded_norms = real
    est, up = seen["est"], seen["up"]
    ratio = (up**2).sum(1).sqrt() / (est**2).sum(1).sqrt()
    assert (ratio >= 1.0).all()
    assert (ratio < 1.01).all(), ratio
