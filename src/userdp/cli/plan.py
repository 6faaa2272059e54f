"""``userdp plan [CONFIG.yaml] --compute-budget B --epsilon E [--steps T] [--json]``.

Resolves the training data and (pretrained) model exactly as ``userdp train`` would (the
embedded Shakespeare default without a CONFIG), then runs :func:`userdp.planning.plan_for_training`:
G_ELS = median records per user, ULS (M, G) by Estimate-and-Double, sigma for each, and the noise
std proxies of Charles et al. 2024, §3, App. B with a recommendation.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

from userdp import planning
from userdp.caches import cache_in, private_cache_for
from userdp.cli import argtypes as A
from userdp.cli import jsonout
from userdp.devices import resolve_device
from userdp.errors import UserError
from userdp.fileio import write_json
from userdp.lm import config as C
from userdp.lm import models
from userdp.lm.plan_auto import plan_record
from userdp.lm.prepare import build_datasets, prepare_data
from userdp.lm.starting_model import get_tokenizer_and_model


class ResolvedTraining(NamedTuple):
    """What ``userdp train`` would train: the resolved config, the training users' UserData, the
    (pretrained) model in train mode, the per-record loss, the held-out users' UserData and the
    data + split fingerprint."""

    cfg: object
    train_data: object
    model: object
    loss_fn: object
    eval_data: object
    data_fingerprint: str


def resolve_training(config_path: str | None, overrides: list[str] | None, log) -> ResolvedTraining:
    """Resolve data, tokenizer and model exactly as ``userdp train`` does (see ResolvedTraining)."""

    cfg = C.load_config(config_path, overrides or [])
    device = resolve_device(cfg.model.device)  # the L(G) gradients run where training will (model.device)
    prep = prepare_data(cfg.data, log)
    tok, model, _notes = get_tokenizer_and_model(cfg.tokenizer, cfg.model, prep, log, progress=True, device=device)
    if cfg.model.lora.enabled:
        lc = cfg.model.lora
        model = models.apply_lora(model, models.LoraSpec(lc.rank, lc.alpha, lc.target_modules))

    model.to(device)
    model.train()
    train_data, eval_data = build_datasets(
        prep, tok, seq_len=cfg.tokenizer.seq_len, selection=cfg.training.selection, log=log
    )
    return ResolvedTraining(cfg, train_data, model, models.causal_lm_loss, eval_data, prep.data_fingerprint)


def _run(args: argparse.Namespace) -> int:
    setting = C.load_config(args.config, args.set or []).output.cache
    if setting == "run":
        # no run directory yet: the private caches (store, tokenized records) live in a folder
        # removed when planning ends; the public pretrained model stays in the shared cache
        with tempfile.TemporaryDirectory(prefix="userdp-plan-cache-") as tmp, cache_in(Path(tmp)):
            return _plan(args)
    where = private_cache_for(setting, None)  # a project's folder: the runs that follow reuse what it reads
    if where is not None:
        with cache_in(where):
            return _plan(args)
    return _plan(args)


def _check_save(args: argparse.Namespace) -> Path:
    """Where the plan goes, checked before the planning pass: never the config it read, never a
    folder, never into a missing folder."""
    save = Path(args.save) if args.save else Path.cwd() / time.strftime("userdp-plan-%Y%m%d-%H%M%S.json", time.gmtime())
    if save.is_dir():
        raise UserError(f"--save {save}: a folder; give a file name (e.g. {save / 'plan.json'})")
    if not save.parent.is_dir():
        raise UserError(f"--save {save}: the folder {save.parent} does not exist")
    if args.config and save.exists() and save.resolve() == Path(args.config).resolve():
        raise UserError(f"--save {save}: that is the config this plan reads; save the plan elsewhere")
    if save.exists() and not save.is_file():
        raise UserError(f"--save {save}: exists and is not a regular file")
    return save


def _plan(args: argparse.Namespace) -> int:
    logging.getLogger("absl").setLevel(logging.ERROR)
    save = _check_save(args)
    if args.compute_budget < 1:
        raise UserError(f"--compute-budget must be >= 1, got {args.compute_budget}")
    if args.sample_users < 1:
        raise UserError(f"--sample-users must be >= 1, got {args.sample_users}")

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if args.device:
        resolve_device(args.device, name="--device")  # refused here, naming the flag
    sets = list(args.set or []) + ([f"model.device={args.device}"] if args.device else [])
    r = resolve_training(args.config, sets, log)
    cfg, data, model, loss_fn, data_fp = r.cfg, r.train_data, r.model, r.loss_fn, r.data_fingerprint
    epsilon = args.epsilon if args.epsilon is not None else cfg.privacy.epsilon
    steps = args.steps if args.steps is not None else cfg.training.steps
    delta = args.delta if args.delta is not None else cfg.privacy.delta
    log(
        f"planning: estimating L(G) on {min(args.sample_users, data.num_users)} sampled users, calibrating sigma(M) ..."
    )
    budget = planning.PlanBudget(
        args.compute_budget,
        epsilon,
        steps,
        delta=delta,
        accountant=args.accountant or cfg.privacy.accountant,
        dp_median_epsilon=args.dp_median_epsilon,
    )
    sample = planning.NormSample(args.sample_users, chunk_size=cfg.training.chunk_size or 8, seed=args.seed)
    plan = planning.plan_for_training(data, model, loss_fn, budget, sample, log=log)

    out = plan_record(plan, plan.recommended, "recommended", seed=args.seed, data_fingerprint=data_fp)
    i = plan.inputs  # banded MF noise for the ULS plan: a model of the noise, not applied (docs/plan.md)
    bands = planning.choose_bands(plan.uls["sampling_rate"], steps, i["epsilon"], i["delta"], i["accountant"])
    out["uls_bands"] = bands
    out["config"] = args.config or "embedded default of `userdp train`"
    out["config_overrides"] = list(args.set or [])
    out["apply"] = {k: v for k, v in plan.training_overrides().items()}
    write_json(save, out)
    out["saved_to"] = str(save)
    if args.json:
        print(jsonout.dumps(out, indent=1))
    else:
        print(planning.format_plan(plan))
        print(f"  ULS with banded matrix-factorization noise: {bands['why']}")
        if bands["bands"] > 1:
            print(
                f"    to use it: --set privacy.sampler=cyclic_poisson --set privacy.noise=bandmf "
                f"--set privacy.bands={bands['bands']} (not applied by --plan: docs/results.md measures where it helps)"
            )
        if args.seed is not None and plan.els.get("group_size_method") == "dp_median":
            print("  note: SEEDED DP median (--seed): whoever holds the seed can undo its noise")
        sets = "".join(f" --set {shlex.quote(x)}" for x in (args.set or []))
        cmd = (
            f"userdp train {shlex.quote(args.config) + ' ' if args.config else ''}--plan {shlex.quote(str(save))}{sets}"
        )
        print(f"\n  plan saved to {save}")
        print(f"  to train it (the report then lists the plan's data touches and counts its epsilon):\n    {cmd}")
        print(SIBLING_NOTE)
    return 0


#: what `userdp plan` says of the runs that follow it without --plan
SIBLING_NOTE = "\n".join(
    (
        "  note: this plan read the private training data (the DP median of records per user, if any, is a DP",
        "  release; the L(G) and sigma passes are not private). A run trained WITHOUT --plan after looking at",
        "  this plan carries no trace of it: train with --plan, or record it in that run's config under",
        '  privacy.disclosed_touches (e.g. "userdp plan: looked at the plan of FILE before choosing G and the',
        '  cohort"), which the report lists as not accounted (docs/plan.md).',
    )
)


def register(p) -> None:
    p.description = (
        "For ELS: G = median records per user, expected batch, sampling rate, sigma. "
        "For ULS: (cohort M, group G) by Estimate-and-Double, sampling rate, sigma. "
        "Prints the noise-std proxy of each and recommends the lower. The sampled "
        "users and their gradient norms are a non-private touch of the data."
    )
    p.add_argument(
        "config", nargs="?", default=None, help="training config YAML (default: the embedded default of `userdp train`)"
    )
    p.add_argument(
        "--compute-budget",
        type=A.positive_int,
        required=True,
        metavar="B",
        help="gradients per step (ELS expected batch; ULS M*G)",
    )
    p.add_argument("--epsilon", type=A.positive_float, default=None, help="target epsilon (default: the config's)")
    p.add_argument("--steps", type=A.positive_int, default=None, help="T (default: the config's training.steps)")
    p.add_argument("--delta", type=A.open_unit, default=None, help="default: the config's, else N^-1.1")
    p.add_argument("--sample-users", type=A.positive_int, default=128, help="users sampled to estimate L(G) (128)")
    p.add_argument(
        "--dp-median-epsilon",
        type=A.positive_float,
        default=None,
        help="release the ELS median with this epsilon-DP (counted by the report)",
    )
    p.add_argument(
        "--accountant",
        choices=A.ACCOUNTANT_NAMES,
        metavar="NAME",
        default=None,
        help="the accountant for sigma's calibration: %(choices)s (default: the config's)",
    )
    p.add_argument("--seed", type=int, default=None, help="seed for the user sample and record draws")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set data.max_users=300",
    )
    p.add_argument(
        "--save",
        metavar="PLAN.json",
        default=None,
        help="where to save the plan for `userdp train --plan` (default: "
        "userdp-plan-<UTC time>.json in the current directory)",
    )
    A.add_device_option(p, "the gradient norms run")
    p.add_argument(
        "--json", action="store_true", help="print one JSON object with keys els, uls, recommended, data_touches"
    )
    p.set_defaults(func=_run)
