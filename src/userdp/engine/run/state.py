"""A run's checkpoint: what is saved of an :class:`~userdp.engine.run.step.EngineRun` (never an unseeded
run's random state), how it is restored, and how a seeded run resumed after steps it began is keyed
anew; and the keys a run starts from (:func:`seeds`)."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import torch

from userdp.engine import checkpoint as ckpt
from userdp.engine.algorithms import UnitTable
from userdp.engine.distributed.distribution import read_params
from userdp.engine.noise.gaussian import ENTROPY_BITS, os_entropy, source_for
from userdp.engine.plan import config_difference, held_performance, privacy_repr
from userdp.errors import UserError

POOL = ENTROPY_BITS // 32


#: the data key's streams (``SeedSequence(data_key, spawn_key=(TAG, ...))``), one per use, none
#: shared: a unit's record draw at a step, the one-time contribution bounding (ELS's D'), and the
#: cohort of a step. Tags 0-3 are the seed's own children (the noise key of a seeded run is child 2).
UNIT_DRAWS, BOUNDING, COHORT = 1, 4, 5


def seeds(seed: int | None, combiner, device="cpu"):
    """(data key, noise source or None, torch seed or None).

    Unseeded: 256 bits of OS entropy drawn on the main rank and broadcast, so that every rank
    samples the same cohort (the sampling must stay secret: a predictable cohort loses the
    amplification the accountant assumes); the noise source is keyed by a separate 256 bits of
    OS entropy on the main rank only (the noise is drawn there, once per step). Seeded: all of
    them derive from the seed, reproducibly. The data key (which records a sampled user's
    unit draws) is the same on every rank: see :meth:`userdp.engine.run.cohort.Chunks.unit_rng`.
    """
    if seed is None:
        words = torch.tensor(np.frombuffer(os.urandom(ENTROPY_BITS // 8), dtype=np.int64).copy())
        if combiner.world_size > 1:
            words = combiner.broadcast_from_main([words])[0].cpu()
        material = int.from_bytes(words.numpy().tobytes(), "little")
        noise = source_for(device, os_entropy(), seeded=False) if combiner.rank == 0 else None
        torch_seed = None
    else:
        material = int(seed)
    root = np.random.SeedSequence(material, pool_size=POOL)
    _a, _b, c, d = root.spawn(4)
    if seed is not None:
        noise = source_for(device, int.from_bytes(c.generate_state(8, np.uint32).tobytes(), "little"), seeded=True)
        torch_seed = int(d.generate_state(1, np.uint64)[0] >> 1)
    return material, noise, torch_seed


def fresh_sampler_state(run) -> dict:
    """The sampler's state at the start of a run (a cyclic sampler's groups: a keyed hash of each
    unit's user id, from the data, never saved)."""
    initial = getattr(run.sampler, "initial_state", None)
    if initial is None:
        return {}
    keys = run.data.user_keys()
    return initial([keys[int(u)] for u in run.table.users], run.plan.cycle)


def checkpoint_state(run) -> tuple[dict, dict]:
    """(the checkpoint's state, the parts each rank writes, by name). Where the distribution splits
    the model (``every_rank_writes``), its weights and
    per-parameter optimizer states are not in the state (``params`` None, each such state
    :data:`userdp.engine.checkpoint.IN_SHARDS`) but in the shards (``param/NAME``,
    ``optim/INDEX/KEY``: each rank's, for ``torch.distributed.checkpoint``); ``{}`` when the model is whole."""
    optimizer, shards = run.distribution.split_state(run, run.optimizer.state_dict())
    st = {
        "step": run.step,
        "ledger": run.ledger.state_dict(),
        "params": None if shards else [p.detach().cpu() for p in run.master],
        "param_names": run.per_unit.names,
        "buffers": {n: b.detach().cpu() for n, b in run.model.named_buffers()},
        "optimizer": optimizer,
        "clip_state": dict(run.clip_state),
        "table_users": torch.from_numpy(run.table.users),
        "table_records": torch.from_numpy(run.table.records) if run.table.records is not None else None,
        "seeded": run.seeded,
        "config": privacy_repr(run.cfg),
        "history": run.history,
        "nonfinite_units": run.nonfinite_units,
    }
    if run.seeded:  # unseeded random states are secret: never written
        st["noise"] = run.distribution.noise_state(run)  # every rank calls it (each may hold part)
        st["torch_rng"] = torch.get_rng_state()
        perm = run.sampler_state.get("perm")
        st["sampler"] = {
            "epoch": run.sampler_state.get("epoch"),
            "perm": torch.from_numpy(perm) if perm is not None else None,
        }
    return st, shards


def _held(run) -> list:
    return [p for g in run.optimizer.param_groups for p in g["params"]]


def save(run, extra=None):
    """Write the checkpoint (and the caller's ``extra`` files, committed with it as one unit).
    Where every rank writes (``every_rank_writes``), the ranks each write their parts first (a
    collective: every rank calls this), then rank 0 commits them with the rest."""
    if not run.dir:
        return
    main = run.combiner.rank == 0
    if not (main or run.distribution.every_rank_writes):
        return
    st, tensors = checkpoint_state(run)
    shards = run.distribution.save_shards(run, st, tensors)  # every rank its own, then one commit
    if main:  # one writer
        ckpt.save(run.dir, st, extra(run) if extra is not None else None, shards=shards)


def restore(run, st: dict):
    saved, here = st["config"], privacy_repr(run.cfg)
    if saved != here and held_performance(saved):
        raise UserError(
            f"cannot resume from {ckpt.path(run.dir)}: it was written by userdp 0.9 or earlier, whose "
            "TrainConfig held the performance settings (now a Performance beside it, outside what the "
            "journal is bound to); resume it with the version that wrote it, or start a new run"
        )
    if saved != here:
        raise UserError(
            f"cannot resume from {ckpt.path(run.dir)}: it was written with a different config "
            f"({config_difference(saved, here)}; only performance "
            "settings may change: chunk size, per-unit strategy, precision, checkpoint cadence)"
        )
    if st["param_names"] != run.per_unit.names:
        raise UserError(f"cannot resume from {ckpt.path(run.dir)}: the model's trainable parameters differ")
    held = _held(run)
    optimizer = read_params(run, st, held)  # into this run's layout, whatever layout wrote it
    with torch.no_grad():
        for p, m in zip(run.params, run.master, strict=True):
            if m is not p:
                p.copy_(m)
        bufs = dict(run.model.named_buffers())
        for n, v in st["buffers"].items():
            bufs[n].copy_(v.to(bufs[n].device))
    run.optimizer.load_state_dict(optimizer)
    run.clip_state = dict(st["clip_state"])
    users = st["table_users"].numpy()
    recs = st["table_records"].numpy() if st["table_records"] is not None else None
    run.table = UnitTable(users, recs, run.table.weights)
    run.step = int(st["step"])
    run.history = list(st["history"])
    run.nonfinite_units = int(st.get("nonfinite_units", 0))
    if st["seeded"]:
        if "data_rng" in st:  # per-rank record draws (userdp 0.1): that stream cannot be continued
            raise UserError(
                f"cannot resume from {ckpt.path(run.dir)}: a seeded checkpoint of an older userdp "
                "(its record draws used another generator); start the seeded run again"
            )
        run.distribution.load_noise_state(run, st.get("noise") or {})
        torch.set_rng_state(st["torch_rng"])
        s = st["sampler"]
        if s["epoch"] is not None:
            run.sampler_state = {**run.sampler_state, "epoch": s["epoch"], "perm": s["perm"].numpy()}
    before = int(st["ledger"]["spent"])
    # steps begun after the checkpoint are counted as spent, never replayed under the same noise
    # (a replay is not the same release: the caller's loop state, the data or the device's
    # accumulation order may differ, and two releases under one noise draw cancel it)
    run.ledger.load_state_dict(st["ledger"], replayable=False)
    run.restored_spent = before  # start_run keys a seeded run anew if steps were begun after it


def rekey(run, begun: int) -> None:
    """A seeded run resumed after steps it began but did not checkpoint: every generator (cohort,
    records, noise, torch) is keyed anew from the seed and the count of steps begun, so no (key,
    counter) pair of the noise — and no cohort draw — is used twice, and the run stays
    reproducible from its seed and its journal."""
    material = int.from_bytes(
        hashlib.sha256(f"{int(run.cfg.seed)}:resume:{int(begun)}".encode()).digest()[:16], "little"
    )
    run.chunks.data_key, source, torch_seed = seeds(material, run.combiner, run.device)
    run.noise = run.plan.make_noise(source)
    run.noise_state = run.distribution.noise_init(run)  # a fresh stream: the past vectors were of the old key
    torch.manual_seed(torch_seed)
    run.sampler_state = fresh_sampler_state(run)
    run.rekeyed_at = int(begun)
