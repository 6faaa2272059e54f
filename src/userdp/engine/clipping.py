"""Clipping strategies as frozen dataclasses, plus the primitives.

The contract (docs/ARCHITECTURE.md, "Clipping"): a strategy consumes per-unit, per-tensor norms
``[m, L]`` (L trainable tensors) and produces per-unit, per-tensor scale factors ``[m, L]``
(:meth:`factors_from_norms`); the clipped sum is then ``sum_i factor_i * update_i``, never
materializing the clipped copies. It does not see the updates, so a per-unit strategy that never
materializes them (ghost norms) uses it unchanged. Every strategy also answers, with one signature:
``sensitivity(state, num_tensors)`` (the bound on one unit's contribution, what the noise scales
with), ``reproject_bounds(state, num_tensors)`` (FedAvg's greedy re-projection) and
``update(state, noisy_fraction_unclipped)`` (the adaptive step; the identity for fixed norms).

* :class:`FlatClip` — ``pi(g, C)`` on the concatenation of all tensors.
* :class:`PerLayerClip` — ``pi(g_j, S_j)`` per tensor j; default ``S_j = S/sqrt(m)`` so the
  total bound ``sqrt(sum S_j^2)`` is S.
* ``normalized=True`` (De et al. 2022) — each unit contributes ``pi(g, C)/C`` (norm <= 1): the
  sensitivity is 1 and the noise std on the sum is sigma, so the learning rate and C decouple.
* :class:`AdaptiveClip` — flat clipping whose C follows the gamma-quantile of the unclipped
  norms by the geometric update ``C <- C exp(-eta_C (b~ - gamma))`` with a noised count b~
  (Andrew et al.). The count's noise ``sigma_b`` (default m/20, m = expected units per step)
  is accounted through the Theorem-1 split (userdp.accounting.split).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from userdp.errors import UserError
from userdp.validation import check_bool, check_fields, check_fraction, check_positive, optional

_TINY = 1e-12


@dataclass(frozen=True)
class StepClipping:
    """How a per-unit strategy clips the units of one step's chunks: the clipping strategy
    (``clipping``), its state at this step (``state``, e.g. the clip norm), the dtype of the norms
    and sums (float32, or float64 for a float64 model) and FedAvg's re-projection of per-layer
    bounds during local SGD (``reproject``, or None).

    ``lazy_zeroing``: the caller reads the chunk's ``bad`` flags and, where a unit was bad, computes
    the chunk again with it False before anything is released (:meth:`userdp.engine.run.step.EngineRun.release`).
    A strategy may then leave a bad unit's rows unzeroed on a device, where zeroing them is a pass
    over every factor and knowing whether any unit is bad would wait for the device
    (:func:`userdp.engine.contraction.must_zero`); the sums are NaN when such a unit reached them.
    False (the default): every bad unit contributes exactly zero, as the contract says."""

    clipping: Any
    state: dict
    acc_dtype: torch.dtype = torch.float32
    reproject: Callable | None = None
    lazy_zeroing: bool = False


def project(x: torch.Tensor, bound: float | torch.Tensor) -> torch.Tensor:
    """``pi(x, S) = x * min(1, S/||x||)``: norm <= S, identity below S, pi(0) = 0 (no 0/0)."""
    norm = torch.linalg.vector_norm(x)
    return x * torch.clamp(bound / torch.clamp(norm, min=_TINY), max=1.0)


def per_tensor_norms(updates: Sequence[torch.Tensor]) -> torch.Tensor:
    """[m, L]: the L2 norm of each unit's slice of each tensor, computed in float32 (float64 for a
    float64 model) whatever the updates' dtype: a bf16 norm can be off by ~0.4%, enough to let a
    unit past its clip bound."""
    wide = any(u.dtype == torch.float64 for u in updates)
    dt = torch.float64 if wide else torch.float32
    return torch.stack([torch.linalg.vector_norm(u.reshape(u.shape[0], -1), dim=1, dtype=dt) for u in updates], dim=1)


def _factor(norms: torch.Tensor, bound) -> torch.Tensor:
    return torch.clamp(bound / torch.clamp(norms, min=_TINY), max=1.0)


def _flat(tn: torch.Tensor, clip_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat clipping at C from per-tensor norms: (factors [m], flat norms [m])."""
    flat = torch.sqrt((tn**2).sum(dim=1))
    return _factor(flat, clip_norm), flat


def _layer_norms(value, name: str) -> tuple[float, ...]:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise UserError(f"{name} must be a sequence of positive numbers, one per trainable tensor (got {value!r})")
    return tuple(check_positive(v, f"{name}[{i}]") for i, v in enumerate(value))


class _Clipping:
    """What every strategy shares: factors of materialized updates go through their norms."""

    def factors(self, updates: Sequence[torch.Tensor], state: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-unit, per-tensor scale factors [m, L] and the unclipped flat norms [m] of
        materialized updates (one [m, ...] tensor per trainable tensor)."""
        return self.factors_from_norms(per_tensor_norms(updates), state)


class _FixedNorm(_Clipping):
    """What a fixed (non-adaptive) clip norm shares: no state change, no quantile."""

    adaptive = False

    def initial_state(self) -> dict:
        """The clipping state at step 0: ``{"clip_norm": C}``."""
        return {"clip_norm": float(self.norm)}

    def update(self, state: dict, noisy_fraction_unclipped: float) -> dict:
        """A fixed norm does not move."""
        return state


@dataclass(frozen=True)
class FlatClip(_FixedNorm):
    """Clip each unit's whole update to L2 norm ``norm`` (flat clipping).

    Args:
        norm: C > 0.
        normalized: each unit contributes ``pi(g, C)/C`` (De et al. 2022): sensitivity 1.

    Raises:
        UserError: C not a positive finite number.
    """

    norm: float
    normalized: bool = False

    def __post_init__(self):
        check_fields(self, norm=(check_positive, "clip norm"), normalized=(check_bool, "FlatClip normalized"))

    def sensitivity(self, state: dict, num_tensors: int | None = None) -> float:
        """Bound on one unit's contribution to the sum (1 when normalized)."""
        return 1.0 if self.normalized else float(state["clip_norm"])

    def reproject_bounds(self, state: dict, num_tensors: int) -> list[float]:
        """One flat bound: FedAvg's re-projection clips the whole delta to C."""
        return [float(state["clip_norm"])]

    def factors_from_norms(self, tn: torch.Tensor, state: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Scale factors [m, L] (the same for every tensor of a unit) and the flat norms [m]."""
        c = float(state["clip_norm"])
        f, flat = _flat(tn, c)
        if self.normalized:
            f = f / c
        return f.unsqueeze(1).expand(-1, tn.shape[1]), flat


@dataclass(frozen=True)
class PerLayerClip(_FixedNorm):
    """Clip tensor j of each unit's update to ``S_j`` (per-layer clipping, McMahan et al. 2018).

    ``layer_norms`` gives the S_j explicitly (one per trainable tensor, in parameter order);
    by default ``S_j = norm / sqrt(m)``. The total bound is ``sqrt(sum_j S_j^2)``.
    """

    norm: float
    layer_norms: tuple[float, ...] | None = None
    normalized: bool = False

    def __post_init__(self):
        check_fields(
            self,
            norm=(check_positive, "clip norm"),
            layer_norms=(optional(_layer_norms), "layer_norms"),
            normalized=(check_bool, "PerLayerClip normalized"),
        )

    def bounds(self, num_tensors: int) -> list[float]:
        """The per-tensor bounds S_j.

        Raises:
            UserError: ``layer_norms`` has the wrong length."""
        if self.layer_norms is None:
            return [self.norm / math.sqrt(num_tensors)] * num_tensors
        if len(self.layer_norms) != num_tensors:
            raise UserError(
                f"per-layer clipping: {len(self.layer_norms)} layer norms given for {num_tensors} trainable tensors"
            )
        return [float(s) for s in self.layer_norms]

    def total_bound(self, num_tensors: int) -> float:
        """``sqrt(sum_j S_j^2)``: the bound on a unit's whole clipped update."""
        return math.sqrt(sum(s * s for s in self.bounds(num_tensors)))

    def sensitivity(self, state: dict, num_tensors: int | None = None) -> float:
        """The total bound (1 when normalized); ``norm`` when the tensor count is not given."""
        if self.normalized:
            return 1.0
        return self.total_bound(num_tensors) if num_tensors is not None else float(self.norm)

    def reproject_bounds(self, state: dict, num_tensors: int) -> list[float]:
        """One bound per tensor: FedAvg's re-projection clips each tensor of the delta."""
        return self.bounds(num_tensors)

    def factors_from_norms(self, tn: torch.Tensor, state: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-tensor scale factors [m, L] and the flat norms [m]."""
        b = torch.tensor(self.bounds(tn.shape[1]), dtype=tn.dtype, device=tn.device)
        f = _factor(tn, b)
        if self.normalized:
            f = f / self.total_bound(tn.shape[1])
        return f, torch.sqrt((tn**2).sum(dim=1))


@dataclass(frozen=True)
class AdaptiveClip(_Clipping):
    """Adaptive quantile clipping, geometric update (Andrew et al. 2021, and their defaults).

    ``count_stddev`` is sigma_b; None means m/20 with m the expected units per step.
    ``geometric=False`` uses the linear update ``C <- C - eta_C (b~ - gamma)``.
    """

    initial_norm: float = 0.1
    target_quantile: float = 0.5
    learning_rate: float = 0.2
    count_stddev: float | None = None
    geometric: bool = True
    normalized: bool = False  # not supported: the quantile tracks C, normalizing removes it

    def __post_init__(self):
        check_fields(
            self,
            initial_norm=(check_positive, "adaptive clipping: initial clip norm C0"),
            target_quantile=(check_fraction, "adaptive clipping: target quantile"),
            learning_rate=(check_positive, "adaptive clipping: learning rate eta_C"),
            count_stddev=(optional(check_positive), "adaptive clipping: count_stddev sigma_b"),
            geometric=(check_bool, "adaptive clipping: geometric"),
            normalized=(check_bool, "adaptive clipping: normalized"),
        )
        if self.normalized:
            raise UserError("adaptive clipping cannot be normalized (normalizing removes the clip norm)")

    adaptive = True

    def resolved_count_stddev(self, expected_units: float) -> float:
        """sigma_b: the given one, else m/20 with m the expected units per step."""
        return float(self.count_stddev) if self.count_stddev is not None else expected_units / 20.0

    def initial_state(self) -> dict:
        """The clipping state at step 0: ``{"clip_norm": C0}``."""
        return {"clip_norm": float(self.initial_norm)}

    def sensitivity(self, state: dict, num_tensors: int | None = None) -> float:
        """The current clip norm C."""
        return float(state["clip_norm"])

    def reproject_bounds(self, state: dict, num_tensors: int) -> list[float]:
        """One flat bound, the current C."""
        return [float(state["clip_norm"])]

    def factors_from_norms(self, tn: torch.Tensor, state: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat scale factors at the current C [m, L] and the flat norms [m]."""
        f, flat = _flat(tn, float(state["clip_norm"]))
        return f.unsqueeze(1).expand(-1, tn.shape[1]), flat

    def update(self, state: dict, noisy_fraction_unclipped: float) -> dict:
        """One quantile step from the privatized fraction b~ of units with norm <= C."""
        c = float(state["clip_norm"])
        err = noisy_fraction_unclipped - self.target_quantile
        c = c * math.exp(-self.learning_rate * err) if self.geometric else max(c - self.learning_rate * err, _TINY)
        return {"clip_norm": c}


ClipStrategy = FlatClip | PerLayerClip | AdaptiveClip
