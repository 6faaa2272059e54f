"""No noise source drops Gaussian mass that δ does not carry (the class of the bug 0.9 fixed: numpy's
float32 ziggurat stopped at 8.21 standard deviations, and the mass beyond, 2.3e-16 a normal, was in no
δ). Every source states, per dtype, the largest |z| its sampler can give; either the record adds what
it drops to δ (``tail_mass_per_pair``, ``noise_tail`` in privacy.json), or it is negligible for the
largest run anyone takes: 10^15 normals at ε = 20 add under 1e-9 to δ."""

import math

import pytest
from scipy import stats

from userdp.engine.noise import ziggurat
from userdp.engine.noise.gaussian import DEVICE_SOURCES, GaussianNoise

SOURCES = [GaussianNoise, *DEVICE_SOURCES.values()]
NORMALS, EPSILON, NEGLIGIBLE = 1e15, 20.0, 1e-9


def _unaccounted(bound: float) -> float:
    """What a support of |z| <= bound would add to δ over the largest run, unaccounted."""
    return NORMALS * 2 * stats.norm.sf(bound) * (1 + math.exp(EPSILON))


@pytest.mark.parametrize("source", SOURCES, ids=lambda c: c.__name__)
def test_every_source_bounds_its_normals_and_delta_carries_what_it_drops(source):
    assert source.max_normal, f"{source.__name__} does not say where its normals stop"
    for dtype, bound in source.max_normal.items():
        accounted = getattr(source, "tail_mass_per_pair", None)
        if accounted is not None:  # Box-Muller: a pair is dropped where its radius exceeds the bound
            assert accounted >= math.exp(-(bound**2) / 2), (source.__name__, dtype)
        else:
            assert _unaccounted(bound) < NEGLIGIBLE, (source.__name__, dtype, bound)


def test_the_bound_that_was_there_fails_it():
    """numpy's float32 tail (24-bit uniforms): the property catches the instance it was written for."""
    assert _unaccounted(ziggurat.NUMPY_MAX) > 1.0
    assert GaussianNoise.max_normal["float32"] == ziggurat.TAIL_MAX > ziggurat.NUMPY_MAX + 6
