"""``UserSubset``: which users of a store, and which of their records, a view holds.

Splits and contribution bounding both produce a ``UserSubset``; the engine adapter and the
tokenizer read a store through one. Record indices are *within* a user (0 = the user's first
record in dataset order) and are kept in increasing order.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np


@dataclasses.dataclass(frozen=True)
class UserSubset:
    users: np.ndarray  # int64 [n]: store user index of view user i
    rec_offsets: np.ndarray  # int64 [n + 1]
    records: np.ndarray  # int64 [R]: record index within the store user

    @classmethod
    def full(cls, sizes: np.ndarray) -> UserSubset:
        sizes = np.asarray(sizes, dtype=np.int64)
        offs = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        within = np.arange(offs[-1], dtype=np.int64) - np.repeat(offs[:-1], sizes)
        return cls(np.arange(len(sizes), dtype=np.int64), offs, within)

    @classmethod
    def from_lists(cls, users, record_lists) -> UserSubset:
        users = np.asarray(users, dtype=np.int64)
        lens = np.array([len(r) for r in record_lists], dtype=np.int64)
        offs = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        recs = (
            np.concatenate([np.asarray(r, dtype=np.int64) for r in record_lists])
            if len(record_lists)
            else np.zeros(0, np.int64)
        )
        return cls(users, offs, recs)

    @property
    def num_users(self) -> int:
        return int(len(self.users))

    @property
    def num_records(self) -> int:
        return int(self.rec_offsets[-1])

    def sizes(self) -> np.ndarray:
        return np.diff(self.rec_offsets)

    def records_of(self, i: int) -> np.ndarray:
        return self.records[self.rec_offsets[i] : self.rec_offsets[i + 1]]

    def rows(self, store_offsets: np.ndarray) -> np.ndarray:
        """Global store rows of every record in the subset, in view order."""
        return np.repeat(np.asarray(store_offsets)[self.users], self.sizes()) + self.records

    def nonempty(self) -> UserSubset:
        keep = self.sizes() > 0
        if keep.all():
            return self
        return UserSubset.from_lists(self.users[keep], [self.records_of(i) for i in np.flatnonzero(keep)])

    def fingerprint(self) -> str:
        h = hashlib.blake2b(digest_size=12)
        for a in (self.users, self.rec_offsets, self.records):
            h.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
        return h.hexdigest()
