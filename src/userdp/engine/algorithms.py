"""The algorithms, as frozen dataclasses: each defines only what a unit is, how a unit's update
is computed, and which DpEvent describes one step (SPEC §3.3, §3.4, §3.8). The loop is shared.

* :class:`ELS` — unit = one record of the G-capped dataset D' (at most G records per user,
  chosen once, uniformly); records Poisson-sampled at rate p; update = that record's gradient;
  event = mixture of Gaussians with sensitivity Binomial(G, p).
* :class:`ULS` — unit = one user; users Poisson-sampled at rate q; update = mean gradient over
  up to G of the user's records drawn fresh each step (``UserData.draw_records``, so selection
  strategies plug in there); event = Poisson-subsampled Gaussian.
* :class:`FedAvg` — unit = one user; update = ``theta0 - theta_local`` after E local epochs of
  SGD (local learning rate, local batch size) on up to G of the user's records; optional user
  weights ``w = min(n/w_hat, 1)``; event = Poisson-subsampled Gaussian.
  :func:`FedSGD` is FedAvg with one local step over the whole local batch and local lr 1, so the
  update is the user's mean gradient (S4 Alg 2 form).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from userdp import accounting
from userdp.engine.data import UserData
from userdp.errors import UserError


def _check_rate(rate: float, what: str) -> None:
    if not (0.0 < rate <= 1.0):
        raise UserError(f"{what} must lie in (0, 1], got {rate}")


def _check_g(g: int) -> None:
    if int(g) != g or g < 1:
        raise UserError(f"group size G must be an integer >= 1, got {g}")


@dataclass(frozen=True)
class UnitTable:
    """The units of a run. ELS: (user, record) pairs of D'; ULS/FedAvg: users (records = None)."""

    users: np.ndarray
    records: Optional[np.ndarray] = None
    weights: Optional[np.ndarray] = None  # per-unit weight w (FedAvg user weights), else None

    def __len__(self) -> int:
        return len(self.users)


@dataclass(frozen=True)
class ELS:
    """DP-SGD with example-level sampling and a user-level guarantee (SPEC §3.3)."""

    group_size: int
    sampling_rate: float
    name = "els"
    update_kind = "mean_gradient"

    def __post_init__(self):
        _check_g(self.group_size)
        _check_rate(self.sampling_rate, "ELS record sampling rate p")

    @property
    def records_per_unit(self) -> int:
        return 1

    @property
    def group_sensitivity(self) -> int:
        """How many units one user can own: G (the sum moves by at most G*C)."""
        return int(self.group_size)

    def units(self, data: UserData, rng: np.random.Generator) -> UnitTable:
        """D': at most G records of each user, chosen once (``data.bounded_records``: uniformly at
        random by default; a selection strategy's choice when the data ranks records)."""
        users, records = data.bounded_records(self.group_size, rng)
        return UnitTable(users.astype(np.int64), records.astype(np.int64))

    def load(self, data: UserData, table: UnitTable, ids: np.ndarray, rng: np.random.Generator):
        batch = data.gather(table.users[ids], table.records[ids])
        batch = {k: v.unsqueeze(1) for k, v in batch.items()}
        return batch, torch.ones(len(ids), 1)

    def step_event(self, sigma: float, sampling: str, table: UnitTable, num_users: int):
        if sampling == "fixed_size":
            if self.group_size > 1:
                raise UserError(
                    "ELS with G > 1 has no accounted fixed-size sampler; use sampling='poisson' "
                    "(or 'shuffle', which reports the no-amplification guarantee too)"
                )
            return accounting.fixed_cohort_step_event(sigma, len(table), self.cohort_size(table))
        return accounting.els_step_event(sigma, self.sampling_rate, self.group_size)

    def cohort_size(self, table: UnitTable) -> int:
        return max(1, int(round(self.sampling_rate * len(table))))


@dataclass(frozen=True)
class ULS:
    """DP-SGD with user-level sampling and per-user clipping (SPEC §3.4)."""

    group_size: int
    sampling_rate: float
    name = "uls"
    update_kind = "mean_gradient"

    def __post_init__(self):
        _check_g(self.group_size)
        _check_rate(self.sampling_rate, "ULS user sampling rate q")

    @property
    def records_per_unit(self) -> int:
        return int(self.group_size)

    group_sensitivity = 1

    def units(self, data: UserData, rng) -> UnitTable:
        return UnitTable(np.arange(data.num_users, dtype=np.int64))

    def load(self, data: UserData, table: UnitTable, ids, rng):
        return data.draw_records(table.users[ids], self.group_size, rng)

    def step_event(self, sigma, sampling, table, num_users):
        if sampling == "fixed_size":
            return accounting.fixed_cohort_step_event(sigma, len(table), self.cohort_size(table))
        return accounting.uls_step_event(sigma, self.sampling_rate)

    def cohort_size(self, table):
        return max(1, int(round(self.sampling_rate * len(table))))


@dataclass(frozen=True)
class FedAvg(ULS):
    """DP-FedAvg (SPEC §3.8): local SGD on each sampled user, the model delta is the unit update.

    ``local_batch_size`` None means the whole (up to G) local data in one batch. ``weight_cap``
    (w_hat) turns on user weights ``w = min(n_u / w_hat, 1)`` with n_u the user's record count;
    the fixed denominator is then q*W with W the total weight (treated as public, as in S2).
    ``reproject=True`` applies McMahan et al.'s greedy re-projection after every local step,
    ``theta <- theta0 + clip(theta - theta0)`` with the run's clipping (flat or per-layer); the
    final delta is then already within the bound (and is clipped again, a no-op).
    """

    local_epochs: int = 1
    local_lr: float = 0.1
    local_batch_size: Optional[int] = None
    weight_cap: Optional[float] = None
    reproject: bool = False
    name = "fedavg"
    update_kind = "local_sgd"

    def __post_init__(self):
        super().__post_init__()
        if self.local_epochs < 1:
            raise UserError(f"FedAvg local epochs must be >= 1, got {self.local_epochs}")
        if self.local_batch_size is not None and self.local_batch_size < 1:
            raise UserError(f"FedAvg local batch size must be >= 1, got {self.local_batch_size}")
        if not self.local_lr > 0:
            raise UserError(f"FedAvg local learning rate must be > 0, got {self.local_lr}")
        if self.weight_cap is not None and not self.weight_cap > 0:
            raise UserError(f"FedAvg weight cap w_hat must be > 0, got {self.weight_cap}")

    @property
    def local_steps_per_epoch(self) -> int:
        b = self.local_batch_size or self.group_size
        return math.ceil(self.group_size / min(b, self.group_size))

    def units(self, data: UserData, rng) -> UnitTable:
        users = np.arange(data.num_users, dtype=np.int64)
        if self.weight_cap is None:
            return UnitTable(users)
        w = np.minimum(data.sizes().astype(np.float64) / self.weight_cap, 1.0)
        return UnitTable(users, weights=w)


def FedSGD(group_size: int, sampling_rate: float, weight_cap: Optional[float] = None) -> FedAvg:
    """DP-FedSGD: one local step with lr 1 over the whole local batch (update = mean gradient)."""
    return FedAvg(group_size, sampling_rate, local_epochs=1, local_lr=1.0, local_batch_size=None,
                  weight_cap=weight_cap)


Algorithm = ELS | ULS | FedAvg
