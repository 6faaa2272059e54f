"""Train/eval splits of a user-grouped store (docs/data.md), deterministic, never sharing a record.

- :func:`heldout_users`: a fraction of users (chosen from a seed) go to evaluation whole.
- :func:`cc_news_split`: the per-user rule of the paper's CC-News set: users with exactly one
  record are dropped (counted); each remaining user's first
  ``n_eval = min(32, max(1, ceil(0.1 * n_u)))`` records in dataset order go to evaluation, the
  rest to training (so every user is on both sides, every record on one).
- :func:`time_split`: records dated before the cutoff train, the rest evaluate (Stack Overflow:
  2018-01-01 UTC). A record without a parseable date is an error naming the user and record.
"""

from __future__ import annotations

import dataclasses
import datetime as dt

import numpy as np

from userdp.data.records import ONE_RECORD_USERS, DropReport
from userdp.data.subset import UserSubset
from userdp.errors import UserError



@dataclasses.dataclass(frozen=True)
class Split:
    train: UserSubset
    eval: UserSubset
    rule: str
    drops: DropReport = dataclasses.field(default_factory=DropReport)


def _sizes(store_or_sizes) -> np.ndarray:
    return np.asarray(store_or_sizes.sizes() if hasattr(store_or_sizes, "sizes") else store_or_sizes, dtype=np.int64)


def heldout_users(store_or_sizes, fraction: float, seed: int) -> Split:
    """Hold out round(fraction * N) users (at least 1 when fraction > 0), chosen by ``seed``."""
    sizes = _sizes(store_or_sizes)
    n = len(sizes)
    if not 0.0 <= fraction < 1.0:
        raise UserError(f"held-out fraction must be in [0, 1), got {fraction}")
    k = int(round(fraction * n))
    if fraction > 0:
        k = max(1, k)
    if k >= n:
        raise UserError(f"holding out {k} of {n} users leaves none to train on")
    perm = np.random.default_rng(seed).permutation(n)
    ev = np.sort(perm[:k])
    tr = np.sort(perm[k:])
    full = UserSubset.full(sizes)

    def take(users):
        return UserSubset.from_lists(users, [full.records_of(u) for u in users])

    return Split(take(tr), take(ev), f"held-out users: {k} of {n} (fraction {fraction}, seed {seed})")


def cc_news_n_eval(n_u: np.ndarray) -> np.ndarray:
    n_u = np.asarray(n_u, dtype=np.int64)
    return np.minimum(32, np.maximum(1, np.ceil(0.1 * n_u).astype(np.int64)))


def cc_news_split(store_or_sizes) -> Split:
    sizes = _sizes(store_or_sizes)
    drops = DropReport()
    keep = np.flatnonzero(sizes >= 2)
    n_one = int((sizes == 1).sum())
    drops.add(ONE_RECORD_USERS, n_one, example=None)
    n_eval = cc_news_n_eval(sizes[keep])
    ev = UserSubset.from_lists(keep, [np.arange(e) for e in n_eval])
    tr = UserSubset.from_lists(keep, [np.arange(e, n) for e, n in zip(n_eval, sizes[keep])])
    rule = "CC-News rule: drop users with one record; eval = first min(32, max(1, ceil(0.1 n_u))) records"
    return Split(tr, ev, rule, drops)


_FORMATS = ("%d,%B,%Y", "%d %B %Y", "%Y/%m/%d", "%d/%m/%Y")


def parse_date(value) -> dt.datetime:
    """A date as UTC: ISO 8601 (Stack Exchange), ``14,May,2004`` (blogs), or epoch seconds."""
    if isinstance(value, dt.datetime):
        d = value
    else:
        s = str(value).strip()
        d = None
        try:
            d = dt.datetime.fromisoformat(s.replace("Z", "+00:00"))
        except ValueError:
            for fmt in _FORMATS:
                try:
                    d = dt.datetime.strptime(s, fmt)
                    break
                except ValueError:
                    continue
            if d is None:
                try:
                    d = dt.datetime.fromtimestamp(float(s), tz=dt.timezone.utc)
                except ValueError:
                    raise ValueError(f"unrecognised date {s!r}") from None
    if d.tzinfo is None:
        d = d.replace(tzinfo=dt.timezone.utc)
    return d


def time_split(store, cutoff) -> Split:
    """Records dated strictly before ``cutoff`` (a date/datetime or ISO string, UTC) train."""
    if not getattr(store, "has_dates", False):
        raise UserError(f"{getattr(store, 'path', 'store')}: a time split needs dates (build with --date-field)")
    try:
        cut = parse_date(cutoff)
    except ValueError as exc:
        raise UserError(f"time split cutoff: {exc}") from None
    cut_ts = cut.timestamp()
    before = np.empty(store.num_records, dtype=bool)
    cache: dict[str, bool] = {}
    for start, dates in store.iter_text_batches("date"):
        for j, d in enumerate(dates):
            b = cache.get(d)
            if b is None:
                row = start + j
                if d is None:
                    u = int(np.searchsorted(store.offsets, row, side="right") - 1)
                    raise UserError(
                        f"{store.path}: user {store.user_id(u)!r} record {row - store.offsets[u]} has no date (time split)"
                    )
                try:
                    b = cache[d] = parse_date(d).timestamp() < cut_ts
                except ValueError as exc:
                    u = int(np.searchsorted(store.offsets, row, side="right") - 1)
                    raise UserError(f"{store.path}: user {store.user_id(u)!r} record {row - store.offsets[u]}: {exc}") from None
            before[start + j] = b
    full = UserSubset.full(store.sizes())
    owner = np.repeat(np.arange(store.num_users), store.sizes())

    def side(mask):
        users, counts = np.unique(owner[mask], return_counts=True)
        offs = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        return UserSubset(users.astype(np.int64), offs, full.records[mask])

    return Split(side(before), side(~before), f"time split at {cut.isoformat()}: before -> train, on/after -> eval")
