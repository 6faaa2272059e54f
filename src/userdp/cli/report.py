"""`userdp report RUN_DIR [--json]`: the privacy statement (Ponomareva et al. 2023, §5.3.3) of a run."""

from __future__ import annotations

from userdp.cli import jsonout
from userdp.lm.report import write_report


def register(p) -> None:
    p.description = (
        "Write report.md and report.json into RUN_DIR and print "
        "the privacy statement (the checklist of Ponomareva et al. 2023, §5.3.3) as Markdown."
    )
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--json", action="store_true", help="print the statement as JSON instead")
    p.add_argument(
        "--delta",
        type=float,
        default=None,
        metavar="D",
        help="also state epsilon at this delta, re-derived from the run's DpEvent",
    )
    p.set_defaults(func=main)


def main(args) -> int:
    rep, md = write_report(args.run_dir, args.delta)
    if args.json:
        print(jsonout.dumps(rep, indent=2))
    else:
        print(md, end="")
    return 0
