"""Canary users for an empirical audit: synthetic people whose every record carries one secret.

A canary is a user the auditor invents: it holds ``records`` records, each the same random token
string (its secret) drawn uniformly from the tokenizer's ordinary (non-special) tokens. Under
user-level adjacency the strongest canary is one whose records all push the model the same way,
so the whole user is the secret, repeated. Each canary is included in the training data
independently with probability 1/2 (the one-run design of Steinke, Nasr & Jagielski 2023); the
excluded half is the control group.

Everything is derived from one 128-bit seed drawn from OS entropy (``secrets``) and kept outside
the run's public outputs (:mod:`userdp.audit.secrets`): the secrets, which canaries are in, and
nothing else. The training code never learns which users are canaries.
"""

from __future__ import annotations

import hashlib
import secrets as _secrets
from dataclasses import dataclass

import numpy as np
import torch

from userdp.engine.user_data import (
    DelegatingUserData,
    TensorUserData,
    UserData,
    uniform_subsets,
)
from userdp.errors import UserError
from userdp.lm.tokenization import as_tokenizers

IGNORE_INDEX = -100


def new_seed() -> int:
    """A fresh 128-bit seed from the OS (never from a user-given training seed)."""
    return _secrets.randbits(128)


def ordinary_token_ids(tok) -> np.ndarray:
    """The tokenizer's ids that are not special (added) tokens: what a secret is drawn from."""
    t = as_tokenizers(tok)
    n = int(t.get_vocab_size(with_added_tokens=True))
    special = {int(i) for i in t.get_added_tokens_decoder()}
    ids = np.array([i for i in range(n) if i not in special], dtype=np.int64)
    if ids.size < 2:
        raise UserError("audit: the tokenizer has fewer than 2 ordinary tokens to build canaries from")
    return ids


@dataclass(frozen=True)
class Canaries:
    """K canaries: ``secrets[k]`` is canary k's token string, ``included[k]`` whether it trains.

    Build with :meth:`generate`; the same seed gives the same canaries."""

    secrets: np.ndarray  # int64 [K, length]
    included: np.ndarray  # bool [K]
    records: int  # records each canary user holds (copies of its secret)

    @classmethod
    def generate(cls, seed: int, count: int, length: int, records: int, vocab: np.ndarray) -> Canaries:
        """Draw ``count`` secrets of ``length`` tokens from ``vocab`` and the inclusion coin flips.

        Raises:
            UserError: a count, length or record number below 1 (2 for the count).
        """
        if count < 2:
            raise UserError(f"audit.canaries: need at least 2 canaries, got {count}")
        if length < 2:
            raise UserError(f"audit.secret_tokens: need at least 2 tokens, got {length}")
        if records < 1:
            raise UserError(f"audit.records_per_canary: need at least 1, got {records}")
        ss = np.random.SeedSequence(int(seed))
        s_secret, s_incl = ss.spawn(2)  # two independent streams: secrets never inform the coin flips
        secrets_ = np.random.default_rng(s_secret).choice(np.asarray(vocab, np.int64), size=(count, length))
        included = np.random.default_rng(s_incl).random(count) < 0.5
        return cls(secrets_.astype(np.int64), included, int(records))

    @property
    def count(self) -> int:
        return int(self.included.size)

    def batch(self, which: np.ndarray | None = None, width: int | None = None) -> dict[str, torch.Tensor]:
        """One record per canary (``which``: indices; default all): input_ids and labels, padded
        with ignored labels to ``width`` when wider than the secret."""
        idx = np.arange(self.count) if which is None else np.asarray(which, dtype=np.int64)
        x = self.secrets[idx]
        L = max(int(width or 0), x.shape[1])
        ids = np.zeros((len(idx), L), dtype=np.int64)
        lab = np.full((len(idx), L), IGNORE_INDEX, dtype=np.int64)
        ids[:, : x.shape[1]] = x
        lab[:, : x.shape[1]] = x
        return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(lab)}

    def training_users(self, width: int) -> TensorUserData:
        """The included canaries as users, each holding ``records`` copies of its secret."""
        inc = np.flatnonzero(self.included)
        if inc.size == 0:
            raise UserError("audit: no canary was drawn into the training data (rerun the audit)")
        b = self.batch(np.repeat(inc, self.records), width)
        offsets = np.arange(inc.size + 1, dtype=np.int64) * self.records
        return TensorUserData(b, offsets)


@dataclass(frozen=True)
class GradientCanaries:
    """K gradient-space canaries (Steinke et al. 2023's white-box design, as users).

    Canary k is a user whose every record has no text (its language-model loss is 0) and adds
    ``-scale * w[coords[k]]`` to the loss, ``w`` being the flattened parameter ``param``: its
    update is ``scale`` along one coordinate of its own, far above the clip norm, so clipping
    must cut it to C. An auditor who sees every step's noisy update reads each canary's
    coordinate (:class:`userdp.audit.session.AuditSession`)."""

    coords: np.ndarray  # int64 [K], distinct
    included: np.ndarray  # bool [K]
    records: int
    param: str
    scale: float

    @classmethod
    def generate(cls, seed: int, count: int, records: int, param: str, numel: int, scale: float) -> GradientCanaries:
        """Draw ``count`` distinct coordinates of ``param`` (``numel`` entries) and the coin flips.

        Raises:
            UserError: fewer than 2 canaries, or more than the parameter has entries.
        """
        if count < 2:
            raise UserError(f"audit.canaries: need at least 2 canaries, got {count}")
        if count > numel:
            raise UserError(
                f"audit.canaries: {count} gradient canaries need as many entries of {param} (it has {numel})"
            )
        ss = np.random.SeedSequence(int(seed))
        s_coord, s_incl = ss.spawn(2)
        coords = np.random.default_rng(s_coord).choice(numel, size=count, replace=False).astype(np.int64)
        included = np.random.default_rng(s_incl).random(count) < 0.5
        return cls(coords, included, int(records), param, float(scale))

    @property
    def count(self) -> int:
        return int(self.included.size)

    def training_users(self, width: int, pad_id: int = 0) -> TensorUserData:
        """The included canaries as users of ``records`` text-free records each."""
        inc = np.flatnonzero(self.included)
        if inc.size == 0:
            raise UserError("audit: no canary was drawn into the training data (rerun the audit)")
        n = inc.size * self.records
        w = max(2, int(width))
        b = {
            "input_ids": torch.full((n, w), int(pad_id), dtype=torch.long),
            "labels": torch.full((n, w), IGNORE_INDEX, dtype=torch.long),
            "audit_coord": torch.from_numpy(np.repeat(self.coords[inc], self.records)),
            "audit_on": torch.ones(n),
        }
        return TensorUserData(b, np.arange(inc.size + 1, dtype=np.int64) * self.records)


def _tensor(model, name: str):
    """The tensor at ``name`` (under torch.func.functional_call, the substituted one, which
    ``get_parameter`` refuses as not an nn.Parameter)."""
    prefix, _, leaf = name.rpartition(".")
    return getattr(model.get_submodule(prefix) if prefix else model, leaf)


def gradient_canary_loss(loss_fn, param: str, scale: float):
    """``loss_fn`` plus the gradient canaries' term ``-scale * w[audit_coord] * audit_on`` (0 for
    every real record); batches without the audit keys pass through unchanged."""

    def loss(model, batch):
        if "audit_coord" not in batch:
            return loss_fn(model, batch)
        core = {k: v for k, v in batch.items() if k not in ("audit_coord", "audit_on")}
        out = loss_fn(model, core)
        w = _tensor(model, param).reshape(-1)
        on = batch["audit_on"].to(device=out.device, dtype=out.dtype)
        return out - scale * w[batch["audit_coord"].to(w.device)].to(out.dtype) * on

    return loss


class WithCanaries(DelegatingUserData):
    """The training users followed by the included canary users, as one :class:`UserData`.

    Users ``0 .. n-1`` are ``inner``'s (their selection strategy is kept); users ``n ..`` are the
    canaries (uniform draws; all their records are alike). Batches of both are padded to one
    width with ignored labels.
    """

    def __init__(self, inner: UserData, canaries: TensorUserData):
        super().__init__(inner)
        self.canaries = canaries
        self.n_real = int(inner.num_users)
        self._sizes = np.concatenate([np.asarray(inner.sizes(), np.int64), canaries.sizes()])

    @property
    def num_users(self) -> int:  # type: ignore[override]
        return self.n_real + self.canaries.num_users

    def sizes(self) -> np.ndarray:
        return self._sizes

    @staticmethod
    def _merge(parts: list[tuple[np.ndarray, dict]], n: int) -> dict:
        """One batch from the parts' batches (rows at ``pos``). Token tensors are padded to one
        width; a key only the canaries have (the gradient canaries' audit keys) is 0 elsewhere."""
        parts = [(pos, b) for pos, b in parts if len(pos)]
        keys = set().union(*(set(b) for _, b in parts))
        out = {}
        for k in sorted(keys):
            have = [(pos, b[k]) for pos, b in parts if k in b]
            first = have[0][1]
            if k in ("input_ids", "labels"):
                if len(have) != len(parts):
                    raise UserError(f"audit: a batch without {k}")
                width = max(v.shape[-1] for _, v in have)
                t = torch.full((n, *first.shape[1:-1], width), IGNORE_INDEX if k == "labels" else 0, dtype=first.dtype)
                for pos, v in have:
                    t[torch.from_numpy(pos), ..., : v.shape[-1]] = v
            else:  # per-record tensors; the audit keys exist on gradient canaries only (0 elsewhere)
                if len(have) != len(parts) and not k.startswith("audit_"):
                    raise UserError(f"audit: canary batches lack the data's {k!r}")
                t = torch.zeros((n, *first.shape[1:]), dtype=first.dtype)
                for pos, v in have:
                    t[torch.from_numpy(pos)] = v
            out[k] = t
        return out

    def gather(self, users, records):
        users = np.asarray(users, dtype=np.int64)
        records = np.asarray(records, dtype=np.int64)
        real = users < self.n_real
        pr, pc = np.flatnonzero(real), np.flatnonzero(~real)
        parts = []
        if pr.size:
            parts.append((pr, self.inner.gather(users[pr], records[pr])))
        if pc.size:
            parts.append((pc, self.canaries.gather(users[pc] - self.n_real, records[pc])))
        return self._merge(parts, len(users))

    def draw_records(self, users, group_size, rng):
        users = np.asarray(users, dtype=np.int64)
        real = users < self.n_real
        pr, pc = np.flatnonzero(real), np.flatnonzero(~real)
        parts, mask = [], torch.zeros(len(users), int(group_size))
        if pr.size:
            b, m = self.inner.draw_records(users[pr], group_size, rng)
            parts.append((pr, b))
            mask[torch.from_numpy(pr)] = m.to(mask.dtype)
        if pc.size:
            b, m = self.canaries.draw_records(users[pc] - self.n_real, group_size, rng)
            parts.append((pc, b))
            mask[torch.from_numpy(pc)] = m.to(mask.dtype)
        return self._merge(parts, len(users)), mask

    def concat(self, batches):
        """Units' batches (one row each) as one, by the merge rule of :meth:`_merge`."""
        pos = np.cumsum([0] + [next(iter(b.values())).shape[0] for b in batches])
        return self._merge([(np.arange(pos[i], pos[i + 1]), b) for i, b in enumerate(batches)], int(pos[-1]))

    def bounded_records(self, group_size, rng):
        u_r, r_r = self.inner.bounded_records(group_size, rng)
        rec, m = uniform_subsets(self.canaries.sizes(), int(group_size), rng)
        counts = m.sum(axis=1).astype(np.int64)
        ordered = np.sort(np.where(m > 0, rec, np.iinfo(np.int64).max), axis=1)
        r_c = ordered[np.arange(int(group_size))[None, :] < counts[:, None]]
        u_c = np.repeat(np.arange(self.canaries.num_users, dtype=np.int64), counts) + self.n_real
        return np.concatenate([u_r, u_c]), np.concatenate([r_r, r_c])

    def fingerprint(self) -> bytes:
        return hashlib.sha256(self.inner.fingerprint() + self.canaries.fingerprint()).digest()

    def num_tokens(self) -> int:
        inner = getattr(self.inner, "num_tokens", None)
        return (inner() if inner else 0) + int((self.canaries.tensors["labels"] != IGNORE_INDEX).sum())
