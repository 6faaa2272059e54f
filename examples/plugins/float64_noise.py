"""A new noise mechanism in one file: the step's Gaussian noise added in float64.

The built-in ``iid_gaussian`` adds N(0, std² I) to each clipped sum in the sum's own dtype
(float32 for a float32 model). Some users want the noisy sum formed in float64 before it is
rounded to the parameters' dtype. This mechanism draws the same i.i.d. Gaussian noise from the
run's keyed source in float64, adds it to a float64 copy of each sum and writes the result
back: the same distribution, so the accounting (a Gaussian mechanism of std σC) is unchanged. It
overrides the mechanism's whole ``update`` (not its coordinate-wise ``filter``), so it runs where
the model is whole (``training.sharding: none``; a sharded run refuses it before any step).

    userdp train config.yaml --plugin examples/plugins/float64_noise.py --set privacy.noise=iid_gaussian_float64
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from userdp.engine.noise.mechanism import NOISE_MECHANISMS, IIDGaussian


class Float64Gaussian(IIDGaussian):
    """i.i.d. N(0, std² I), drawn and added in float64 (see the module docstring)."""

    name = "iid_gaussian_float64"

    def update(self, sums: Sequence[torch.Tensor], state, std: float):
        if self.source is None or not std > 0:
            return sums, state
        wide = [t.to(torch.float64) for t in sums]
        self.source.add_(wide, std)  # float64 tensors: the noise is drawn in float64
        with torch.no_grad():
            for t, w in zip(sums, wide, strict=True):
                t.copy_(w)
        return sums, state


if Float64Gaussian.name not in NOISE_MECHANISMS:  # importing this file twice registers it once
    NOISE_MECHANISMS.register(Float64Gaussian, name=Float64Gaussian.name)
