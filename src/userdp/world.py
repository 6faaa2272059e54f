"""The processes of one job: a single process, or the W processes ``torchrun`` launches.

``torchrun --standalone --nproc_per_node=W -m userdp train CONFIG`` starts W copies of the
command with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and a rendezvous in the environment;
:func:`init_world` joins them into one ``torch.distributed`` job (NCCL when the processes
compute on GPUs, gloo on CPUs), gives each its device (``cuda:LOCAL_RANK``), and returns the
:class:`World` the job consults for who does what (docs/scaling.md):

* **one writer** — rank 0 alone writes the run directory, the ledger journal, checkpoints and
  reports, and logs;
* **rank 0 first** — work whose result is cached on disk (the user store, the tokenizer, public
  pretraining, tokenization, the plan) runs on rank 0 while the others wait, then the others
  read the cache (:meth:`World.main_first`); a failure on rank 0 is reported to them at once;
* **the training step** — split by units, combined by
  :class:`~userdp.engine.distributed.processes.TorchDistributedCombiner`.

A dead process ends the job: torchrun stops the others (SIGTERM, which :func:`init_world` turns
into :class:`JobStopped`), and a collective whose peer is gone fails at once (or after the
``timeout`` for a peer that hangs), raising :class:`PeerLost` from :func:`translate`.
"""

from __future__ import annotations

import datetime
import os
import re
import signal
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from userdp.errors import UserError

#: seconds a collective waits for a peer before the job fails (``userdp train --dist-timeout``)
DEFAULT_TIMEOUT_S = 1800.0
#: how long the other ranks wait for rank 0's preparation (store, tokenizer, pretraining, plan)
PREPARE_TIMEOUT_S = 7 * 24 * 3600.0


class JobStopped(BaseException):
    """This process was told to stop (SIGTERM: torchrun stops every process when one fails)."""


class PeerLost(Exception):
    """A collective failed: another process of the job died, hung or was stopped."""


def launched() -> bool:
    """Whether this process is one of several launched by torchrun (``WORLD_SIZE`` > 1)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        return False


@dataclass
class World:
    """Who this process is in the job. The defaults are a one-process job.

    Attributes:
        rank, world_size, local_rank: torchrun's ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``.
        backend: ``nccl`` or ``gloo`` (None for one process).
        device_spec: what ``model.device`` should resolve to in this process (``cuda:LOCAL_RANK``
            under NCCL, ``cpu`` under gloo; None: the config's own value).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None
    device_spec: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    run_dir: str | None = None  # set by the job once known (for the messages of a failed job)
    _objects: Any = None  # a gloo group with a long timeout, for Python objects and the preparation

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` (picklable), on every rank."""
        if not self.distributed:
            return obj

        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self._objects)
        return box[0]

    @contextmanager
    def main_first(self, what: str):
        """Run the block on rank 0, then on the other ranks (which then find rank 0's cache).

        Raises (on the other ranks):
            UserError: rank 0 failed in the block (its own message says why).
        """
        if not self.distributed:
            yield
            return
        if self.is_main:
            try:
                yield
            except BaseException as exc:
                self.broadcast_object(f"{type(exc).__name__}: {exc}".splitlines()[0][:300])
                raise
            self.broadcast_object("ok")
        else:
            status = self.broadcast_object(None)
            if status != "ok":
                raise UserError(f"rank {self.rank}: rank 0 failed while {what} ({status}); its message says why")
            yield

    def close(self) -> None:
        """Leave the process group (no-op for one process)."""
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()


def init_world(device: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S) -> World:
    """Join torchrun's job, or describe a one-process job when not launched by torchrun.

    Args:
        device: the config's ``model.device`` (``auto | cpu | cuda | cuda:i``): under torchrun
            ``auto`` and ``cuda`` mean ``cuda:LOCAL_RANK`` (NCCL) when CUDA is available, and
            ``cpu`` (or ``auto`` without CUDA) means gloo; ``cuda:i`` names one GPU for W
            processes and is refused.
        timeout_s: how long a collective waits for a peer before the job fails.

    Raises:
        UserError: a torchrun environment that is incomplete, a device that cannot be shared
            out, more processes on a node than it has GPUs, or a rendezvous that fails.
    """
    if not launched():
        return World(timeout_s=timeout_s)
    try:
        rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    except (KeyError, ValueError):
        raise UserError(
            "WORLD_SIZE > 1 but RANK or LOCAL_RANK is missing or not an integer: launch with "
            "torchrun (e.g. torchrun --standalone --nproc_per_node=2 -m userdp train CONFIG)"
        ) from None
    if not timeout_s > 0:
        raise UserError(f"--dist-timeout must be > 0 seconds (got {timeout_s})")

    cuda = shared_device(device, f"torchrun started {world} processes")
    if cuda:
        if local >= torch.cuda.device_count():
            raise UserError(
                f"LOCAL_RANK {local}: this node has {torch.cuda.device_count()} CUDA device(s); start "
                "at most that many processes per node (--nproc_per_node)"
            )
        torch.cuda.set_device(local)
    backend = "nccl" if cuda else "gloo"
    timeout = datetime.timedelta(seconds=float(timeout_s))
    try:
        kw = {"device_id": torch.device("cuda", local)} if cuda else {}
        dist.init_process_group(backend, timeout=timeout, **kw)
        objects = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=PREPARE_TIMEOUT_S))
    except (RuntimeError, ValueError) as exc:
        raise UserError(f"rank {rank}: could not join the job ({backend}): {str(exc).splitlines()[0][:200]}") from None
    _stop_on_sigterm()
    return World(
        rank=rank,
        world_size=world,
        local_rank=local,
        backend=backend,
        device_spec=f"cuda:{local}" if cuda else "cpu",
        timeout_s=float(timeout_s),
        _objects=objects,
    )


def shared_device(device: str, started: str) -> bool:
    """Whether the processes of a job compute on CUDA (each on ``cuda:LOCAL_RANK``) for
    ``model.device``, checked where the job's processes are known (``started`` says how many
    there are, for the message): by :func:`init_world` in each process, and by ``userdp train
    --nproc`` before any starts.

    Raises:
        UserError: ``cuda:i`` (one GPU for several processes), or ``cuda`` without a CUDA device."""

    spec = str(device).strip().lower()
    if spec.startswith("cuda:"):
        raise UserError(
            f"model.device {spec} names one GPU, but {started}: give cuda or auto (each process then "
            "uses cuda:LOCAL_RANK)"
        )
    cuda = spec in ("auto", "cuda") and torch.cuda.is_available()
    if spec == "cuda" and not cuda:
        raise UserError("model.device cuda was asked for but torch sees no CUDA device: use auto or cpu")
    return cuda


def _stop_on_sigterm() -> None:
    """SIGTERM (torchrun stopping the job) raises :class:`JobStopped` in the main thread, so files
    are closed and the process says why it stops (checkpoint and journal writes are atomic)."""

    def handler(signum, frame):
        raise JobStopped("stopped by SIGTERM (torchrun stops every process of the job when one fails)")

    signal.signal(signal.SIGTERM, handler)


def translate(exc: BaseException) -> PeerLost | None:
    """A :class:`PeerLost` for an exception that means a peer failed (a torch.distributed error,
    or gloo's transport errors, which torch raises as RuntimeError), else None."""
    text = str(exc)
    if not (isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and ("gloo" in text or "NCCL" in text))):
        return None
    first = text.splitlines()[0] if text else type(exc).__name__
    reason = re.sub(r"^\[[^\]]*\]\s*", "", first).split(". This is typically")[0]  # gloo: "[file:line] why"
    return PeerLost(f"lost contact with another process of the job ({reason[:200]})")
