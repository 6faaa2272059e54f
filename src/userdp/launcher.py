"""``userdp train --nproc N``: userdp's own launcher of a several-process job, on the API of
``torch.distributed.run`` (``torch.distributed.launcher.api.elastic_launch``), so that a bad input
under several processes ends as it does under one: one line, exit status 2.

What it adds to plain ``torchrun ... -m userdp train``:

* **checks before any process starts** (:func:`precheck`): the config, its paths (data, public
  text, model folder, plan file), the device against the process count, options that run in one
  process only (``audit.canaries``). A refusal here starts nothing.
* **the job's one line**: each worker writes its one-line error to a file of the launch (not to
  the terminal, where W copies of it and torchrun's failure summary would follow); when the job
  fails the launcher prints the line of the rank that failed first in rank order — rank 0's where
  it failed — and exits with that rank's status (2 for bad input). Another rank stopped *because*
  rank 0 failed says nothing more.
* **no ``-m userdp``**: the workers run ``python -m userdp train`` with the same arguments.

Plain ``torchrun`` keeps working (docs/scaling.md says what each form gives); its own failure
summary then follows the workers' lines.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import uuid
from pathlib import Path

import psutil
import torch
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from userdp.errors import ERROR_DIR_ENV, UserError
from userdp.fileio import read_input
from userdp.lm.config import check_sharding
from userdp.world import shared_device


def precheck(cfg, nproc: int, plan: str | None) -> None:
    """What can be refused before any process starts: paths the config names, the device for
    ``nproc`` processes, and options that run in one process only.

    Raises:
        UserError: the first of them that is wrong."""
    if cfg.audit.canaries:
        raise UserError(
            "audit.canaries: the empirical audit runs in one process only (its canaries and secrets "
            "file are not shared out yet); drop --nproc, or set audit.canaries: 0"
        )
    for key, value in (
        ("data.path", getattr(cfg.data, "path", None)),
        ("data.public_path", getattr(cfg.data, "public_path", None)),
        ("model.path", getattr(cfg.model, "path", None)),
    ):
        if value and not str(value).startswith("hf:") and value != "shakespeare" and not Path(value).exists():
            raise UserError(f"{key} {value}: does not exist")
    if plan:
        read_input(plan, f"--plan {plan}")
    check_sharding(cfg, distributed=True)

    if (
        shared_device(cfg.model.device, f"--nproc {nproc} starts {nproc} processes")
        and nproc > torch.cuda.device_count()
    ):
        raise UserError(
            f"--nproc {nproc}: this machine has {torch.cuda.device_count()} CUDA device(s); start at "
            "most that many processes (or set model.device: cpu)"
        )
    check_cpu_processes(nproc)


#: the most CPU processes per core a job may start (each holds torch and its share of the model)
PROCESSES_PER_CORE = 4
#: the host memory a CPU process needs at least (torch, the model, its chunk), for the up-front check
PROCESS_MEMORY_GB = 0.5


def check_cpu_processes(nproc: int) -> None:
    """A CPU job of more processes than the machine can hold hung (``--nproc 100000`` on 2 cores):
    at most :data:`PROCESSES_PER_CORE` a core, and :data:`PROCESS_MEMORY_GB` of free memory each.

    Raises:
        UserError: naming --nproc and the machine's cores or memory."""
    cores = os.cpu_count() or 1
    if nproc > PROCESSES_PER_CORE * cores:
        raise UserError(
            f"--nproc {nproc}: this machine has {cores} CPU core(s); start at most "
            f"{PROCESSES_PER_CORE * cores} processes"
        )
    free_gb = psutil.virtual_memory().available / 2**30
    if nproc * PROCESS_MEMORY_GB > free_gb:
        raise UserError(
            f"--nproc {nproc}: {free_gb:.1f} GB of memory is free, less than the {PROCESS_MEMORY_GB:g} GB "
            f"each process needs at least; start at most {max(1, int(free_gb / PROCESS_MEMORY_GB))}"
        )


def launch(
    worker_argv: list[str],
    *,
    nproc: int,
    nnodes: str = "1",
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    timeout_s: int = 900,
) -> int:
    """Run ``python -m userdp <worker_argv>`` in ``nproc`` processes (per node) as one job;
    returns the job's exit status, having printed at most one line for a failed job.

    Raises:
        UserError: ``--nnodes`` / ``--rdzv-endpoint`` malformed."""

    lo, _, hi = str(nnodes).partition(":")
    try:
        min_nodes, max_nodes = int(lo), int(hi or lo)
    except ValueError:
        raise UserError(f"--nnodes {nnodes}: give N or MIN:MAX (integers)") from None
    if not 1 <= min_nodes <= max_nodes:
        raise UserError(f"--nnodes {nnodes}: need 1 <= MIN <= MAX")
    if max_nodes > 1 and not rdzv_endpoint:
        raise UserError("--nnodes above 1 needs --rdzv-endpoint HOST:PORT (the same on every node)")
    for name in ("torch.distributed.elastic", "torch.distributed.launcher", "torch.distributed.run"):
        logging.getLogger(name).setLevel(logging.CRITICAL)  # the job's outcome is our one line
    errors = Path(tempfile.mkdtemp(prefix="userdp-launch-"))
    os.environ[ERROR_DIR_ENV] = str(errors)
    config = LaunchConfig(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=nproc,
        run_id=f"userdp-{uuid.uuid4().hex[:12]}" if max_nodes == 1 else "userdp",
        rdzv_backend="c10d",
        rdzv_endpoint=rdzv_endpoint or "localhost:0",
        rdzv_configs={"rank": node_rank} if max_nodes > 1 else {},
        rdzv_timeout=timeout_s,
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
    )
    try:
        elastic_launch(config, sys.executable)("-m", "userdp", *worker_argv)
        return 0
    except ChildFailedError as exc:
        return _one_line(errors, exc.failures, worker_argv)
    except (KeyboardInterrupt, SignalException) as exc:  # Ctrl-C or a signal to the launcher: the workers stop too
        how = (
            "interrupted (Ctrl-C)"
            if isinstance(exc, KeyboardInterrupt) or getattr(exc, "sigval", None) == 2
            else f"stopped by a signal ({getattr(exc, 'sigval', exc)})"
        )
        print(
            f"userdp: {how}: the job's processes were stopped; the last checkpoint and the ledger journal are kept "
            f"(every step begun is counted): {_resume_hint(worker_argv)}",
            file=sys.stderr,
        )
        return 130
    except Exception as exc:  # noqa: BLE001 - the rendezvous or the agent itself failed
        print(
            f"userdp: error: the job could not start ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})",
            file=sys.stderr,
        )
        return 2
    finally:
        os.environ.pop(ERROR_DIR_ENV, None)
        for f in errors.glob("*"):
            f.unlink()
        errors.rmdir()


def _resume_hint(worker_argv: list[str], nproc_word: str = "--nproc N") -> str:
    """How to continue the job: its run directory's resume command (the folder given with --output
    or --resume; otherwise the one the job printed when it started)."""
    run = None
    for i, a in enumerate(worker_argv):
        for opt in ("--output", "--resume"):
            if a == opt and i + 1 < len(worker_argv):
                run = worker_argv[i + 1]
            elif a.startswith(opt + "="):
                run = a.split("=", 1)[1]
    where = run or "RUN_DIR (the run directory the job printed)"
    return f"continue with: userdp train --resume {where} {nproc_word}"


def _one_line(errors: Path, failures: dict, worker_argv: list[str] = ()) -> int:
    """Print the failed job's one line — a bad input's (status 2) before another rank's report
    that it lost its peers, the lowest rank first — and return that rank's exit status; where no
    rank wrote a line (a crash), name the lowest failed rank."""
    written = {}
    for f in errors.glob("rank*.err"):
        status, _, line = f.read_text(encoding="utf-8").partition("\n")
        written[int(f.stem[4:])] = (int(status), line.strip())
    if written:
        rank = min(written, key=lambda r: (written[r][0] != 2, r))
        status, line = written[rank]
        print(line, file=sys.stderr)
        return status
    # no rank wrote a line: a rank was lost (killed, out of memory, a crash); the job ends as a
    # stopped job does, with how to continue it (every step begun is counted on resume)
    rank = min(failures) if failures else 0
    code = failures[rank].exitcode if failures else 1
    print(
        f"userdp: error: the process of rank {rank} was lost (exit status {code}; its output above says why); "
        f"the last checkpoint and the ledger journal are kept: {_resume_hint(list(worker_argv))}",
        file=sys.stderr,
    )
    return 2
