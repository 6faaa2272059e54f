"""Canary users: deterministic from their seed, fair coin flips, secrets from ordinary tokens, and
a training view that appends them without disturbing the real users."""

import math

import numpy as np
import pytest
import torch
from scipy import stats

from userdp.audit.canaries import Canaries, WithCanaries, new_seed, ordinary_token_ids
from userdp.engine.performance import Performance
from userdp.engine.user_data import TensorUserData
from userdp.errors import UserError

VOCAB = np.arange(5, 300)


def test_same_seed_same_canaries_and_a_fresh_seed_differs():
    a = Canaries.generate(123, 50, 16, 3, VOCAB)
    b = Canaries.generate(123, 50, 16, 3, VOCAB)
    c = Canaries.generate(124, 50, 16, 3, VOCAB)
    assert np.array_equal(a.secrets, b.secrets) and np.array_equal(a.included, b.included)
    assert not np.array_equal(a.secrets, c.secrets)
    assert a.secrets.shape == (50, 16) and np.isin(a.secrets, VOCAB).all()
    s1, s2 = new_seed(), new_seed()
    assert s1 != s2 and max(s1, s2) >= 2**100  # 128-bit draws (this fails with odds ~2^-27)


def test_inclusion_is_a_fair_coin_per_canary():
    inc = Canaries.generate(99, 20000, 2, 1, VOCAB).included
    # two-sided binomial test at 1e-4 (fixed seed): the coin is fair
    assert stats.binomtest(int(inc.sum()), inc.size, 0.5).pvalue > 1e-4
    # and independent of the secret (a canary's first token says nothing about its inclusion)
    c = Canaries.generate(99, 20000, 2, 1, VOCAB)
    low = c.secrets[:, 0] < np.median(VOCAB)
    table = [
        [int((low & c.included).sum()), int((low & ~c.included).sum())],
        [int((~low & c.included).sum()), int((~low & ~c.included).sum())],
    ]
    assert stats.chi2_contingency(table).pvalue > 1e-4


def test_refusals():
    with pytest.raises(UserError, match="at least 2 canaries"):
        Canaries.generate(1, 1, 8, 1, VOCAB)
    with pytest.raises(UserError, match="secret_tokens"):
        Canaries.generate(1, 4, 1, 1, VOCAB)


def test_ordinary_tokens_exclude_special_tokens():
    from userdp.data.tokenize import PublicText, train_bpe

    tok = train_bpe(PublicText(["the king is dead long live the queen"] * 50, description="test text"), vocab_size=300)
    ids = ordinary_token_ids(tok)
    special = set(tok.get_added_tokens_decoder())
    assert special and not (set(ids.tolist()) & special)
    assert len(ids) == tok.get_vocab_size() - len(special)


def _inner():
    # 3 real users with 1, 3, 2 records of width 6; record r of user u holds token 10*u + r
    rows, offsets = [], [0]
    for u, n in enumerate([1, 3, 2]):
        for r in range(n):
            rows.append([10 * u + r] * 6)
        offsets.append(offsets[-1] + n)
    ids = torch.tensor(rows)
    return TensorUserData({"input_ids": ids, "labels": ids.clone()}, np.array(offsets))


def test_with_canaries_appends_included_canaries_as_users():
    c = Canaries.generate(5, 6, 4, 3, np.arange(200, 260))
    data = WithCanaries(_inner(), c.training_users(6))
    k = int(c.included.sum())
    assert data.num_users == 3 + k
    assert data.sizes().tolist() == [1, 3, 2] + [3] * k
    # gather across both parts keeps the caller's order and pads to one width
    users = np.array([3, 1, 0, 3 + k - 1])
    b = data.gather(users, np.array([2, 1, 0, 0]))
    assert b["input_ids"].shape == (4, 6)
    secret0 = c.secrets[np.flatnonzero(c.included)[0]]
    assert b["input_ids"][0, :4].tolist() == secret0.tolist()
    assert b["labels"][0, 4:].tolist() == [-100, -100]  # padding of the 4-token secret is ignored
    assert b["input_ids"][1].tolist() == [11] * 6 and b["input_ids"][2].tolist() == [0] * 6


def test_with_canaries_draws_and_bounds_like_the_contract():
    c = Canaries.generate(5, 6, 4, 3, np.arange(200, 260))
    data = WithCanaries(_inner(), c.training_users(6))
    rng = np.random.default_rng(0)
    users = np.arange(data.num_users)
    batch, mask = data.draw_records(users, 2, rng)
    assert batch["input_ids"].shape == (data.num_users, 2, 6)
    assert mask.tolist()[:3] == [[1, 0], [1, 1], [1, 1]] and (mask[3:] == 1).all()
    u, r = data.bounded_records(2, rng)
    counts = np.bincount(u, minlength=data.num_users)
    assert counts.tolist() == [1, 2, 2] + [2] * (data.num_users - 3)
    assert (r < data.sizes()[u]).all()
    for x in range(data.num_users):  # distinct records per user, grouped by user
        assert len(set(r[u == x].tolist())) == counts[x]
    assert np.all(np.diff(u) >= 0)


def test_no_included_canary_is_refused_not_silently_unaudited():
    c = Canaries(np.zeros((2, 4), np.int64), np.array([False, False]), 1)
    with pytest.raises(UserError, match="no canary"):
        c.training_users(4)


def test_roughly_half_are_included_in_a_default_sized_draw():
    inc = Canaries.generate(2026, 400, 8, 2, VOCAB).included
    assert abs(inc.sum() - 200) < 4 * math.sqrt(100)


def test_gradient_canaries_go_through_clipping_like_any_unit():
    """One SGD step on the mean model (no noise): an included gradient canary moves its own
    coordinate by exactly C/den (its update of norm 100 C is clipped to C); with clipping off,
    by 100 C/den. Real users' records carry audit_on = 0 and are unchanged by the canary term."""
    from userdp import engine as E
    from userdp.audit.canaries import GradientCanaries, gradient_canary_loss
    from userdp.audit.faults import broken_train_plan

    from _engine_helpers import Mean, linear_loss

    d = 40
    c = GradientCanaries.generate(11, 8, 1, "theta", d, 100.0)
    assert len(set(c.coords.tolist())) == 8
    inc = np.flatnonzero(c.included)
    real = TensorUserData({"x": torch.zeros(3, d)}, np.arange(4))  # three users whose gradient is 0

    canary_rows = {
        "x": torch.zeros(len(inc), d),
        "audit_coord": torch.from_numpy(c.coords[inc]),
        "audit_on": torch.ones(len(inc)),
    }
    data = WithCanaries(real, TensorUserData(canary_rows, np.arange(len(inc) + 1)))
    loss = gradient_canary_loss(linear_loss, "theta", c.scale)

    def step(fault):
        cfg = E.TrainConfig(
            algorithm=E.ULS(group_size=1, sampling_rate=1.0),
            steps=1,
            clipping=E.FlatClip(1.0),
            optimizer=E.SGD(lr=1.0),
            noise_multiplier=1.0,
            seed=0,
            delta=1e-5,
            performance=Performance(per_unit="vmap"),
        )
        model = Mean(d)
        E.train(model, data, loss, broken_train_plan(cfg, data, fault) if fault else cfg)
        return model.theta.detach().numpy()

    den = 3 + len(inc)
    quiet = step("noise_off")
    want = np.zeros(d)
    want[c.coords[inc]] = 1.0 / den
    assert np.allclose(quiet, want, atol=1e-6)
    loose = step("clipping_off") - step(None)  # same seeded noise: the unclipped minus the clipped
    want[c.coords[inc]] = (100.0 - 1.0) / den
    assert np.allclose(loose, want, atol=1e-4)


def test_the_gradient_alignment_score_is_each_canarys_own_gradient_against_the_move(monkeypatch):
    """score_k = <g_k, theta_0 - theta_T> / ||g_k|| with g_k canary k's own gradient at theta_0: the
    vmapped chunks (several canaries a backward, a chunk smaller than the count) give what one
    autograd call per canary gives, and the model's weights are left as they were."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from userdp.audit import scores as S
    from userdp.lm import models

    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=2, n_positions=16, attn_implementation="eager")
    )
    secrets = np.random.default_rng(0).integers(0, 97, (23, 10))

    class Secrets:
        count = len(secrets)

        def batch(self, which):
            x = torch.from_numpy(secrets[np.asarray(which)])
            return {"input_ids": x, "labels": x.clone()}

    start = S.trainable_snapshot(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    final = [p.detach().clone() for p in model.parameters()]
    n_params = sum(p.numel() for p in model.parameters())
    monkeypatch.setattr(S, "GRADIENT_CHUNK_BYTES", 4 * n_params * 5)  # chunks of 5: 23 = 4 x 5 + 3
    got = S.gradient_alignment(model, Secrets(), start)
    assert all(torch.equal(p, f) for p, f in zip(model.parameters(), final, strict=True))
    with torch.no_grad():
        for p, s in zip(model.parameters(), start, strict=True):
            p.copy_(s)
    model.eval()
    want = []
    for k in range(len(secrets)):
        g = torch.autograd.grad(models.causal_lm_loss(model, Secrets().batch([k])).sum(), list(model.parameters()))
        dot = sum(float((gi.double() * (s - f).double()).sum()) for gi, s, f in zip(g, start, final, strict=True))
        want.append(dot / sum(float(gi.double().pow(2).sum()) for gi in g) ** 0.5)
    assert np.allclose(got, want, rtol=1e-5, atol=1e-9), np.max(np.abs(got - np.array(want)))
