"""Which records of a user count (Chua et al. 2024, §4.1): the selection strategies training uses,
contribution bounding before tokenization, and the perplexity cache.

:func:`LMUserData` is what ``userdp train`` trains on (``training.selection``): the engine adapter
over a tokenized store (:class:`~userdp.data.torch_data.TokenizedUserData`), or a subclass that
ranks each user's records (:class:`RankedUserData`: longest, shortest, highest or lowest
perplexity) or draws a fresh window of the user's stream (:class:`RandomChunkUserData`).

:func:`bound_contributions` keeps, for each user, at most ``group_size`` records chosen by

- ``random``: uniformly at random (a fixed choice from ``seed``);
- ``longest`` / ``shortest``: by length (token lengths when given, else characters);
- ``highest_ppl`` / ``lowest_ppl``: by perplexity under the initial pre-trained model
  (:func:`perplexity_scores`).

Ties break by dataset order. Kept records stay in dataset order. The result is a
:class:`~userdp.data.subset.UserSubset`, which :func:`userdp.data.tokenize.tokenize_store` and the
engine adapter consume. *Random chunk* (a fresh window of the model's sequence length at a random
offset of the user's concatenated records, every draw) is not a fixed subset: it is
:class:`RandomChunkUserData`.

Perplexity-based selection reads the private records with a model outside the DP mechanism: a
*data touch* that the privacy report must disclose. :func:`perplexity_scores` returns a
:class:`DataTouch` describing it (also when the scores come from the cache).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from userdp.data.subset import UserSubset
from userdp.data.tokenize import TokenizedStore
from userdp.data.torch_data import TokenizedUserData
from userdp.engine.user_data import Batch
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
    subset: UserSubset | None = None,
    seed: int | None = None,
    scores: np.ndarray | None = None,
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
    subset: UserSubset | None = None,
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
    key = hashlib.blake2b(
        "|".join([model_id, store.fingerprint, subset.fingerprint()]).encode(), digest_size=12
    ).hexdigest()
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


class RandomChunkUserData(TokenizedUserData):
    """Random chunk: each draw is a ``seq_len`` window at a fresh random offset of the user's stream.

    Needs a tokenization whose user streams are contiguous (``full`` or ``pack`` mode). A user
    gets ``min(G, ceil(T_u / seq_len))`` windows (T_u = the user's tokens), each at an
    independent uniform offset in ``[0, max(0, T_u - seq_len)]``; the other slots are masked.
    """

    def __init__(self, tokenized: TokenizedStore, seq_len: int | None = None):
        if tokenized.mode not in ("full", "pack"):
            raise UserError("random-chunk selection needs a 'full' or 'pack' tokenization (whole user streams)")
        super().__init__(tokenized, seq_len)
        so, uo = tokenized.seq_offsets, tokenized.user_offsets
        self.stream_start = so[uo[:-1]]
        self.stream_len = so[uo[1:]] - self.stream_start

    def draw_records(self, users: np.ndarray, group_size: int, rng: np.random.Generator):
        users = np.asarray(users, dtype=np.int64)
        g = int(group_size)
        if g < 1:
            raise UserError(f"group size G must be >= 1, got {group_size}")
        L = self.seq_len
        T = self.stream_len[users]
        k = np.minimum(g, np.maximum(1, -(-T // L)))
        span = np.maximum(0, T - L)
        offs = np.floor(rng.random((len(users), g)) * (span[:, None] + 1)).astype(np.int64)
        mask = (np.arange(g)[None, :] < k[:, None]).astype(np.float32)
        starts = (self.stream_start[users][:, None] + offs).reshape(-1)
        lengths = np.repeat(np.minimum(T, L), g)
        flat = self._batch(starts, lengths)
        m = len(users)
        batch = {kk: v.reshape(m, g, L) for kk, v in flat.items()}
        return batch, torch.from_numpy(mask)


class RankedUserData(TokenizedUserData):
    """Fixed per-user preference order: record 0 of a user is its top-ranked sequence.

    ``draw_records`` returns each user's first ``min(G, n_u)`` ranked sequences (the same every
    call: longest / shortest / lowest or highest perplexity, Chua et al. 2024, §4.1); ``gather`` indexes in
    ranked order too, so an ELS table that takes records ``0..G-1`` of a user honours the choice.
    ``key`` has one entry per sequence of the view; lower keys rank first; ties keep dataset order.
    """

    def __init__(self, tokenized: TokenizedStore, key: np.ndarray, seq_len: int | None = None):
        super().__init__(tokenized, seq_len)
        key = np.asarray(key, dtype=np.float64)
        n_seq = int(tokenized.user_offsets[-1])
        if key.shape != (n_seq,):
            raise UserError(f"selection scores must have one entry per sequence ({n_seq}), got {key.shape}")
        if np.isnan(key).any():
            raise UserError("selection scores contain NaN")
        owner = np.repeat(np.arange(self.num_users), self._sizes)
        order = np.lexsort((np.arange(n_seq), key, owner))
        self._ranked = order - np.repeat(tokenized.user_offsets[:-1], self._sizes)  # within-user index

    def gather(self, users: np.ndarray, records: np.ndarray) -> Batch:
        users = np.asarray(users, dtype=np.int64)
        records = np.asarray(records, dtype=np.int64)
        if len(users) and ((records < 0).any() or (records >= self._sizes[users]).any()):
            raise IndexError("gather: record index out of range")
        mapped = self._ranked[self.ts.user_offsets[users] + records]
        return super().gather(users, mapped)

    def draw_records(self, users: np.ndarray, group_size: int, rng: np.random.Generator):
        users = np.asarray(users, dtype=np.int64)
        g = int(group_size)
        if g < 1:
            raise UserError(f"group size G must be >= 1, got {group_size}")
        n = self._sizes[users]
        rec = np.minimum(np.arange(g)[None, :], n[:, None] - 1)  # pad by repeating the last real one
        mask = (np.arange(g)[None, :] < n[:, None]).astype(np.float32)
        flat = self.gather(np.repeat(users, g), rec.reshape(-1))
        m = len(users)
        return {k: v.reshape(m, g, *v.shape[1:]) for k, v in flat.items()}, torch.from_numpy(mask)

    def bounded_records(self, group_size: int, rng: np.random.Generator):
        """ELS's D': each user's top min(G, n_u) ranked records (the same choice ULS draws)."""
        g = int(group_size)
        if g < 1:
            raise UserError(f"group size G must be >= 1, got {group_size}")
        counts = np.minimum(self._sizes, g).astype(np.int64)
        users = np.repeat(np.arange(self.num_users, dtype=np.int64), counts)
        starts = np.repeat(np.cumsum(counts) - counts, counts)
        records = np.arange(int(counts.sum()), dtype=np.int64) - starts
        return users, records


SELECTIONS = ("random", "longest", "shortest", "highest_ppl", "lowest_ppl", "random_chunk")


def LMUserData(
    tokenized: TokenizedStore, selection: str = "random", seq_len: int | None = None, scores: np.ndarray | None = None
) -> TokenizedUserData:
    """The engine's ``UserData`` for a tokenized store under a selection strategy (Chua et al. 2024, §4.1).

    - ``random``: the engine's default draw (uniform without replacement, fresh every call);
    - ``longest`` / ``shortest``: by the sequence's token length (in ``truncate`` mode lengths are
      capped at ``seq_len``; for exact lengths select before tokenizing with
      :func:`userdp.data.selection.bound_contributions` and ``record_token_lengths``);
    - ``highest_ppl`` / ``lowest_ppl``: ``scores`` = perplexity per sequence of this view
      (from :func:`userdp.data.selection.perplexity_scores`, whose ``DataTouch`` goes in the report);
    - ``random_chunk``: needs a ``full`` or ``pack`` tokenization.
    """
    if selection not in SELECTIONS:
        raise UserError(f"selection must be one of {', '.join(SELECTIONS)}, got {selection!r}")
    if selection == "random":
        return TokenizedUserData(tokenized, seq_len)
    if selection == "random_chunk":
        return RandomChunkUserData(tokenized, seq_len)
    if selection in ("longest", "shortest"):
        lens = tokenized.seq_lengths().astype(np.float64)
        return RankedUserData(tokenized, -lens if selection == "longest" else lens, seq_len)
    if scores is None:
        raise UserError(
            f"selection {selection!r} needs perplexities of the records (userdp.data.selection.perplexity_scores "
            "under the initial model); pass scores=..."
        )
    s = np.asarray(scores, dtype=np.float64)
    return RankedUserData(tokenized, -s if selection == "highest_ppl" else s, seq_len)
