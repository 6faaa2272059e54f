"""What the engine trains on: users, not rows (docs/ARCHITECTURE.md §2).

The engine asks a :class:`UserData` for three things only: how many records each user has,
a batch of given (user, record) pairs (ELS: one record per unit), and up to G records of each
of some users, drawn fresh (ULS / FedAvg: one user per unit). Everything about where records
come from (files, a tokenized store, synthetic draws) stays behind this contract.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import numpy as np
import torch

from userdp.errors import UserError

Batch = dict[str, torch.Tensor]


class UserData:
    """A user-partitioned dataset: user u holds ``sizes()[u] >= 1`` records.

    Subclasses implement :meth:`sizes` and :meth:`gather`; :meth:`draw_records` has a default
    (uniformly at random without replacement, fresh every call) that selection strategies
    override (longest, random chunk, ...).
    """

    num_users: int
    _user_keys: list | None = None  # the users' ids where the data knows them (user_keys)

    def sizes(self) -> np.ndarray:
        """int64 array [num_users]: records held by each user (every entry >= 1)."""
        raise NotImplementedError

    def gather(self, users: np.ndarray, records: np.ndarray) -> Batch:
        """Batch of the records ``(users[i], records[i])``; every tensor has leading dim len(users)."""
        raise NotImplementedError

    def draw_records(self, users: np.ndarray, group_size: int, rng: np.random.Generator) -> tuple[Batch, torch.Tensor]:
        """Up to ``group_size`` records of each user in ``users``, drawn fresh.

        Returns the batch with tensors shaped ``[len(users), G, ...]`` and a float mask
        ``[len(users), G]`` (1 = real record, 0 = padding). Padding slots repeat a real record
        of the same user (so the model sees valid inputs) and are masked out of the loss.
        """
        users = np.asarray(users, dtype=np.int64)
        g = int(group_size)
        if g < 1:
            raise UserError(f"group size G must be >= 1, got {group_size}")
        m = len(users)
        rec, mask = uniform_subsets(self.sizes()[users], g, rng)
        flat = self.gather(np.repeat(users, g), rec.reshape(-1))
        batch = {k: v.reshape(m, g, *v.shape[1:]) for k, v in flat.items()}
        return batch, torch.from_numpy(mask)

    def bounded_records(self, group_size: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """ELS contribution bounding, done once: at most G records of every user (D', Charles et al. 2024, Alg. 1).

        Returns flat arrays (user index, record index), grouped by user. The default keeps a
        uniformly random subset of min(G, n_u) records; selection strategies (longest,
        perplexity, ...) override it, so that ELS honours them exactly as ULS does.
        """
        g = int(group_size)
        if g < 1:
            raise UserError(f"group size G must be >= 1, got {group_size}")
        sizes = self.sizes()
        rec, mask = uniform_subsets(sizes, g, rng)
        counts = mask.sum(axis=1).astype(np.int64)
        ordered = np.sort(np.where(mask > 0, rec, np.iinfo(np.int64).max), axis=1)
        records = ordered[np.arange(g)[None, :] < counts[:, None]]
        users = np.repeat(np.arange(len(sizes), dtype=np.int64), counts)
        return users, records

    def fingerprint(self) -> bytes:
        """A digest of *which user is which*: every user's records, in the order the engine numbers
        the users. The processes of one job compare it before the first step: two processes that
        number the same people differently (ids pseudonymised by Python's per-process salted
        ``hash()``, a file read in another order) would put one person into two processes' shares
        of a cohort, and the step's sum would move by more than the clip norm.

        The default gathers every record once; data that can hash its storage directly override it."""
        h = hashlib.sha256()
        sizes = np.asarray(self.sizes(), dtype=np.int64)
        h.update(sizes.tobytes())
        users = np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)
        records = np.arange(len(users), dtype=np.int64) - np.repeat(np.cumsum(sizes) - sizes, sizes)
        for start in range(0, len(users), 4096):
            batch = self.gather(users[start : start + 4096], records[start : start + 4096])
            hash_tensors(h, batch)
        return h.digest()

    def concat(self, batches: list[Batch]) -> Batch:
        """One batch from the batches of single units (the loop loads each sampled unit with its
        own generator, so that a unit's records do not depend on which process loads it).

        The default concatenates each key along the first axis, so every unit's batch must have
        the same keys and trailing shapes; data whose units' batches differ (the audit's canaries
        carry keys the real users lack) override it."""
        return {k: torch.cat([b[k] for b in batches]) for k in batches[0]}

    def user_keys(self) -> list:
        """One stable identity per user, in user order (a user's cyclic-Poisson group is a keyed hash
        of it, :class:`userdp.engine.sampling.CyclicPoisson`, so it must not depend on who else is in
        the data). The default is the user's position, an identity only while users are added at
        the end; data that knows its users' ids returns them (``TensorUserData.from_user_ids``, the
        CLI's tokenized data)."""
        keys = self._user_keys
        return list(keys) if keys is not None else list(range(int(self.num_users)))

    def __len__(self) -> int:
        return int(self.num_users)


class DelegatingUserData(UserData):
    """Wraps a :class:`UserData` and delegates **everything** it does not override.

    ``UserData`` gives default ``draw_records``/``bounded_records``, so a wrapper written as a
    plain subclass silently falls back to the uniform defaults instead of the wrapped data's
    selection strategy (``userdp train`` once gave 668 of 1,175 users an ELS D' that was not
    their top G while the report named the selection). This class forwards every method of the
    ``UserData`` contract, and any other attribute, to ``inner``; subclasses override only what
    they change and call ``self.inner`` for the rest.

    Args:
        inner: the wrapped data.
    """

    def __init__(self, inner: UserData):
        if not isinstance(inner, UserData):
            raise UserError(f"can only wrap a UserData, got {type(inner).__name__}")
        self.inner = inner

    @property
    def num_users(self) -> int:  # type: ignore[override]
        return self.inner.num_users

    def sizes(self) -> np.ndarray:
        return self.inner.sizes()

    def gather(self, users, records) -> Batch:
        return self.inner.gather(users, records)

    def draw_records(self, users, group_size, rng):
        return self.inner.draw_records(users, group_size, rng)

    def bounded_records(self, group_size, rng):
        return self.inner.bounded_records(group_size, rng)

    def concat(self, batches):
        return self.inner.concat(batches)

    def fingerprint(self) -> bytes:
        return self.inner.fingerprint()

    def user_keys(self) -> list:
        return self.inner.user_keys()

    def __getattr__(self, name):  # anything beyond the contract (num_tokens, selection, ...)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


def hash_tensors(h, tensors: Mapping[str, torch.Tensor]) -> None:
    """Feed ``tensors`` (by sorted name: the name, dtype, shape and bytes of each) into the hash ``h``."""
    for k in sorted(tensors):
        t = tensors[k].detach().cpu().contiguous()
        h.update(f"{k}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def _contract_methods() -> set[str]:
    return {n for n, v in vars(UserData).items() if callable(v) and not n.startswith("_")}


# every method of the contract must be forwarded explicitly (a new one added to UserData
# without a forwarder here would silently fall back to its default again)
assert _contract_methods() <= set(vars(DelegatingUserData)), _contract_methods() - set(vars(DelegatingUserData))


def uniform_subsets(sizes: np.ndarray, group_size: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """For each user (``sizes[i]`` records) a uniformly random subset of min(G, n_i) record indices.

    Returns ``(records, mask)``, both ``[len(sizes), G]``: users with n_i <= G get all their records
    in slots ``0..n_i-1`` (the rest padded with record 0, mask 0); users with more get G distinct
    records (mask 1). Vectorized over users with Floyd's algorithm: G passes, each over all users
    at once, so a cohort of any size costs no Python loop over users.
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    g = int(group_size)
    m = len(sizes)
    rec = np.zeros((m, g), dtype=np.int64)
    mask = np.zeros((m, g), dtype=np.float32)
    small = sizes <= g
    if small.any():
        slots = np.arange(g)[None, :]
        fill = slots < sizes[small, None]
        rec[small] = np.where(fill, slots, 0)
        mask[small] = fill
    big = np.flatnonzero(~small)
    if len(big):
        # One row of uniforms per user with more than G records, drawn up front in user order:
        # a user's choice depends only on its own row, so appending a user never changes the
        # draws of the users before it (and users with <= G records consume no randomness).
        u = rng.random((len(big), g))
        n = sizes[big]
        chosen = np.empty((len(big), g), dtype=np.int64)
        # Floyd: for j = n-G .. n-1, t ~ U{0..j}; take t unless already chosen, else take j.
        for k in range(g):
            j = n - g + k
            t = np.floor(u[:, k] * (j + 1)).astype(np.int64)
            t = np.minimum(t, j)  # guard the float edge case
            dup = (chosen[:, :k] == t[:, None]).any(axis=1) if k else np.zeros(len(big), dtype=bool)
            chosen[:, k] = np.where(dup, j, t)
        rec[big] = chosen
        mask[big] = 1.0
    return rec, mask


def compact_groups(batch: Batch, mask: torch.Tensor) -> tuple[Batch, torch.Tensor]:
    """A chunk of user units with the padding slots trimmed: each unit's real records moved to
    the front (in their order) and the group axis cut to the chunk's largest record count.

    For an update that is the unit's masked mean gradient (ULS) this changes nothing but the
    work: a padding slot has mask 0, so it adds nothing to the unit's loss, its gradient or its
    ghost norm (whose G·L tokens form one sequence, in any order). On blogs with G = 16, a third
    of the slots are padding (median 11 posts); trimmed chunks of users sorted by record count
    hold about 10%. Not for FedAvg, whose local SGD depends on the order and the slot count.

    Args:
        batch: tensors ``[m, G, ...]``.
        mask: ``[m, G]``, > 0 for a real record.

    Returns:
        ``(batch, mask)`` with ``G' <= G`` slots (the model is not compiled, so a new width costs
        nothing); the same objects when nothing can be trimmed.
    """
    m, g = mask.shape
    if g <= 1 or m == 0:
        return batch, mask
    real = mask > 0
    most = max(1, int(real.sum(1).max()))
    width = min(g, most)
    if width == g:
        return batch, mask
    order = torch.argsort((~real).to(torch.int8), dim=1, stable=True)[:, :width]  # real slots first
    if torch.equal(order, torch.arange(width).expand(m, width)):  # already first (draw_records puts them there)
        return {k: v[:, :width] for k, v in batch.items()}, mask[:, :width]
    rows = torch.arange(m)[:, None]
    return {k: v[rows, order] for k, v in batch.items()}, mask[rows, order]


class TensorUserData(UserData):
    """In-memory user data: ``tensors`` hold all records, contiguous by user.

    User u's records are rows ``offsets[u]:offsets[u+1]`` of every tensor; ``offsets`` has
    ``num_users + 1`` non-decreasing entries starting at 0 and ending at the row count, and no
    user may be empty.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], offsets: np.ndarray):
        if not isinstance(tensors, Mapping) or not tensors:
            raise UserError(
                "TensorUserData: tensors must be a non-empty mapping of name -> torch.Tensor "
                f"(got {type(tensors).__name__})"
            )
        for k, v in tensors.items():
            if not isinstance(v, torch.Tensor) or v.ndim < 1:
                raise UserError(
                    f"TensorUserData: tensors[{k!r}] must be a torch.Tensor with a row dimension "
                    f"(got {type(v).__name__})"
                )
        raw = np.asarray(offsets)
        if raw.dtype.kind not in "iu" and not (
            raw.dtype.kind == "f" and np.all(np.isfinite(raw)) and np.all(raw == np.round(raw))
        ):
            # a float offset such as 2.7 would be truncated to 2 and move a record to another user
            raise UserError(f"TensorUserData: offsets must be integers (got {raw.dtype} values)")
        offsets = raw.astype(np.int64)
        if offsets.ndim != 1 or len(offsets) < 2 or offsets[0] != 0:
            raise UserError("TensorUserData: offsets must be 1-D, start at 0 and hold num_users + 1 entries")
        n_rows = {k: int(v.shape[0]) for k, v in tensors.items()}
        if len(set(n_rows.values())) != 1:
            raise UserError(f"TensorUserData: tensors differ in their number of rows: {n_rows}")
        total = next(iter(n_rows.values()))
        if offsets[-1] != total:
            raise UserError(f"TensorUserData: offsets end at {offsets[-1]} but the tensors hold {total} rows")
        sizes = np.diff(offsets)
        if (sizes < 1).any():
            bad = int(np.flatnonzero(sizes < 1)[0])
            raise UserError(f"TensorUserData: user {bad} has no records (offsets must be strictly increasing)")
        self.tensors = dict(tensors)
        self.offsets = offsets
        self._sizes = sizes
        self.num_users = len(sizes)

    @classmethod
    def from_user_ids(cls, tensors: Mapping[str, torch.Tensor], user_ids) -> TensorUserData:
        """Build from per-row user ids (any hashable values); rows are regrouped by user."""
        raw = list(user_ids) if not isinstance(user_ids, np.ndarray) else user_ids.tolist()
        for i, u in enumerate(raw):  # a missing author would merge with the others into one "user"
            if u is None or (isinstance(u, float) and u != u):
                raise UserError(
                    f"TensorUserData.from_user_ids: row {i} has no user id ({u!r}); every record needs its author"
                )
        ids = np.asarray(user_ids)
        if ids.ndim != 1:
            raise UserError(f"TensorUserData.from_user_ids: user_ids must be one id per row (got shape {ids.shape})")
        for k, v in tensors.items() if isinstance(tensors, Mapping) else ():
            if isinstance(v, torch.Tensor) and v.ndim >= 1 and v.shape[0] != len(ids):
                raise UserError(
                    f"TensorUserData.from_user_ids: {len(ids)} user ids for the {v.shape[0]} rows of "
                    f"tensors[{k!r}] (one id per row; no row is dropped)"
                )
        _, inverse = np.unique(ids, return_inverse=True)
        order = np.argsort(inverse, kind="stable")
        counts = np.bincount(inverse)
        offsets = np.concatenate([[0], np.cumsum(counts)])
        idx = torch.from_numpy(order)
        data = cls({k: v[idx] for k, v in tensors.items()}, offsets)
        data._user_keys = np.unique(ids).tolist()  # user u's id (np.unique's order is the users' order)
        return data

    def sizes(self) -> np.ndarray:
        return self._sizes

    def fingerprint(self) -> bytes:
        """The offsets and every tensor's bytes (and the user ids, where the data keeps them)."""
        h = hashlib.sha256(self.offsets.astype(np.int64).tobytes())
        hash_tensors(h, self.tensors)
        ids = getattr(self, "user_ids", None)
        if ids is not None:
            h.update("\x1f".join(str(u) for u in ids).encode())
        return h.digest()

    def gather(self, users: np.ndarray, records: np.ndarray) -> Batch:
        users = np.asarray(users, dtype=np.int64)
        records = np.asarray(records, dtype=np.int64)
        if users.shape != records.shape:
            raise ValueError("gather: users and records must have the same shape")
        idx = torch.from_numpy(self.offsets[users] + records)
        return {k: v[idx] for k, v in self.tensors.items()}
