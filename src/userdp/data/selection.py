"""Contribution bounding: at most G records per user (Chua et al. 2024, §4.1), and the perplexity cache.

:func:`bound_contributions` keeps, for each user, at most ``group_size`` records chosen by

- ``random``: uniformly at random (a fixed choice from ``seed``);
- ``longest`` / ``shortest``: by length (token lengths when given, else characters);
- ``highest_ppl`` / ``lowest_ppl``: by perplexity under the initial pre-trained model
  (:func:`perplexity_scores`).

Ties break by dataset order. Kept records stay in dataset order. The result is a
:class:`~userdp.data.subset.UserSubset`, which :func:`userdp.data.tokenize.tokenize_store` and the
engine adapter consume. *Random chunk* (a fresh window of the model's sequence length at a random
offset of the user's concatenated records, every draw) is not a fixed subset: it is
:class:`userdp.data.torch_data.RandomChunkUserData`.

Perplexity-based selection reads the private records with a model outside the DP mechanism: a
*data touch* that the privacy report must disclose. :func:`perplexity_scores` returns a
:class:`DataTouch` describing it (also when the scores come from the cache).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from userdp.data.subset import UserSubset
from userdp.errors import UserError
from userdp.fileio import write_atomic

STRATEGIES = ("random", "longest", "shortest", "highest_ppl", "lowest_ppl")


@dataclasses.dataclass(frozen=True)
class DataTouch:
    """A non-private use of the private data, for the privacy report."""

    purpose: str
    model_id: str
    store_fingerprint: str
    records_touched: int
    users_touched: int
    from_cache: bool
    statement: str

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def bound_contributions(
    store,
    group_size: int,
    strategy: str = "random",
    *,
    subset: Optional[UserSubset] = None,
    seed: Optional[int] = None,
    scores: Optional[np.ndarray] = None,
) -> UserSubset:
    """At most ``group_size`` records of each user of ``subset`` (default: all of ``store``).

    ``scores`` is indexed by store row (length ``store.num_records``): token lengths for
    longest/shortest (characters are used when omitted), perplexities for *_ppl (required).
    """
    if strategy not in STRATEGIES:
        raise UserError(f"selection strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    g = int(group_size)
    if g < 1:
        raise UserError(f"group size G must be >= 1, got {group_size}")
    subset = subset or UserSubset.full(store.sizes())
    rows = subset.rows(store.offsets)
    sizes = subset.sizes()
    owner = np.repeat(np.arange(subset.num_users), sizes)
    if strategy == "random":
        if seed is None:
            raise UserError("random selection needs a seed (so the choice is reproducible)")
        key = np.random.default_rng(seed).random(len(rows))
    elif strategy in ("longest", "shortest"):
        s = store.record_chars() if scores is None else np.asarray(scores)
        if len(s) != store.num_records:
            raise UserError(f"lengths must have one entry per store record ({store.num_records}), got {len(s)}")
        key = s[rows].astype(np.float64)
        if strategy == "longest":
            key = -key
    else:
        if scores is None:
            raise UserError(f"{strategy} selection needs perplexities (see perplexity_scores)")
        s = np.asarray(scores, dtype=np.float64)
        if len(s) != store.num_records:
            raise UserError(f"perplexities must have one entry per store record ({store.num_records}), got {len(s)}")
        key = s[rows]
        if np.isnan(key).any():
            raise UserError("some selected records have no perplexity (score the same subset you select from)")
        if strategy == "highest_ppl":
            key = -key
    position = np.arange(len(rows))
    order = np.lexsort((position, key, owner))  # by user, then key, then dataset order
    rank = np.arange(len(rows)) - np.repeat(subset.rec_offsets[:-1], sizes)
    kept = order[rank < g]  # rank computed on the sorted order: first g of each user
    kept = np.sort(kept)  # back to dataset order within each user
    kept_owner = owner[kept]
    counts = np.bincount(kept_owner, minlength=subset.num_users).astype(np.int64)
    offs = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return UserSubset(subset.users.copy(), offs, subset.records[kept])


def perplexity_scores(
    store,
    score_fn: Callable[[list[str]], Sequence[float]],
    model_id: str,
    *,
    subset: Optional[UserSubset] = None,
    cache_dir=None,
    batch_size: int = 64,
) -> tuple[np.ndarray, DataTouch]:
    """Per-record perplexity under a model, computed once and cached.

    ``score_fn(texts) -> perplexities`` (one positive float per text) keeps this module free of
    the LM code. ``model_id`` must identify the model's weights (e.g. a checkpoint hash): the
    cache is keyed by it, the store fingerprint and the subset. Returns an array indexed by store
    row (NaN outside ``subset``) and the :class:`DataTouch` to put in the privacy report.
    """
    if not model_id:
        raise UserError("perplexity scoring needs a model id (it keys the cache and the privacy report)")
    subset = subset or UserSubset.full(store.sizes())
    key = hashlib.blake2b("|".join([model_id, store.fingerprint, subset.fingerprint()]).encode(), digest_size=12).hexdigest()
    root = Path(cache_dir) if cache_dir is not None else store.path / "perplexity"
    path = root / f"ppl-{key}.npy"
    n_users = int((subset.sizes() > 0).sum())
    touch = lambda cached: DataTouch(  # noqa: E731
        purpose="record selection by perplexity (docs/data.md)",
        model_id=model_id,
        store_fingerprint=store.fingerprint,
        records_touched=subset.num_records,
        users_touched=n_users,
        from_cache=cached,
        statement=(
            f"The pre-trained model {model_id} scored {subset.num_records:,} private records of "
            f"{n_users:,} users outside the DP mechanism to choose which records to train on."
        ),
    )
    if path.is_file():
        return np.load(path), touch(True)
    rows = subset.rows(store.offsets)
    out = np.full(store.num_records, np.nan, dtype=np.float64)
    for a in range(0, len(rows), batch_size):
        r = rows[a : a + batch_size]
        texts = list(store._column_rows("text", r))
        vals = np.asarray(score_fn(texts), dtype=np.float64).reshape(-1)
        if len(vals) != len(r):
            raise UserError(f"the perplexity function returned {len(vals)} values for {len(r)} texts")
        if not np.all(np.isfinite(vals)) or (vals <= 0).any():
            raise UserError("the perplexity function returned a non-finite or non-positive value")
        out[r] = vals
    write_atomic(path, _npy_bytes(out))
    return out, touch(False)


def _npy_bytes(a: np.ndarray) -> bytes:
    """``a`` in NumPy's .npy format (what ``np.load`` reads)."""
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()
