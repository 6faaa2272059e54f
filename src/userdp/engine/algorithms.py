"""The algorithms, as frozen dataclasses: each defines only what a unit is (``unit``, ``units``,
``group_sensitivity``), which records a unit's update sees (``load``) and what that update is
(``update``: ``"gradient"`` — the masked mean gradient — or ``"local_sgd"`` — the model delta
after local SGD). The step's DpEvent follows from the unit and the sampler in one place,
:meth:`userdp.accounting.Mechanism.for_training` (via :class:`userdp.engine.plan.RunPlan`).
The loop is shared (docs/algorithms.md gives the algorithms and their sources).

* :class:`ELS` — unit = one record of the G-capped dataset D' (at most G records per user,
  chosen once, uniformly); records Poisson-sampled at rate p; update = that record's gradient;
  event = mixture of Gaussians with sensitivity Binomial(G, p).
* :class:`ULS` — unit = one user; users Poisson-sampled at rate q; update = mean gradient over
  up to G of the user's records drawn fresh each step (``UserData.draw_records``, so selection
  strategies plug in there); event = Poisson-subsampled Gaussian.
  ``random_load`` says whether ``load`` draws anything: the loop then loads each unit with
  a generator keyed by (step, unit), so a unit's records do not depend on the rank loading it.
* :class:`FedAvg` — unit = one user; update = ``theta0 - theta_local`` after E local epochs of
  SGD (local learning rate, local batch size) on up to G of the user's records; optional user
  weights ``w = min(n/w_hat, 1)``; event = Poisson-subsampled Gaussian.
  :func:`FedSGD` is FedAvg with one local step over the whole local batch and local lr 1, so the
  update is the user's mean gradient (S4 Alg 2 form).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from userdp.engine.per_unit import fedavg_epoch_batches
from userdp.engine.user_data import UserData
from userdp.errors import UserError
from userdp.registry import Registry
from userdp.validation import MAX_EPOCHS, check_bool, check_fields, check_int, check_positive, check_rate, optional


@dataclass(frozen=True)
class UnitTable:
    """The units of a run. ELS: (user, record) pairs of D'; ULS/FedAvg: users (records = None)."""

    users: np.ndarray
    records: np.ndarray | None = None
    weights: np.ndarray | None = None  # per-unit weight w in [0, 1] (FedAvg user weights), else None

    def __post_init__(self):
        # the noise is sized by the clip norm C alone: a unit moves the sum by at most w * C, so
        # the contract is 0 <= w <= 1 (a weight above 1 would need its sensitivity and accounting scaled)
        if self.weights is not None:
            w = np.asarray(self.weights, dtype=np.float64)
            if (
                w.shape != (len(self.users),)
                or not np.all(np.isfinite(w))
                or w.min(initial=0.0) < 0
                or w.max(initial=0.0) > 1
            ):
                raise UserError(
                    "unit weights must be finite and in [0, 1], one per unit (the noise is sized by "
                    f"the clip norm alone); got min {np.nanmin(w) if w.size else 'n/a'}, max "
                    f"{np.nanmax(w) if w.size else 'n/a'} over {w.size} weights for {len(self.users)} units"
                )

    def __len__(self) -> int:
        return len(self.users)


@dataclass(frozen=True)
class _Sampled:
    """What every algorithm has: a group size G and a Poisson sampling rate of its units; and what
    every algorithm says of itself, so that no caller compares its name (a plugin's algorithm is
    served like a built-in one): whether it is private, what its unit is, how many units data
    with given record counts has, and the report's sentences about it."""

    group_size: int
    sampling_rate: float
    rate_name = "sampling rate"
    #: False: trained without clipping or noise (epsilon = inf); the run's record says so
    private: ClassVar[bool] = True
    #: the report's description of the privacy unit and the unit's update
    unit_text: ClassVar[str] = "user"
    #: the log's name for the units the sampler draws from
    units_label: ClassVar[str] = "training users"

    def __post_init__(self):
        check_fields(self, group_size=(check_int, "group size G"), sampling_rate=(check_rate, self.rate_name))

    @classmethod
    def from_settings(cls, settings, sampling_rate: float):
        """The algorithm from a run's settings: any object carrying ``group_size`` and, by the same
        names, whichever of the class's other fields it has (the LM config's ``training:``
        section carries ``local_epochs`` and ``local_lr`` for FedAvg)."""
        extra = {
            f.name: getattr(settings, f.name)
            for f in dataclasses.fields(cls)
            if f.name not in ("group_size", "sampling_rate") and hasattr(settings, f.name)
        }
        return cls(group_size=int(settings.group_size), sampling_rate=float(sampling_rate), **extra)

    @classmethod
    def count_units(cls, sizes: np.ndarray, group_size: int) -> int:
        """How many units data with these per-user record counts has: its users, or |D'| (the
        records kept at G per user) when the unit is a record."""
        sizes = np.asarray(sizes)
        return int(np.minimum(sizes, group_size).sum()) if cls.unit == "record" else int(len(sizes))

    @classmethod
    def assumptions(cls, group_size: int) -> list[str]:
        """What the guarantee assumes of this algorithm beyond the sampler (the report lists it)."""
        return []

    @classmethod
    def event_text(cls, accountant: str) -> str:
        """What the report adds to the accountant's name about this algorithm's step event."""
        return ""


@dataclass(frozen=True)
class ELS(_Sampled):
    """DP-SGD with example-level sampling and a user-level guarantee (Charles et al. 2024, ELS).

    Args:
        group_size: G, the most records a user keeps (chosen once).
        sampling_rate: p, the Poisson rate of each record of D'.

    Raises:
        UserError: G not an integer >= 1, or p outside (0, 1].
    """

    name = "els"
    unit = "record"
    update = "gradient"
    random_load = False  # a unit is one fixed record: loading it draws nothing
    rate_name = "ELS record sampling rate p"
    unit_text = (
        "user (ELS: at most G records per user; per-record clipping; the user-level guarantee comes "
        "from the mixture-of-Gaussians accountant)"
    )
    units_label = "records of D'"

    @classmethod
    def assumptions(cls, group_size: int) -> list[str]:
        return [f"each user contributes at most G = {group_size} records (enforced when the unit table D' is built)"]

    @classmethod
    def event_text(cls, accountant: str) -> str:
        return " with a mixture-of-Gaussians step event (Binomial(G, q) sensitivity)" + (
            "; the PLD drops the mixture's components of largest sensitivity whose total probability is "
            "at most 1e-6 of delta and adds their exact cost to epsilon and delta (docs/accounting.md)"
            if accountant == "pld"
            else ""
        )

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
        """The records of units ``ids``: a batch of [m, 1, ...] tensors and a [m, 1] mask."""
        batch = data.gather(table.users[ids], table.records[ids])
        batch = {k: v.unsqueeze(1) for k, v in batch.items()}
        return batch, torch.ones(len(ids), 1)


@dataclass(frozen=True)
class ULS(_Sampled):
    """DP-SGD with user-level sampling and per-user clipping (Charles et al. 2024, ULS).

    Args:
        group_size: G, the most records of a user one step averages (drawn fresh each step).
        sampling_rate: q, the Poisson rate of each user.

    Raises:
        UserError: G not an integer >= 1, or q outside (0, 1].
    """

    name = "uls"
    unit = "user"
    update = "gradient"
    random_load = True  # each step draws up to G of the user's records (one generator per unit)
    rate_name = "ULS user sampling rate q"
    unit_text = "user (ULS: a sampled user's gradient averaged over up to G records, clipped once)"

    @property
    def records_per_unit(self) -> int:
        return int(self.group_size)

    group_sensitivity = 1

    def units(self, data: UserData, rng) -> UnitTable:
        """Every user is a unit."""
        return UnitTable(np.arange(data.num_users, dtype=np.int64))

    def load(self, data: UserData, table: UnitTable, ids, rng):
        """Up to G records of each user in ``ids``: [m, G, ...] tensors and a [m, G] mask."""
        return data.draw_records(table.users[ids], self.group_size, rng)


@dataclass(frozen=True)
class FedAvg(ULS):
    """DP-FedAvg (McMahan et al. 2018): local SGD on each sampled user, the model delta is the unit update.

    ``local_batch_size`` None means the whole (up to G) local data in one batch. ``weight_cap``
    (w_hat) turns on user weights ``w = min(n_u / w_hat, 1)`` with n_u the user's record count;
    the fixed denominator is then q*W with W the total weight (treated as public, as in S2).
    ``reproject=True`` applies McMahan et al.'s greedy re-projection after every local step,
    ``theta <- theta0 + clip(theta - theta0)`` with the run's clipping (flat or per-layer); the
    final delta is then already within the bound (and is clipped again, a no-op).
    """

    local_epochs: int = 1
    local_lr: float = 0.1
    local_batch_size: int | None = None
    weight_cap: float | None = None
    reproject: bool = False
    name = "fedavg"
    update = "local_sgd"
    unit_text = "user (DP-FedAvg: a sampled user's model delta after local SGD, clipped once)"

    def __post_init__(self):
        super().__post_init__()
        check_fields(
            self,
            local_epochs=(check_int, "FedAvg local epochs", 1, MAX_EPOCHS),
            local_lr=(check_positive, "FedAvg local learning rate"),
            local_batch_size=(optional(check_int), "FedAvg local batch size"),
            weight_cap=(optional(check_positive), "FedAvg weight cap w_hat"),
            reproject=(check_bool, "FedAvg reproject"),
        )

    @property
    def local_steps_per_epoch(self) -> int:
        b = self.local_batch_size or self.group_size
        return math.ceil(self.group_size / min(b, self.group_size))

    def load(self, data: UserData, table: UnitTable, ids, rng):
        """The user's local data per local epoch: [m, E, G, ...] tensors and a [m, E, G] mask
        (each epoch a fresh order, real records first; one order when a local batch is the whole
        local data, since the order is then moot)."""
        batch, mask = super().load(data, table, ids, rng)
        if (self.local_batch_size or self.group_size) >= mask.shape[1]:
            e = self.local_epochs
            batch = {n: v.unsqueeze(1).expand(v.shape[0], e, *v.shape[1:]) for n, v in batch.items()}
            return batch, mask.unsqueeze(1).expand(-1, e, -1)
        return fedavg_epoch_batches(batch, mask, self.local_epochs, rng)

    def units(self, data: UserData, rng) -> UnitTable:
        """Every user; with ``weight_cap`` each carries the weight ``min(n_u / w_hat, 1)``."""
        users = np.arange(data.num_users, dtype=np.int64)
        if self.weight_cap is None:
            return UnitTable(users)
        w = np.minimum(data.sizes().astype(np.float64) / self.weight_cap, 1.0)
        return UnitTable(users, weights=w)


def FedSGD(group_size: int, sampling_rate: float, weight_cap: float | None = None) -> FedAvg:
    """DP-FedSGD: one local step with lr 1 over the whole local batch (update = mean gradient)."""
    return FedAvg(group_size, sampling_rate, local_epochs=1, local_lr=1.0, local_batch_size=None, weight_cap=weight_cap)


@dataclass(frozen=True)
class NonPrivate(ULS):
    """Non-private training over the same loop (the baseline a private run is compared with): ULS's
    units and loading, run without clipping or noise; its epsilon is infinite and says so."""

    name = "nonprivate"
    private = False
    unit_text = "none (non-private training)"


Algorithm = ELS | ULS | FedAvg

#: name -> algorithm class; ``training.algorithm`` picks one (``register_algorithm`` adds one)
ALGORITHMS: Registry = Registry(
    "training.algorithm", {"uls": ULS, "els": ELS, "fedavg": FedAvg, "nonprivate": NonPrivate}
)


def register_algorithm(cls: type) -> type:
    """Make an algorithm class available by its ``name`` everywhere (``training.algorithm`` in a
    config, ``userdp train``); usable as a class decorator.

    Raises:
        UserError: the name is taken."""
    return ALGORITHMS.register(cls)
