"""Held-out-user evaluation of a causal LM: loss and perplexity, and personalization (docs/data.md).

* :func:`evaluate_lm` — next-token loss over every target token of the held-out users'
  records. Two averages: over tokens (``loss``, ``perplexity = exp(loss)``) and over users
  (``user_loss``: each user's own token-average, then the mean over users, so prolific users do
  not dominate; ``user_perplexity = exp(user_loss)``).
* :func:`personalize` — for each test user with at least two records: fine-tune a copy of the
  model on half of the user's records (4 local epochs of SGD by default), evaluate on the other
  half, and compare with the non-personalized model on the same half.

Evaluation runs on users held out from training, so it touches no training record; it is not
part of the DP mechanism and is not accounted (the held-out users are not protected by the
training guarantee if the evaluation numbers are released).
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from userdp import progress
from userdp.lm import models
from userdp.validation import MAX_EPOCHS, check_fields, check_int, check_positive


def _batches(data, users: np.ndarray, records: np.ndarray, batch_size: int):
    for s in range(0, len(users), batch_size):
        yield users[s : s + batch_size], data.gather(users[s : s + batch_size], records[s : s + batch_size])


def _pairs(data, users: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    sizes = data.sizes()
    users = np.arange(data.num_users) if users is None else np.asarray(users, dtype=np.int64)
    u = np.repeat(users, sizes[users])
    r = np.concatenate([np.arange(sizes[x]) for x in users]) if len(users) else np.zeros(0, np.int64)
    return u, r.astype(np.int64)


@torch.no_grad()
def record_nll(model, data, users: np.ndarray, records: np.ndarray, batch_size: int = 64, show: bool = False):
    """Summed NLL and target-token count of each (user, record) pair; ``show``: a progress bar
    (the held-out evaluation; not the per-user calls of personalization or the audit's scores)."""
    model.eval()
    nll = np.zeros(len(users))
    cnt = np.zeros(len(users))
    pos = 0
    with (
        progress.bar(len(users), "evaluating", "rec", lines=progress.LOOP_LINES)
        if show
        else contextlib.nullcontext() as shown
    ):
        for _, batch in _batches(data, users, records, batch_size):
            s, c = models.token_nll(model, batch)
            n = len(s)
            nll[pos : pos + n] = s.double().numpy()
            cnt[pos : pos + n] = c.double().numpy()
            pos += n
            if shown is not None:
                shown.update(n)
    return nll, cnt


def summarize(users: np.ndarray, nll: np.ndarray, cnt: np.ndarray) -> dict:
    tokens = float(cnt.sum())
    if tokens == 0:
        return {
            "loss": float("nan"),
            "perplexity": float("nan"),
            "user_loss": float("nan"),
            "user_perplexity": float("nan"),
            "num_users": 0,
            "num_records": 0,
            "num_tokens": 0,
        }
    loss = float(nll.sum() / tokens)
    uniq, inv = np.unique(users, return_inverse=True)
    u_nll = np.bincount(inv, weights=nll)
    u_cnt = np.bincount(inv, weights=cnt)
    ok = u_cnt > 0
    user_loss = float(np.mean(u_nll[ok] / u_cnt[ok]))
    return {
        "loss": loss,
        "perplexity": math.exp(min(loss, 700)),
        "user_loss": user_loss,
        "user_perplexity": math.exp(min(user_loss, 700)),
        "num_users": int(ok.sum()),
        "num_records": int(len(users)),
        "num_tokens": int(tokens),
    }


def evaluate_lm(model, data, users: Sequence[int] | None = None, batch_size: int = 64, combiner=None) -> dict:
    """Loss and perplexity over the users of ``data`` (a UserData of held-out users).

    ``combiner`` (:mod:`userdp.engine.distributed.processes`): with several processes each scores every
    ``world_size``-th record and one all-reduce gives every rank the whole result."""
    u, r = _pairs(data, users)
    if combiner is None or combiner.world_size == 1:
        nll, cnt = record_nll(model, data, u, r, batch_size, show=True)
        return summarize(u, nll, cnt)
    mine = np.arange(combiner.rank, len(u), combiner.world_size)
    both = torch.zeros(2, len(u), dtype=torch.float64)
    part_nll, part_cnt = record_nll(model, data, u[mine], r[mine], batch_size, show=True)
    both[0, mine], both[1, mine] = torch.from_numpy(part_nll), torch.from_numpy(part_cnt)
    both = combiner.all_reduce_sum([both])[0].cpu()
    return summarize(u, both[0].numpy(), both[1].numpy())


@dataclass(frozen=True)
class Personalization:
    """How :func:`personalize` fine-tunes a copy of the model per user: SGD at ``lr`` for ``epochs``
    over the user's training half in batches of ``batch_size`` records, the halves drawn by
    ``seed``."""

    lr: float = 0.05
    epochs: int = 4
    batch_size: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        check_fields(
            self,
            lr=(check_positive, "personalization learning rate"),
            epochs=(check_int, "personalization epochs", 1, MAX_EPOCHS),
            batch_size=(check_int, "personalization batch size"),
            seed=(check_int, "personalization seed", 0),
        )


#: records scored in one forward by :func:`personalize`
PERSONALIZE_EVAL_BATCH = 64


def personalize(model, data, users: Sequence[int] | None = None, how: Personalization | None = None) -> dict:
    """docs/data.md personalization: per user, SGD on half the records, evaluate on the other half.

    The records of each user are split by a seeded permutation: the first ``floor(n/2)`` train,
    the rest evaluate. Users with fewer than two records are skipped (counted). Returns the
    token- and user-averaged loss/perplexity of the base and personalized models on the
    evaluation halves, and how many users improved.
    """
    how = how or Personalization()
    lr, epochs, batch_size, eval_batch = how.lr, how.epochs, how.batch_size, PERSONALIZE_EVAL_BATCH
    rng = np.random.default_rng(how.seed)
    sizes = data.sizes()
    users = np.arange(data.num_users) if users is None else np.asarray(users, dtype=np.int64)
    base_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    work = copy.deepcopy(model)
    params = [p for p in work.parameters() if p.requires_grad]
    eu, base_nll, base_cnt, pers_nll, pers_cnt = [], [], [], [], []
    skipped = 0
    for u in users:
        n = int(sizes[u])
        if n < 2:
            skipped += 1
            continue
        perm = rng.permutation(n)
        tr, ev = perm[: n // 2], perm[n // 2 :]
        uu = np.full(len(ev), u, dtype=np.int64)
        b_nll, b_cnt = record_nll(model, data, uu, ev, eval_batch)
        work.load_state_dict(base_state)
        opt = torch.optim.SGD(params, lr=lr)
        work.train()
        for _ in range(epochs):
            order = rng.permutation(tr)
            for s in range(0, len(order), batch_size):
                idx = order[s : s + batch_size]
                batch = data.gather(np.full(len(idx), u, dtype=np.int64), idx)
                loss = models.causal_lm_loss(work, batch).mean()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
        p_nll, p_cnt = record_nll(work, data, uu, ev, eval_batch)
        eu.append(uu)
        base_nll.append(b_nll)
        base_cnt.append(b_cnt)
        pers_nll.append(p_nll)
        pers_cnt.append(p_cnt)
    if not eu:
        return {"users": 0, "skipped_users_with_one_record": skipped}
    eu_a = np.concatenate(eu)
    base = summarize(eu_a, np.concatenate(base_nll), np.concatenate(base_cnt))
    pers = summarize(eu_a, np.concatenate(pers_nll), np.concatenate(pers_cnt))
    per_user_gain = [
        float(b.sum() / max(c.sum(), 1) - p.sum() / max(d.sum(), 1))
        for b, c, p, d in zip(base_nll, base_cnt, pers_nll, pers_cnt, strict=True)
    ]
    return {
        "users": len(eu),
        "skipped_users_with_one_record": skipped,
        "lr": lr,
        "epochs": epochs,
        "base": base,
        "personalized": pers,
        "users_improved": int(sum(g > 0 for g in per_user_gain)),
        "mean_user_loss_gain": float(np.mean(per_user_gain)),
    }
