"""Run every benchmark (or the ones named) from one command.

    python benchmarks/run.py                 # all of them
    python benchmarks/run.py accounting data # only bench_accounting.py and bench_data.py
    python benchmarks/run.py --quick         # reduced sizes, for a smoke check

Each benchmark is a script ``benchmarks/bench_<name>.py`` that measures its baseline in the
same run and prints ratios against it; this runner only runs them in turn and stops on none.
Figures and the commands that give them are kept in benchmarks/README.md.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv: list[str]) -> int:
    quick = "--quick" in argv
    names = [a for a in argv if not a.startswith("--")]
    scripts = sorted(HERE.glob("bench_*.py"))
    if names:
        wanted = {f"bench_{n}.py" for n in names}
        unknown = wanted - {s.name for s in scripts}
        if unknown:
            print(f"unknown benchmark(s): {', '.join(sorted(unknown))}", file=sys.stderr)
            return 2
        scripts = [s for s in scripts if s.name in wanted]
    failed = []
    for script in scripts:
        print(f"\n=== {script.name} ===", flush=True)
        cmd = [sys.executable, str(script)] + (["--quick"] if quick else [])
        if subprocess.call(cmd) != 0:
            failed.append(script.name)
    if failed:
        print(f"\nfailed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
