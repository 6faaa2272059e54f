"""`userdp train --nproc N`'s launcher when the job breaks: a process count the machine cannot hold
is refused before anything starts (it hung), a signal or Ctrl-C to the launcher ends with 130 and
the resume command (it said "the job could not start"), and a lost rank that wrote no line ends
with 2 and the resume command (it ended rc 1)."""

import os
import subprocess
import sys
import types

import pytest

from userdp import launcher
from userdp.cli import main as cli
from userdp.errors import ERROR_DIR_ENV, UserError


def test_more_cpu_processes_than_the_machine_holds_are_refused_before_any_starts(monkeypatch, capsys):
    monkeypatch.setattr(launcher.os, "cpu_count", lambda: 2)
    launcher.check_cpu_processes(2)
    with pytest.raises(UserError, match="--nproc 100000: this machine has 2 CPU core"):
        launcher.check_cpu_processes(100000)
    started = []
    monkeypatch.setattr(launcher, "elastic_launch", lambda *a, **k: started.append(1))
    assert cli(["train", "--nproc", "100000", "--set", "model.device=cpu", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--nproc 100000" in err[0] and started == []


def test_too_little_free_memory_for_the_processes_is_refused(monkeypatch):
    monkeypatch.setattr(launcher.os, "cpu_count", lambda: 64)
    monkeypatch.setattr(launcher.psutil, "virtual_memory", lambda: types.SimpleNamespace(available=2 * 2**30))
    with pytest.raises(UserError, match="2.0 GB of memory is free.*start at most 4"):
        launcher.check_cpu_processes(16)


@pytest.mark.parametrize("signal_kind", ["ctrl-c", "sigterm"])
def test_a_signal_to_the_launcher_ends_with_130_and_the_resume_command(monkeypatch, capsys, signal_kind):
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def stopped(*a, **k):
        def run(*argv):
            if signal_kind == "ctrl-c":
                raise KeyboardInterrupt
            raise SignalException("got SIGTERM", sigval=15)

        return run

    monkeypatch.setattr(launcher, "elastic_launch", stopped)
    rc = launcher.launch(["train", "c.yaml", "--output", "runs/two"], nproc=2)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 130 and len(err) == 1
    assert "userdp train --resume runs/two --nproc N" in err[0] and "could not start" not in err[0]
    assert ("interrupted (Ctrl-C)" if signal_kind == "ctrl-c" else "stopped by a signal") in err[0]


def test_a_lost_rank_that_wrote_no_line_ends_with_2_and_the_resume_command(tmp_path, capsys):
    failures = {1: types.SimpleNamespace(exitcode=-9)}
    rc = launcher._one_line(tmp_path, failures, ["train", "c.yaml", "--resume=runs/x"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert "rank 1 was lost (exit status -9" in err[0] and "userdp train --resume runs/x" in err[0]


WORKER_AFTER_ITS_LINE = r"""
import atexit, os, sys
from userdp.errors import say

def noisy_shutdown():
    raise RuntimeError("noise from a process group torn down at exit")

atexit.register(noisy_shutdown)
print("a progress line before the failure", file=sys.stderr, flush=True)
say("userdp: error: the worker's one line", 2)
os.write(2, b"[W ProcessGroupGloo.cpp:123] C++ warning as a peer goes\nframe #0: c10::Error::Error\n")
print("Traceback (most recent call last): a Python traceback after the line", file=sys.stderr)
raise SystemExit(2)
"""


@pytest.mark.parametrize("launched", [True, False])
def test_a_worker_prints_nothing_after_it_hands_its_line_to_the_launcher(tmp_path, launched):
    """Whatever a worker's shutdown prints after its line is handed over (C++ stacks and warnings
    from torch.distributed, "Exception ignored in atexit") would reach the user before the job's
    one line: it goes nowhere. A process that is not a launcher's worker keeps its stderr."""
    env = {k: v for k, v in os.environ.items() if k != ERROR_DIR_ENV}
    if launched:
        env[ERROR_DIR_ENV], env["RANK"] = str(tmp_path), "1"
    out = subprocess.run(
        [sys.executable, "-c", WORKER_AFTER_ITS_LINE], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2
    assert "a progress line before the failure" in out.stderr  # what came before the line is kept
    if launched:
        assert (tmp_path / "rank1.err").read_text() == "2\nuserdp: error: the worker's one line\n"
        assert out.stderr.strip() == "a progress line before the failure", out.stderr
    else:
        assert "userdp: error: the worker's one line" in out.stderr
        assert "C++ warning" in out.stderr and "Exception ignored in atexit" in out.stderr
