"""From the noised sum to the estimate handed to the optimizer (McMahan et al. 2018, Alg. 1 estimators).

* :class:`FixedDenominator` (default): ``(sum + N(0, (sigma*S)^2)) / D`` with the public
  constant D = expected units per step (q*W with user weights). Unbiased.
* :class:`ClippedDenominator`: ``sum / max(q*W_min, realized weight) + N(0, (2*sigma*S/(q*W_min))^2)``
  (McMahan et al. f~_c): biased, lower variance; its sensitivity is 2S/(q W_min), so the noise
  is scaled for that and the accounting multiplier sigma is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FixedDenominator:
    name = "fixed"

    def scales(self, expected_weight: float, realized_weight: float, noise_std_on_sum: float) -> tuple[float, float]:
        """(divide the clipped sum by, std of the noise added to the estimate)."""
        return expected_weight, noise_std_on_sum / expected_weight


@dataclass(frozen=True)
class ClippedDenominator:
    """``min_weight`` is W_min as a fraction of the total weight W (None -> 1, i.e. q*W)."""

    min_weight_fraction: float | None = None
    name = "clipped"

    def scales(self, expected_weight, realized_weight, noise_std_on_sum):
        lo = expected_weight * (self.min_weight_fraction if self.min_weight_fraction is not None else 1.0)
        return max(lo, realized_weight), 2.0 * noise_std_on_sum / lo
