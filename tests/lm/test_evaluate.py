"""Held-out evaluation: token- and user-averaged loss; personalization; the LM batch adapter."""

import math

import numpy as np
import torch

from userdp.engine.user_data import TensorUserData
from userdp.lm import evaluate as E
from userdp.lm import models


def test_token_and_user_averages():
    users = np.array([0, 0, 1])
    nll = np.array([2.0, 4.0, 9.0])  # user 0: 6 nats over 3 tokens; user 1: 9 over 3
    cnt = np.array([1.0, 2.0, 3.0])
    s = E.summarize(users, nll, cnt)
    assert math.isclose(s["loss"], 15 / 6)
    assert math.isclose(s["perplexity"], math.exp(15 / 6))
    assert math.isclose(s["user_loss"], (2.0 + 3.0) / 2)
    assert s["num_users"] == 2 and s["num_tokens"] == 6


def _data(V=20, L=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (9, L), generator=g)
    labels = ids.clone()
    labels[:, 6:] = -100
    return TensorUserData({"input_ids": ids, "labels": labels}, np.array([0, 2, 5, 9]))


def test_evaluate_matches_direct_loss():
    m = models.build_preset("tiny", vocab_size=20, n_positions=16)
    d = _data()
    res = E.evaluate_lm(m, d, batch_size=4)
    with torch.no_grad():
        per = models.causal_lm_loss(m, d.tensors)  # 5 target tokens per record
    assert math.isclose(res["loss"], float(per.mean()), rel_tol=1e-5)
    assert res["num_records"] == 9 and res["num_tokens"] == 9 * 5


def test_personalization_improves_on_repetitive_users():
    torch.manual_seed(0)
    m = models.build_preset("tiny", vocab_size=20, n_positions=16)
    # each user repeats one sequence: fine-tuning on half must help on the other half
    rows = []
    for u in range(3):
        seq = torch.randint(0, 20, (8,), generator=torch.Generator().manual_seed(u))
        rows += [seq] * 4
    ids = torch.stack(rows)
    d = TensorUserData({"input_ids": ids, "labels": ids.clone()}, np.array([0, 4, 8, 12]))
    res = E.personalize(m, d, how=E.Personalization(lr=0.1, epochs=4, batch_size=2))
    assert res["users"] == 3
    assert res["personalized"]["loss"] < res["base"]["loss"]
    assert res["users_improved"] == 3


def test_tokenized_userdata_pads_with_ignored_labels():
    from types import SimpleNamespace

    from userdp.data.torch_data import TokenizedUserData

    t = SimpleNamespace(
        mode="truncate",
        seq_len=5,
        pad_id=0,
        tokens=np.array([5, 6, 7, 8, 9, 10, 11], dtype=np.int32),
        seq_offsets=np.array([0, 3, 7]),
        user_offsets=np.array([0, 1, 2]),
        sizes=lambda: np.array([1, 1]),
    )
    d = TokenizedUserData(t)
    b = d.gather(np.array([0, 1]), np.array([0, 0]))
    assert b["input_ids"].tolist() == [[5, 6, 7, 0, 0], [8, 9, 10, 11, 0]]
    assert b["labels"].tolist() == [[5, 6, 7, -100, -100], [8, 9, 10, 11, -100]]
    assert d.sizes().tolist() == [1, 1]
