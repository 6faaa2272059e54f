"""Scale-out design (issue 4 item 11): ranks that split the units of each step and all-reduce
the clipped sum give the same model as one process — the noise is drawn once per step for the
whole sum (not once per shard, which would make it sqrt(world) times larger).

Two ranks are simulated with threads and an in-memory all-reduce (a process spawn costs more
than the test budget); the real ``torch.distributed`` combiner runs on a one-process gloo group.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from userdp.engine import SGD, ULS, FlatClip, RunOptions, TrainConfig, train
from userdp.engine.distributed.processes import TorchDistributedCombiner
from userdp.engine.performance import Performance

from _engine_helpers import Mean, sq_loss, user_data
from _engine_helpers import run_ranks as _run_ranks

SIZES = [3, 1, 5, 2, 8, 4, 6, 7] * 3


def _cfg():
    # G >= every user's size: each unit's records are all of the user's, so the split is exact
    return TrainConfig(
        algorithm=ULS(8, 0.5),
        steps=4,
        clipping=FlatClip(0.5),
        optimizer=SGD(0.5),
        noise_multiplier=1.3,
        delta=1e-5,
        seed=17,
        accountant="rdp",
        performance=Performance(chunk_size=4, track_epsilon=False),
    )


def test_two_ranks_equal_one():
    world = 2
    models = [Mean(64) for _ in range(world)]
    results, shared = _run_ranks(
        world,
        lambda r, comb: train(models[r], user_data(SIZES, d=64, seed=2), sq_loss, _cfg(), RunOptions(combiner=comb)),
    )
    single = Mean(64)
    ref = train(single, user_data(SIZES, d=64, seed=2), sq_loss, _cfg())
    assert shared["calls"] == [8, 8]  # two all-reduces per step: the statistics, then the noised clipped sum
    for r in range(world):
        assert [h["units"] for h in results[r].history] == [h["units"] for h in ref.history]
        assert torch.allclose(models[r].theta, single.theta, atol=1e-6)


def test_torch_distributed_combiner_on_a_gloo_group(tmp_path):
    if not dist.is_available():
        pytest.skip("torch.distributed unavailable")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        c = TorchDistributedCombiner()
        a, b = torch.randn(3, 2), torch.tensor([1.0, 2.0], dtype=torch.float64)
        out = c.all_reduce_sum([a, b])
        assert out[0].dtype == torch.float32 and out[1].dtype == torch.float64
        assert torch.equal(out[0], a) and torch.equal(out[1], b)
        m1, m2 = Mean(64), Mean(64)
        train(m1, user_data(SIZES, d=64, seed=2), sq_loss, _cfg(), RunOptions(combiner=c))
        train(m2, user_data(SIZES, d=64, seed=2), sq_loss, _cfg())
        assert torch.equal(m1.theta, m2.theta)
    finally:
        dist.destroy_process_group()


def test_one_writer_and_a_shared_count_after_a_crash(tmp_path):
    """Only rank 0 keeps the hash-chained journal and writes checkpoints; after a crash before
    the first checkpoint every rank resumes with the main rank's count of steps begun."""
    world = 2
    dirs = [tmp_path / "r0", tmp_path / "r1"]  # each rank is given its own folder: rank 1's must stay empty
    unseeded = TrainConfig(
        algorithm=ULS(8, 0.5),
        steps=4,
        clipping=FlatClip(0.5),
        optimizer=SGD(0.5),
        noise_multiplier=1.3,
        delta=1e-5,
        accountant="rdp",
        performance=Performance(chunk_size=4, track_epsilon=False),
    )

    def run_all(resume, crash_at=None):
        def crash(m):
            if crash_at is not None and m["step"] == crash_at:
                raise KeyError("crash")

        return _run_ranks(
            world,
            lambda r, comb: train(
                Mean(64),
                user_data(SIZES, d=64, seed=2),
                sq_loss,
                unseeded,
                RunOptions(combiner=comb, checkpoint_dir=str(dirs[r]), resume=resume, callbacks=[crash]),
            ),
            expected=(KeyError,),
        )[0]

    run_all(resume=False, crash_at=2)
    assert (dirs[0] / "ledger_journal.jsonl").is_file()
    assert not dirs[1].exists() or not any(dirs[1].iterdir())
    res = run_all(resume=True)
    for r in range(world):  # 2 begun before the crash (unseeded: spent) + 4 now, on every rank
        assert res[r].record["steps_accounted"] == 6 and res[r].record["steps_lost_to_crashes"] == 2


def test_ranks_that_number_the_same_people_differently_are_refused_before_any_step():
    """Two processes whose data have the same sizes but number two users the other way round (ids
    pseudonymised by Python's per-process salted hash() do this) would put one person into both
    processes' shares of a step: its share of the sum would be up to 2C while the run certifies C.
    The processes compare a fingerprint of which user is which, and refuse in one line."""
    import threading

    import numpy as np

    from userdp.engine import TensorUserData
    from userdp.errors import UserError

    def data(swapped: bool):
        d = user_data(SIZES, d=64, seed=2)
        if not swapped:
            return d
        order = list(range(len(SIZES)))
        order[0], order[8] = 8, 0  # two users with 3 records each: the sizes stay the same
        rows = np.concatenate([np.arange(d.offsets[u], d.offsets[u + 1]) for u in order])
        return TensorUserData({"x": d.tensors["x"][torch.from_numpy(rows)]}, d.offsets)

    assert np.array_equal(data(True).sizes(), data(False).sizes())
    assert data(True).fingerprint() != data(False).fingerprint()
    assert data(False).fingerprint() == data(False).fingerprint()

    def rank(r, comb):
        try:
            train(Mean(64), data(swapped=r == 1), sq_loss, _cfg(), RunOptions(combiner=comb))
        except UserError as e:
            comb.s["barrier"].abort()  # as a process that exits ends the job's collectives
            return str(e)
        return "trained"

    results, _ = _run_ranks(2, rank, expected=(threading.BrokenBarrierError,))
    assert results[1] is not None and "rank 1: this process's data differ from rank 0's" in results[1]
    assert "hash()" in results[1] and "\n" not in results[1]
    same, _ = _run_ranks(2, lambda r, comb: rank(0, comb))  # the same numbering on both: it trains
    assert same == ["trained", "trained"]


def test_the_data_fingerprint_sees_each_users_records_and_ids():
    """The default fingerprint (gathered records) and the tensor data's own agree on what they see:
    a changed record, a moved record or a renamed user changes it; the same data gives the same."""
    import numpy as np

    from userdp.engine import TensorUserData
    from userdp.engine.user_data import DelegatingUserData, UserData

    class Plain(UserData):  # only the contract: the default fingerprint gathers every record
        def __init__(self, inner):
            self.inner, self.num_users = inner, inner.num_users

        def sizes(self):
            return self.inner.sizes()

        def gather(self, users, records):
            return self.inner.gather(users, records)

    base = user_data(SIZES, d=4, seed=3)
    edited = user_data(SIZES, d=4, seed=3)
    edited.tensors["x"][5, 2] += 1e-6
    offsets = base.offsets.copy()
    offsets[2] += 1  # user 2's first record becomes user 1's last
    moved = TensorUserData(base.tensors, offsets)
    for fp in (
        lambda d: d.fingerprint(),
        lambda d: Plain(d).fingerprint(),
        lambda d: DelegatingUserData(d).fingerprint(),
    ):
        assert fp(base) == fp(user_data(SIZES, d=4, seed=3))
        assert fp(base) != fp(edited) and fp(base) != fp(moved)
    a = TensorUserData.from_user_ids({"x": torch.arange(4.0)[:, None]}, ["ann", "bob", "ann", "cy"])
    b = TensorUserData.from_user_ids({"x": torch.arange(4.0)[:, None]}, ["ann", "bob", "ann", "dee"])
    a.user_ids, b.user_ids = np.array(["ann", "bob", "cy"]), np.array(["ann", "bob", "dee"])
    assert a.fingerprint() != b.fingerprint()


def test_two_ranks_with_banded_noise_equal_one():
    """Banded MF noise under a replicated job (torchrun): rank 0 keeps the stream and adds w_t once
    to its partial sum; the other rank holds none of it; the model is one process's."""
    cfg = dataclasses.replace(
        _cfg(), algorithm=ULS(8, 0.25), steps=6, sampling="cyclic_poisson", noise="bandmf", bands=3
    )
    world = 2
    models = [Mean(64) for _ in range(world)]
    results, _ = _run_ranks(
        world,
        lambda r, comb: train(models[r], user_data(SIZES, d=64, seed=2), sq_loss, cfg, RunOptions(combiner=comb)),
    )
    single = Mean(64)
    ref = train(single, user_data(SIZES, d=64, seed=2), sq_loss, cfg)
    assert ref.record["correlated_noise"]["bands"] == 3
    for r in range(world):
        assert [h["units"] for h in results[r].history] == [h["units"] for h in ref.history]
        assert torch.allclose(models[r].theta, single.theta, atol=1e-6)
