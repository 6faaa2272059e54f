"""The noise-standard-deviation proxies (Charles et al. 2024, §3, App. B) and sigma(M)."""

from __future__ import annotations

import functools
from collections.abc import Callable

from userdp import accounting


def els_noise_std(noise_multiplier: float, batch_size: float, grad_norm: float = 1.0) -> float:
    """Per-coordinate std of ELS's noise in the averaged gradient with C = L: sigma_ELS * L / B."""
    return float(noise_multiplier * grad_norm / batch_size)


def uls_noise_std(noise_multiplier: float, cohort_size: float, user_grad_norm: float = 1.0) -> float:
    """Per-coordinate std of ULS's noise with C = L_G: sigma_ULS * L_G / M (= sigma L_G G / B)."""
    return float(noise_multiplier * user_grad_norm / cohort_size)


def variance_ratio(group_size_uls: float, l_g: float, sigma_uls: float, sigma_els: float, l: float = 1.0) -> float:
    """Charles et al. 2024, §3, App. B eq. (7): Var_ULS / Var_ELS = (G_ULS * L_G * sigma_ULS / (L * sigma_ELS))**2."""
    return float((group_size_uls * l_g * sigma_uls / (l * sigma_els)) ** 2)


def uls_sigma_of_m(
    num_users: int, steps: int, epsilon: float, delta: float, accountant: str = "pld"
) -> Callable[[int], float]:
    """sigma(M): the ULS noise multiplier for q = M/N at fixed (epsilon, delta, T), cached."""

    @functools.cache
    def sigma(m: int) -> float:
        return uls_noise_multiplier(min(1.0, m / num_users), steps, epsilon, delta, accountant)

    return sigma


def els_noise_multiplier(
    sampling_rate: float,
    group_size: int,
    steps: int,
    epsilon: float,
    delta: float,
    accountant: str = "pld",
) -> float:
    """The calibrated ELS noise multiplier at record rate p and group size G."""
    return float(
        accounting.Mechanism("els", 1.0, steps, sampling_rate=sampling_rate, group_size=group_size)
        .calibrated(epsilon, delta, accountant)
        .noise_multiplier
    )


def uls_noise_multiplier(
    sampling_rate: float, steps: int, epsilon: float, delta: float, accountant: str = "pld"
) -> float:
    """The calibrated ULS (and DP-FedAvg) noise multiplier at user rate q."""
    return float(
        accounting.Mechanism("uls", 1.0, steps, sampling_rate=sampling_rate)
        .calibrated(epsilon, delta, accountant)
        .noise_multiplier
    )
