"""`userdp audit [CONFIG.yaml] [--canaries K] [--set key=value ...] [--output DIR] [--resume RUN_DIR] [--json]`;
`userdp audit --combine RUN_DIR RUN_DIR ... [--json]`."""

from __future__ import annotations

import sys
from pathlib import Path

from userdp.audit.session import AuditSession, combine_runs
from userdp.cli import argtypes as A
from userdp.cli import jsonout
from userdp.errors import UserError
from userdp.lm import config as C
from userdp.lm.finetune import run
from userdp.lm.job_context import Launch
from userdp.lm.run_dir import existing_run_dir, read_json


def register(p) -> None:
    p.description = (
        "Train as `userdp train` does, with K synthetic canary users each included with "
        "probability 1/2, and report the one-run lower bound on epsilon (Steinke, Nasr & "
        "Jagielski 2023) beside the accounted upper bound, plus a user-inference diagnostic. "
        "The canaries' seed and scores go to a secrets file beside the run directory. "
        "See docs/audit.md."
    )
    p.add_argument("config", nargs="?", help="YAML config layered over the embedded default")
    p.add_argument(
        "--canaries", type=int, metavar="K", help="canary users (default: audit.canaries of the config, else 400)"
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config key (dotted); repeatable",
    )
    p.add_argument("--output", metavar="DIR", type=A.output_dir, help="run directory (default runs/<timestamp>)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue an interrupted audited run")
    p.add_argument(
        "--combine",
        nargs="+",
        metavar="RUN_DIR",
        help="train nothing: pool the canaries of several audited runs into one bound",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=main)


DEFAULT_CANARIES = 400


def main(args) -> int:
    if args.combine:
        if args.config or args.overrides or args.output or args.resume or args.canaries is not None:
            raise UserError(
                "--combine RUN_DIR ... trains nothing: give no CONFIG, --set, --output, --resume or --canaries with it"
            )

        r = combine_runs(args.combine)
        print(f"audit of {r['runs']} runs: {r['statement']} — {r['canaries']} canary users pooled")
        if args.json:
            print(jsonout.dumps(r))
        return 0
    if args.resume:
        if args.config or args.overrides or args.output or args.canaries is not None:
            raise UserError(
                "--resume RUN_DIR continues an audited run with its saved config: give no "
                "CONFIG, --set, --output or --canaries with it"
            )

        cfg = C.load_config(existing_run_dir(args.resume).config)
        if not cfg.audit.canaries:
            raise UserError(
                f"--resume {args.resume}: this run is not an audit (audit.canaries is 0); use userdp train --resume"
            )
    else:
        if args.canaries is not None and args.canaries < 2:
            raise UserError(f"--canaries: need at least 2 canaries, got {args.canaries}")
        cfg = C.load_config(args.config, args.overrides)
        k = args.canaries if args.canaries is not None else (cfg.audit.canaries or DEFAULT_CANARIES)
        cfg = C.load_config(args.config, args.overrides + [f"audit.canaries={k}"])

    s = run(
        cfg,
        output=args.output,
        resume_dir=args.resume,
        progress=not args.no_progress,
        launch=Launch(audit=AuditSession),
    )
    a = s["audit"]
    print(f"run directory:        {s['run_dir']}")
    print(f"audit:                {a['statement']} — {a['canaries']} canary users, {a['canaries_included']} included")
    if a["mechanism_caught"]:
        print(
            "                      THE LOWER BOUND EXCEEDS THE ACCOUNTED EPSILON: the implementation or "
            "its accounting is broken"
        )
    print(f"report:               userdp report {s['run_dir']}")
    sys.stdout.flush()
    if args.json:
        out = {
            "run_dir": s["run_dir"],
            "algorithm": s["algorithm"],
            "epsilon": s["epsilon"],
            "delta": s["delta"],
            **{k: v for k, v in a.items()},
        }

        full = read_json(Path(s["run_dir"]) / "privacy.json").get("audit") or {}
        out.update({k: full.get(k) for k in ("guesses", "correct", "canary_auc", "user_inference", "secrets_file")})
        print(jsonout.dumps(out))
    return 0
