"""Membership scores: how much better the trained model predicts a user's text than the model it
started from. A higher score means "more likely trained on".

* canaries: the mean next-token loss of the canary's secret under the starting model minus that
  under the trained model (the loss-difference score of Steinke et al. 2023's black-box audit;
  subtracting the starting model's loss removes how predictable each secret was to begin with);
* real users (Kandpal et al. 2023, user inference): the same difference averaged over a user's
  records — a likelihood ratio of the user's text under the fine-tuned vs the pretrained model.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from userdp.engine.algorithms import ULS
from userdp.engine.per_unit import VmapPerUnit
from userdp.lm import models
from userdp.lm.evaluate import record_nll

#: records scored in one forward (:func:`user_losses`, :func:`canary_losses`)
SCORE_BATCH = 64
#: bytes of per-canary gradients held at once (:func:`gradient_alignment`)
GRADIENT_CHUNK_BYTES = 256 << 20


@torch.no_grad()
def canary_losses(model, canaries, batch_size: int = SCORE_BATCH) -> np.ndarray:
    """Mean next-token NLL (nats/token) of each canary's secret under ``model``; float64 [K]."""
    was_training = model.training
    model.eval()
    out = np.zeros(canaries.count)
    try:
        for s in range(0, canaries.count, batch_size):
            idx = np.arange(s, min(canaries.count, s + batch_size))
            nll, cnt = models.token_nll(model, canaries.batch(idx))
            out[idx] = (nll.double() / cnt.double().clamp(min=1)).numpy()
    finally:
        model.train(was_training)
    return out


def pick_users(num_users: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Up to ``k`` distinct user indices, sorted."""
    k = min(int(k), int(num_users))
    return np.sort(rng.choice(num_users, k, replace=False)) if k > 0 else np.zeros(0, np.int64)


def user_losses(
    model,
    data,
    users: np.ndarray,
    max_records: int,
    rng: np.random.Generator | None = None,
    records: list | None = None,
):
    """Token-weighted mean NLL of each user's records under ``model`` (up to ``max_records`` of
    each, drawn once with ``rng`` unless ``records`` gives them). Returns ``(losses, records)`` so
    the same records can be scored under a second model."""
    was_training = model.training
    sizes = data.sizes()
    if records is None:
        rng = rng or np.random.default_rng(0)
        records = [np.sort(rng.choice(int(sizes[u]), min(int(sizes[u]), max_records), replace=False)) for u in users]
    if len(users) == 0:
        return np.zeros(0), records
    uu = np.concatenate([np.full(len(r), u, np.int64) for u, r in zip(users, records, strict=True)])
    rr = np.concatenate(records).astype(np.int64)
    try:
        nll, cnt = record_nll(model, data, uu, rr, SCORE_BATCH)
    finally:
        model.train(was_training)
    bounds = np.cumsum([0] + [len(r) for r in records])
    out = np.array([nll[a:b].sum() / max(1.0, cnt[a:b].sum()) for a, b in itertools.pairwise(bounds)])
    return out, records


def trainable_snapshot(model) -> list[torch.Tensor]:
    """A host copy of the trainable parameters (the starting point of a white-box score)."""
    return [p.detach().to("cpu", copy=True) for p in model.parameters() if p.requires_grad]


def gradient_alignment(model, canaries, start: list[torch.Tensor]) -> np.ndarray:
    """White-box score: how far training moved the weights along each canary's gradient.

    score_k = <g_k, theta_0 - theta_T> / ||g_k||, with g_k the gradient of canary k's mean loss at
    the starting weights theta_0 (``start``, from :func:`trainable_snapshot`). Under DP noise the
    optimizer's update is close to linear in the noisy sum (Adam's second moment is dominated by
    the noise), so a canary that was summed in moves theta along -g_k. The model's weights are
    restored before returning.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    final = [p.detach().clone() for p in params]
    delta = [(s.to(f.device, f.dtype) - f) for s, f in zip(start, final, strict=True)]  # theta_0 - theta_T
    was_training = model.training
    model.eval()
    out = np.zeros(canaries.count)
    # each canary's gradient from one vmapped backward over a chunk of canaries (the engine's vmap
    # per-unit strategy: a unit of one record), as many at a time as fit in GRADIENT_CHUNK_BYTES
    per_record = VmapPerUnit(model, models.causal_lm_loss, ULS(group_size=1, sampling_rate=1.0))
    chunk = max(1, GRADIENT_CHUNK_BYTES // (4 * sum(p.numel() for p in params)))
    try:
        with torch.no_grad():
            for p, s in zip(params, start, strict=True):
                p.copy_(s.to(p.device, p.dtype))
        for lo in range(0, canaries.count, chunk):
            idx = np.arange(lo, min(canaries.count, lo + chunk))
            batch = {k: v.unsqueeze(1).to(params[0].device) for k, v in canaries.batch(idx).items()}
            grads, _ = per_record(batch, torch.ones(len(idx), 1, device=params[0].device))
            dot = norm2 = 0.0  # in float64, one parameter at a time
            for g, d in zip(grads, delta, strict=True):
                g = g.double().flatten(1)
                dot = dot + g @ d.double().flatten()
                norm2 = norm2 + g.pow(2).sum(1)
            out[idx] = (dot / norm2.sqrt().clamp(min=1e-30)).cpu().numpy()
    finally:
        with torch.no_grad():
            for p, f in zip(params, final, strict=True):
                p.copy_(f)
        model.train(was_training)
    return out
