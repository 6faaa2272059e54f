"""Shared tiny models and data for the engine tests."""

import contextlib
import dataclasses
import os
import signal
import socket
import threading

import numpy as np
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from userdp.engine import Performance, TensorUserData, TrainConfig
from userdp.engine.performance import PERFORMANCE_FIELDS


def train_config(**kw) -> TrainConfig:
    """A TrainConfig from flat keywords, as the tests' tables write them: the performance ones
    (chunk_size, per_unit, precision, sharding, checkpoint_every, track_epsilon) go into its
    Performance, over ``performance`` if that is given too (``{**cfg.__dict__, "chunk_size": 8}``)."""
    perf = {k: kw.pop(k) for k in PERFORMANCE_FIELDS if k in kw}
    base = kw.pop("performance", Performance())
    return TrainConfig(**kw, performance=dataclasses.replace(base, **perf))


class Mean(nn.Module):
    """theta in R^d; loss 1/2 ||theta - x||^2 (the mean-estimation task)."""

    def __init__(self, d, init=None):
        super().__init__()
        self.theta = nn.Parameter(torch.zeros(d) if init is None else init.clone())


def sq_loss(model, batch):
    return 0.5 * ((model.theta - batch["x"]) ** 2).sum(-1)


def linear_loss(model, batch):
    """Gradient of one record = -x: lets a test choose every per-record gradient."""
    return -(model.theta * batch["x"]).sum(-1)


class MLP(nn.Module):
    def __init__(self, d_in=6, h=8, d_out=3):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, h), nn.Tanh(), nn.LayerNorm(h), nn.Linear(h, d_out))

    def forward(self, x):
        return self.net(x)


def ce_loss(model, batch):
    logits = model(batch["x"])
    return nn.functional.cross_entropy(logits, batch["y"], reduction="none")


def user_data(sizes, d=3, seed=0, scale=1.0, shift=0.0):
    rng = np.random.default_rng(seed)
    sizes = np.asarray(sizes)
    x = torch.from_numpy(rng.normal(shift, scale, (int(sizes.sum()), d))).float()
    return TensorUserData({"x": x}, np.concatenate([[0], np.cumsum(sizes)]))


def mlp_data(sizes, d=6, k=3, seed=0):
    rng = np.random.default_rng(seed)
    n = int(np.sum(sizes))
    x = torch.from_numpy(rng.normal(size=(n, d))).float()
    y = torch.from_numpy(rng.integers(0, k, n))
    return TensorUserData({"x": x, "y": y}, np.concatenate([[0], np.cumsum(sizes)]))


class ThreadCombiner:
    """An all-reduce between threads (what torch.distributed does between processes)."""

    def __init__(self, rank, world, shared):
        self.rank, self.world_size, self.s = rank, world, shared

    def _exchange(self, tensors):
        self.s["barrier"].wait()
        self.s["slots"][self.rank] = [t.clone() for t in tensors]
        self.s["barrier"].wait()
        got = [list(x) for x in self.s["slots"]]
        self.s["barrier"].wait()
        return got

    def all_reduce_sum(self, tensors):
        self.s["calls"][self.rank] += 1
        got = self._exchange(tensors)
        return [sum(g[i] for g in got) for i in range(len(tensors))]

    def broadcast_from_main(self, tensors):
        return self._exchange(tensors)[0]


def run_ranks(world, run_rank, expected=()):
    """Run ``run_rank(rank, combiner)`` on ``world`` threads; returns their results. Exceptions
    of the ``expected`` types end a rank quietly (a simulated crash); any other is raised here."""
    shared = {"barrier": threading.Barrier(world), "slots": [None] * world, "calls": [0] * world}
    results, errors = [None] * world, []

    def worker(r):
        try:
            results[r] = run_rank(r, ThreadCombiner(r, world, shared))
        except tuple(expected):
            pass
        except BaseException as e:  # surface it in the main thread
            errors.append(e)
            shared["barrier"].abort()

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return results, shared


def _gloo_worker(target, rank: int, port: int, queue) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    try:
        queue.put((rank, target(rank)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which stops the other rank
        import traceback

        queue.put((rank, _Failed(traceback.format_exc())))
    finally:
        dist.destroy_process_group()


class _Failed(str):
    """A rank's traceback (run_gloo_pair raises it)."""


#: what a gloo pair's ranks import, loaded once by the fork server (:func:`run_gloo_pair`)
GLOO_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.fsdp",
    "transformers.models.gpt2.modeling_gpt2",
    "userdp.engine",
    "userdp.lm.models",
    "_engine_helpers",
]


def run_gloo_pair(target, timeout: float = 240) -> dict:
    """``target(rank)`` in each of two spawned processes joined by a gloo process group (real
    processes: ranks simulated by threads would share torch's global generator); returns
    ``{rank: result}``. ``target`` must be a module-level function (it is pickled by name)."""
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # forkserver: each xdist worker starts one server that imports what the ranks need once (torch,
    # the engine, the LM models, FSDP2), and every pair is forked from it: a fresh process per rank,
    # as spawn gives, without ~6 s of imports a rank (the suite runs a dozen pairs)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(GLOO_PRELOAD)
    queue = ctx.Queue()
    procs = [ctx.Process(target=_gloo_worker, args=(target, r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in procs:
            rank, value = queue.get(timeout=timeout)
            if isinstance(value, _Failed):  # the other rank may wait in a collective: stop it
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(60 if len(results) == len(procs) else 1)
            if p.is_alive():
                p.kill()
    assert sorted(results) == [0, 1]
    return results


class Crash(Exception):
    """A crash a test's callback raises mid-run (:func:`crash_at`)."""


def crash_at(step: int):
    """A training callback that raises :class:`Crash` once step ``step`` is done (before its
    checkpoint: the step is begun, and lost unless a checkpoint follows)."""

    def cb(m):
        if m["step"] == step:
            raise Crash()

    return cb


def ctrl_c_at(step: int):
    """A training callback that presses Ctrl-C (SIGINT to this process) once, when step ``step`` is
    done: the engine's deferred handler lets that step finish and be saved, then the run stops."""
    fired = []

    def cb(m):
        if m["step"] == step and not fired:
            fired.append(True)
            os.kill(os.getpid(), signal.SIGINT)

    return cb


@contextlib.contextmanager
def sigint_raises():
    """Inside the block SIGINT raises KeyboardInterrupt (a known handler first: under a background
    shell SIGINT starts out ignored); the handler before it is restored after."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class WidestOutput(TorchDispatchMode):
    """Under the mode, ``widest``: the most elements of any op's output of one of ``dtypes`` (what a
    test holds a function to when it must not copy a wide factor into a wider dtype)."""

    def __init__(self, dtypes: tuple):
        super().__init__()
        self.dtypes, self.widest = dtypes, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dtype in self.dtypes:
            self.widest = max(self.widest, out.numel())
        return out


def bf16_lm_chunk(model, ids: torch.Tensor, clip=None, weights: torch.Tensor | None = None):
    """``(strategy, (sums, norms, losses, bad))``: one bf16 ghost ULS chunk of a causal LM over
    ``ids`` ``[m, G, L]`` (every record kept, G records a unit), the units weighted ``weights`` (1
    each by default), clipped by ``clip`` (FlatClip(1.0)) at its initial state, sums in float32."""
    from userdp.engine import ULS, FlatClip
    from userdp.engine.clipping import StepClipping
    from userdp.engine.ghost import GhostPerUnit
    from userdp.engine.precision import Precision
    from userdp.lm.models import causal_lm_loss

    m, g, _ = ids.shape
    clip = clip or FlatClip(1.0)
    st = GhostPerUnit(model, causal_lm_loss, ULS(group_size=g, sampling_rate=0.5), Precision("bfloat16"))
    w = torch.ones(m, device=ids.device) if weights is None else weights
    out = st.clipped_sum(
        {"input_ids": ids, "labels": ids.clone()},
        torch.ones(m, g, device=ids.device),
        w,
        StepClipping(clip, clip.initial_state(), torch.float32),
    )
    return st, out
