"""The hostile-input catalogue (issue 9): every case must end in exit status 2 with one line
``userdp: error: ...`` naming what is wrong (or argparse's one line naming the option), no
traceback, no hang, no damaged input and no half-written output. Accounting extremes may
instead answer (exit 0) — within their time limit.

The cases live in ``_fuzz_cases.py`` (accounting extremes and numbers, damaged data files and
stores, CLI numbers and paths, damaged run directories): over 150, across every command.
"""

import hashlib
import signal
import time
from pathlib import Path

import pytest

from userdp.cli import main

from _fuzz_cases import all_cases, copy_run, make_run

CASES = all_cases()


def test_the_catalogue_is_large_and_covers_every_category():
    assert len(CASES) >= 150
    cats = {c.category for c in CASES}
    assert {
        "accounting extremes",
        "damaged data files",
        "CLI numbers and paths",
        "run directories",
        "plan files",
        "tuning",
    } <= cats
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.fixture(scope="module")
def fuzz_env(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    mp = pytest.MonkeyPatch()
    mp.setenv("USERDP_CACHE", str(root / "cache"))
    yield root
    mp.undo()


@pytest.fixture(scope="module")
def finished_run(fuzz_env):
    return make_run(fuzz_env)


class _Hang(Exception):
    pass


def _alarm(signum, frame):
    raise _Hang


def _digest(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "absent"


def _outputs(argv: list[str]) -> list[Path]:
    out = []
    for flag in ("--output", "--out"):
        if flag in argv:
            out.append(Path(argv[argv.index(flag) + 1]))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_input_is_refused_in_one_line(case, fuzz_env, request, capsys):
    work = fuzz_env / "cases" / case.id
    work.mkdir(parents=True)
    run = copy_run(request.getfixturevalue("finished_run"), work / "run") if case.needs_run else None
    argv = case.build(work, run)
    before = {rel: _digest(work / rel) for rel in case.untouched}
    outputs = [p for p in _outputs(argv) if not p.exists()]
    capsys.readouterr()
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(case.timeout)
    t0 = time.time()
    try:
        try:
            rc = main(argv)
        except SystemExit as exc:  # argparse
            rc = exc.code
    except _Hang:
        pytest.fail(f"no answer within {case.timeout} s: {argv}")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    elapsed = time.time() - t0
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "Traceback" not in out
    if case.expect == "bounded" and rc == 0:
        assert out.strip(), "an answer must be printed"
        assert elapsed < case.timeout
        return
    assert rc == 2, f"exit {rc} for {argv}\nstdout: {out[-500:]}\nstderr: {err[-500:]}"
    errors = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(errors) == 1, err
    line = errors[0]
    assert line.startswith("userdp"), line
    assert len(line) > len("userdp: error: ") + 10  # says something
    if case.category == "accounting numbers":
        flag = case.id.split("-", 1)[1].split("=")[0]
        assert f"--{flag}" in line, line
    if case.category == "damaged data files" and argv[:2] == ["data", "stats"] and Path(argv[2]).suffix:
        assert Path(argv[2]).name in line or "--" in line, line  # the file, or the option at fault
    for needle in case.must_contain:  # the line names what is wrong
        assert needle in line, (needle, line)
    for rel, digest in before.items():
        assert _digest(work / rel) == digest, f"{rel} was changed"
    for p in outputs:  # nothing half-written left behind
        assert not p.exists() or (p.is_dir() and not any(p.iterdir())), f"{p} left behind"
