"""``userdp calibrate``: the smallest noise multiplier that meets a user-level (ε, δ).

    userdp calibrate --mechanism {els,uls} --epsilon E
                     (--sampling-rate Q | --users N --cohort-size M) --steps T
                     [--group-size G] [--delta D] [--accountant {pld,rdp}]
                     [--count-noise-stddev S] [--fixed-cohort] [--json]

The σ printed is never below the true one (the final evaluation is pessimistic) and at most
about 1% above it.
"""

from __future__ import annotations

import argparse

from userdp.cli.account import (
    add_mechanism_arguments,
    describe,
    emit,
    mechanism_of,
    positive_float,
    resolve,
    split_noise,
)
from userdp.errors import UserError


def register(p) -> None:
    p.description = (
        "Find the smallest noise multiplier for which T steps of ELS or ULS "
        "(DP-FedAvg) training are user-level (epsilon, delta)-DP."
    )
    p.add_argument("--epsilon", type=positive_float, required=True, metavar="E", help="target user-level epsilon")
    add_mechanism_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    m = resolve(args)
    try:
        z = mechanism_of(m, 1.0).calibrated(args.epsilon, m["delta"], m["accountant"]).noise_multiplier
    except UserError as exc:
        raise UserError(f"--epsilon {args.epsilon:g}: {exc}") from None
    split_noise(m, z, args.count_noise_stddev)
    m["epsilon"] = args.epsilon
    m["calibration"] = (
        f"smallest noise multiplier (to 0.4%) whose pessimistic {m['accountant'].upper()} epsilon meets the target"
    )
    emit(m, args.json, describe(m).replace("User-level", "Calibrated: user-level", 1))
    return 0
