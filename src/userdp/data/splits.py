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
from userdp.keyed_hash import keyed_uniforms


@dataclasses.dataclass(frozen=True)
class Split:
    train: UserSubset
    eval: UserSubset
    rule: str
    drops: DropReport = dataclasses.field(default_factory=DropReport)


def _sizes(store_or_sizes) -> np.ndarray:
    return np.asarray(store_or_sizes.sizes() if hasattr(store_or_sizes, "sizes") else store_or_sizes, dtype=np.int64)


def user_ids_of(store_or_sizes, n: int) -> list:
    """The users' ids (a store's: a method or a list), or their positions for a plain list of sizes."""
    ids = getattr(store_or_sizes, "user_ids", None)
    if callable(ids):
        return list(ids())
    return list(ids) if ids is not None else list(range(n))


def heldout_users(store_or_sizes, fraction: float, seed: int) -> Split:
    """Hold out each user with probability ``fraction``, independently, by a keyed hash of its id
    (:func:`keyed_uniforms`): whether a user is held out depends on that user alone, never on who
    else is in the data (a permutation of all N users moved 24 others when one was added).

    Raises:
        UserError: a fraction outside [0, 1), or a draw that holds out every user or (with a
            fraction above 0) none."""
    sizes = _sizes(store_or_sizes)
    n = len(sizes)
    if not 0.0 <= fraction < 1.0:
        raise UserError(f"held-out fraction must be in [0, 1), got {fraction}")
    if n < 2 and fraction > 0:
        raise UserError(f"holding out users from {n} leaves none to train on (data.heldout_users {fraction})")
    u = keyed_uniforms(user_ids_of(store_or_sizes, n), seed, "heldout")
    held = u < fraction
    k = int(held.sum())
    note = ""
    if fraction > 0 and k == 0:  # tiny data only (P = (1 - f)^N): the user with the smallest hash
        held[int(np.argmin(u))] = True
        k, note = (
            1,
            "; none fell below the fraction, so the user with the smallest hash is held out (a choice "
            "that depends on the other users: tiny data only)",
        )
    if k >= n:  # likewise: the user with the largest hash trains
        held[int(np.argmax(u))] = False
        k, note = (
            n - 1,
            "; every user fell below the fraction, so the user with the largest hash trains (tiny data only)",
        )
    ev = np.flatnonzero(held)
    tr = np.flatnonzero(~held)
    full = UserSubset.full(sizes)

    def take(users):
        return UserSubset.from_lists(users, [full.records_of(u) for u in users])

    return Split(
        take(tr),
        take(ev),
        f"held-out users: {k} of {n}, each held out with probability {fraction} "
        f"by a keyed hash of its id (seed {seed}){note}",
    )


def keep_users(subset: UserSubset, ids: list, rate: float, seed: int, purpose: str) -> UserSubset:
    """A Poisson sample of ``subset``'s users at ``rate``: each user kept when the keyed hash of its
    own id falls below the rate, so whether a user is kept depends on that user alone (not on how
    many others there are)."""
    keep = np.flatnonzero(keyed_uniforms([ids[int(u)] for u in subset.users], seed, purpose) < rate)
    return UserSubset.from_lists(subset.users[keep], [subset.records_of(i) for i in keep])


def sample_users(subset: UserSubset, ids: list, expected: int, seed: int, purpose: str) -> tuple[UserSubset, float]:
    """A Poisson sample of ``subset``'s users at rate ``expected / N`` by a keyed hash of each id
    (each user in or out on its own), and the rate. The whole subset when ``expected >= N``."""
    n = subset.num_users
    if expected >= n:
        return subset, 1.0
    rate = expected / n
    return keep_users(subset, ids, rate, seed, purpose), rate


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
    tr = UserSubset.from_lists(keep, [np.arange(e, n) for e, n in zip(n_eval, sizes[keep], strict=True)])
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
                    d = dt.datetime.fromtimestamp(float(s), tz=dt.UTC)
                except ValueError:
                    raise ValueError(f"unrecognised date {s!r}") from None
    if d.tzinfo is None:
        d = d.replace(tzinfo=dt.UTC)
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
                        f"{store.path}: user {store.user_id(u)!r} record {row - store.offsets[u]} has no date "
                        "(time split)"
                    )
                try:
                    b = cache[d] = parse_date(d).timestamp() < cut_ts
                except ValueError as exc:
                    u = int(np.searchsorted(store.offsets, row, side="right") - 1)
                    raise UserError(
                        f"{store.path}: user {store.user_id(u)!r} record {row - store.offsets[u]}: {exc}"
                    ) from None
            before[start + j] = b
    full = UserSubset.full(store.sizes())
    owner = np.repeat(np.arange(store.num_users), store.sizes())

    def side(mask):
        users, counts = np.unique(owner[mask], return_counts=True)
        offs = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        return UserSubset(users.astype(np.int64), offs, full.records[mask])

    return Split(side(before), side(~before), f"time split at {cut.isoformat()}: before -> train, on/after -> eval")
