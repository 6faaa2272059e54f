"""``userdp account``: the user-level (ε, δ) of a mechanism run for T steps.

    userdp account --mechanism {els,uls} --noise-multiplier Z
                   (--sampling-rate Q | --users N --cohort-size M) --steps T
                   [--group-size G] [--delta D] [--accountant {pld,rdp}]
                   [--count-noise-stddev S] [--fixed-cohort] [--bands B] [--json]

Shared argument handling for ``userdp calibrate`` lives here too.
"""

from __future__ import annotations

import argparse
from typing import Any

from userdp import accounting
from userdp.accounting import split as adaptive_clipping
from userdp.cli import argtypes as A
from userdp.cli import jsonout
from userdp.cli.argtypes import open_unit, positive_float, positive_int, rate  # noqa: F401 (re-exported)
from userdp.errors import UserError


def add_mechanism_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments common to ``account`` and ``calibrate`` (everything but ε / σ)."""
    p.add_argument(
        "--mechanism",
        required=True,
        choices=["els", "uls"],
        help="els: example-level sampling (records Poisson-sampled at rate q, at most "
        "G per user); uls: user-level sampling (users Poisson-sampled at rate q; "
        "also DP-FedAvg / DP-FedSGD)",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--sampling-rate", type=rate, metavar="Q", help="sampling probability: of each record (els) or each user (uls)"
    )
    src.add_argument(
        "--users",
        type=positive_int,
        metavar="N",
        help="number of users N; with --cohort-size M the rate is M/N (for els each "
        "record is sampled with probability M/N, the compute of a uls cohort "
        "of M users). Also sets the default delta N^-1.1",
    )
    p.add_argument("--cohort-size", type=positive_int, metavar="M", help="expected users per step (with --users)")
    p.add_argument(
        "--fixed-cohort",
        action="store_true",
        help="uls only: cohorts of exactly M users drawn without replacement "
        "(replace-one adjacency, RDP accountant) instead of Poisson sampling",
    )
    p.add_argument(
        "--bands",
        type=positive_int,
        metavar="B",
        help="uls only: cyclic Poisson sampling over B groups of users (a user's steps B apart, each group "
        "sampled at Q·B; with or without banded matrix-factorization noise): T steps are accounted as "
        "ceil(T/B) compositions. Default: plain Poisson sampling",
    )
    p.add_argument("--steps", type=positive_int, required=True, metavar="T", help="number of training steps (rounds)")
    p.add_argument(
        "--group-size", type=positive_int, default=1, metavar="G", help="at most G records per user (default 1)"
    )
    p.add_argument(
        "--delta", type=open_unit, metavar="D", help="target delta; default N^-1.1 when --users is given, else required"
    )
    p.add_argument(
        "--accountant",
        choices=A.ACCOUNTANT_NAMES,
        metavar="NAME",
        default=None,
        help="%(choices)s: pld (default; tight) or rdp (fast, for tiny delta), or a plugin's. "
        "Fixed cohorts always use rdp",
    )
    p.add_argument(
        "--count-noise-stddev",
        type=positive_float,
        metavar="S",
        help="adaptive clipping: std of the noise on the clipped-count (sigma_b). "
        "The noise multiplier is then the effective one (Andrew et al. Thm 1) "
        "and the update gets (z^-2 - (2S)^-2)^-1/2",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


def resolve(args: argparse.Namespace) -> dict[str, Any]:
    """Validate the combination of arguments; return the mechanism's fixed parts."""
    out: dict[str, Any] = {"mechanism": args.mechanism, "group_size": args.group_size, "steps": args.steps}
    if args.users is not None:
        if args.cohort_size is None:
            raise UserError("--users needs --cohort-size (or give --sampling-rate instead)")
        if args.cohort_size > args.users:
            raise UserError(f"--cohort-size ({args.cohort_size}) must not exceed --users ({args.users})")
        out["users"], out["cohort_size"] = args.users, args.cohort_size
        out["sampling_rate"] = args.cohort_size / args.users
    else:
        if args.cohort_size is not None:
            raise UserError("--cohort-size needs --users (the rate is cohort size / users)")
        out["sampling_rate"] = args.sampling_rate
    if args.fixed_cohort:
        if args.mechanism != "uls":
            raise UserError("--fixed-cohort applies to --mechanism uls only")
        if args.users is None:
            raise UserError("--fixed-cohort needs --users and --cohort-size")
        if args.accountant == "pld":
            raise UserError(
                "--accountant pld cannot account --fixed-cohort (sampling without replacement): use --accountant rdp"
            )
        out["sampling"] = "fixed_cohort_without_replacement"
        out["accountant"] = "rdp"
    else:
        out["sampling"] = "poisson"
        out["accountant"] = args.accountant or "pld"
    if args.bands is not None:
        if args.mechanism != "uls" or args.fixed_cohort:
            raise UserError("--bands applies to --mechanism uls with Poisson sampling only (users in B groups)")
        out["sampling"], out["bands"] = "cyclic_poisson", args.bands
    if args.delta is not None:
        out["delta"], out["delta_rule"] = args.delta, "delta given by --delta"
        if args.users is not None and args.delta * args.users >= 1.0:
            raise UserError(
                f"--delta {args.delta:g} is at least 1/N = {1 / args.users:.3g} (--users {args.users}): "
                "such a delta allows publishing a user's data outright; use at most 1/(10 N)"
            )
    elif args.users is not None:
        out["delta"], out["delta_rule"] = accounting.default_delta(args.users)
    else:
        raise UserError("--delta is required unless --users is given (then it defaults to N^-1.1)")
    out["adjacency"] = (
        "replace_one_user" if out["sampling"] == "fixed_cohort_without_replacement" else "add_or_remove_one_user"
    )
    return out


def mechanism_of(m: dict[str, Any], noise_multiplier: float):
    """The resolved flags as a :class:`userdp.accounting.Mechanism` (the one event mapping)."""
    units = accounting.UnitSampling(
        "record" if m["mechanism"] == "els" else "user", m["sampling_rate"], m["group_size"]
    )
    sampling = {"poisson": "poisson", "cyclic_poisson": "cyclic_poisson"}.get(m["sampling"], "fixed_size")
    return accounting.Mechanism.for_training(
        units, sampling, noise_multiplier, m["steps"], m.get("users"), m.get("bands", 1)
    )


def split_noise(m: dict[str, Any], effective_z: float, count_stddev: float | None) -> None:
    m["noise_multiplier"] = effective_z
    if count_stddev is not None:
        m["count_noise_stddev"] = count_stddev
        try:
            m["update_noise_multiplier"] = adaptive_clipping.update_noise_multiplier(effective_z, count_stddev)
        except UserError:
            raise UserError(
                f"--count-noise-stddev {count_stddev:g} is too small: adaptive clipping needs "
                f"2*S > noise multiplier {effective_z:.6g}"
            ) from None


def _accountant_label(m: dict) -> str:
    """ "PLD", "RDP", or "RDP (why PLD could not answer)"."""
    used = m.get("accountant_used") or m["accountant"]
    return used[:3].upper() + used[3:]


def describe(m: dict[str, Any]) -> str:
    unit = "records" if m["mechanism"] == "els" else "users"
    if m["sampling"] == "poisson":
        sampling = f"Poisson sampling of {unit} at rate {m['sampling_rate']:.6g}"
    elif m["sampling"] == "cyclic_poisson":
        b = m["bands"]
        sampling = (
            f"cyclic Poisson sampling of users in {b} groups (each group at rate {m['sampling_rate'] * b:.6g} in "
            f"one step of every {b}; {accounting.cycle_compositions(m['steps'], b)} compositions; the same with "
            "banded MF noise)"
        )
    else:
        sampling = f"fixed cohorts of {m['cohort_size']} of {m['users']} users without replacement"
    parts = [
        f"User-level ({m['epsilon']:.4g}, {m['delta']:.3g})-DP",
        f"for {m['mechanism'].upper()} with G={m['group_size']}, noise multiplier "
        f"{m['noise_multiplier']:.6g}, T={m['steps']} steps, {sampling};",
        f"adjacency: {m['adjacency'].replace('_', ' ')} (all of one user's data);",
        f"accountant: {_accountant_label(m)}; {m['delta_rule']}.",
    ]
    if "update_noise_multiplier" in m:
        parts.append(
            f"Adaptive clipping: count noise stddev {m['count_noise_stddev']:g}, "
            f"update noise multiplier {m['update_noise_multiplier']:.6g} "
            f"(effective {m['noise_multiplier']:.6g})."
        )
    return " ".join(parts)


def emit(m: dict[str, Any], as_json: bool, text: str) -> None:
    if as_json:
        print(jsonout.dumps(m, sort_keys=True))
    else:
        print(text)


# ------------------------------------------------------------------ the command
def register(p) -> None:
    p.description = (
        "Compute the user-level privacy guarantee of T steps of ELS or ULS "
        "(DP-FedAvg) training with a given noise multiplier."
    )
    p.add_argument(
        "--noise-multiplier",
        type=positive_float,
        required=True,
        metavar="Z",
        help="noise std / clip norm (with --count-noise-stddev: the effective one)",
    )
    add_mechanism_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    m = resolve(args)
    split_noise(m, args.noise_multiplier, args.count_noise_stddev)
    event = mechanism_of(m, args.noise_multiplier).event()
    m["epsilon"], m["accountant_used"] = accounting.epsilon_and_accountant(event, m["delta"], m["accountant"])
    m["step_event"] = accounting.event_to_dict(event.event)
    emit(m, args.json, describe(m))
    return 0
