"""`userdp export RUN_DIR DEST`: the release bundle of a run, exactly what may be published
(the model and its card at the root, the evidence `userdp report DEST` verifies under userdp/)."""

from __future__ import annotations

from userdp.lm.export import export_release


def register(p) -> None:
    p.description = (
        "Copy what may be published from RUN_DIR into DEST, laid out as a Hugging Face model repository: "
        "the model and its card at the root, and under userdp/ the files `userdp report DEST` verifies "
        "(never the records, the un-noised diagnostics or the resume state)."
    )
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("dest", metavar="DEST", help="the bundle's folder (absent or empty)")
    p.set_defaults(func=main)


def main(args) -> int:
    dest = export_release(args.run_dir, args.dest)
    print(f"release bundle: {dest} (verify it with `userdp report {dest}`)")
    return 0
