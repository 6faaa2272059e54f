"""User-level privacy accounting: one ``dp_accounting`` DpEvent per training step.

The package, one concern per module:

* :mod:`~userdp.accounting.events` — the step events (ELS mixture, ULS Poisson Gaussian, fixed
  cohorts, no amplification), composition, adjacency, JSON form.
* :mod:`~userdp.accounting.mechanism` — :class:`Mechanism`, the one place where a run's unit,
  sampling and noise become its step event.
* :mod:`~userdp.accounting.accountants` — the :class:`Accountant` interface and its registry
  (``pld``, ``rdp``); :func:`epsilon`, :func:`delta`, :func:`max_steps` dispatch through it.
* :mod:`~userdp.accounting.pld`, :mod:`~userdp.accounting.rdp` — the two backends.
* :mod:`~userdp.accounting.calibration` — the smallest noise multiplier meeting a target.
* :mod:`~userdp.accounting.group_privacy` — the generic group-privacy baseline.
* :mod:`~userdp.accounting.split` — Theorem 1 of Andrew et al.: adaptive clipping's noise split.

Calibration returns a noise multiplier that is never below the true one: every evaluation it
relies on is an upper bound on epsilon (pessimistic PLD, or RDP), and the returned sigma is one at
which such an evaluation met the target. docs/accounting.md gives the formulas and their sources.
"""

from userdp.accounting.accountants import (
    ACCOUNTANTS,
    Accountant,
    PLDAccountant,
    RDPAccountant,
    StepSearch,
    check_supports,
    clear_caches,
    delta,
    epsilon,
    epsilon_and_accountant,
    get_accountant,
    max_steps,
    register_accountant,
)
from userdp.accounting.calibration import SIGMA_MAX, Calibration, calibrate_noise_multiplier
from userdp.accounting.events import (
    MAX_CALIBRATION_EPSILON,
    MAX_ELS_GROUP,
    MAX_TARGET_EPSILON,
    NeighborRel,
    adjacency,
    binomial_sensitivity,
    check_target_epsilon,
    compose,
    compose_after,
    default_delta,
    els_step_event,
    event_from_dict,
    event_to_dict,
    event_to_json,
    fixed_cohort_step_event,
    has_pure_dp,
    no_amplification_step_event,
    pure_dp_epsilon,
    pure_dp_event,
    split_pure_dp,
    uls_step_event,
)
from userdp.accounting.mechanism import MAX_BANDS, Mechanism, UnitSampling, cycle_compositions

# backend internals that the tests inspect (the PLD cache and the vectorized PLDs)
from userdp.accounting.pld import (  # noqa: F401
    PLD_CACHE,
    PLD_INTERVAL,
    PLD_MAX_STEPS,
    PLD_SIGMA_RANGE,
    gaussian_pld,
    mixture_gaussian_pld,
    pld_distribution,
)
from userdp.accounting.rdp import RDP_ORDERS, mog_rdp, moments_accountant_epsilon, rdp_orders, step_rdp
from userdp.validation import MIN_SAMPLING_RATE

__all__ = [
    "ACCOUNTANTS",
    "Accountant",
    "check_supports",
    "PLDAccountant",
    "RDPAccountant",
    "register_accountant",
    "get_accountant",
    "MAX_BANDS",
    "cycle_compositions",
    "Mechanism",
    "UnitSampling",
    "els_step_event",
    "uls_step_event",
    "fixed_cohort_step_event",
    "no_amplification_step_event",
    "binomial_sensitivity",
    "compose",
    "compose_after",
    "pure_dp_event",
    "pure_dp_epsilon",
    "has_pure_dp",
    "split_pure_dp",
    "epsilon",
    "delta",
    "Calibration",
    "calibrate_noise_multiplier",
    "max_steps",
    "StepSearch",
    "default_delta",
    "adjacency",
    "event_to_dict",
    "event_to_json",
    "event_from_dict",
    "epsilon_and_accountant",
    "moments_accountant_epsilon",
    "rdp_orders",
    "step_rdp",
    "mog_rdp",
    "clear_caches",
    "NeighborRel",
    "PLD_INTERVAL",
    "PLD_SIGMA_RANGE",
    "PLD_MAX_STEPS",
    "RDP_ORDERS",
    "SIGMA_MAX",
    "MAX_ELS_GROUP",
    "MIN_SAMPLING_RATE",
    "MAX_CALIBRATION_EPSILON",
    "MAX_TARGET_EPSILON",
    "check_target_epsilon",
]
