"""Scale-out design (issue 4 item 11): ranks that split the units of each step and all-reduce
the clipped sum give the same model as one process — the noise is drawn once per step for the
whole sum (not once per shard, which would make it sqrt(world) times larger).

Two ranks are simulated with threads and an in-memory all-reduce (a process spawn costs more
than the test budget); the real ``torch.distributed`` combiner runs on a one-process gloo group.
"""

import pytest
import torch
import torch.distributed as dist

from userdp.engine import SGD, ULS, FlatClip, RunOptions, TrainConfig, train
from userdp.engine.distributed import TorchDistributedCombiner

from _engine_helpers import Mean, sq_loss, user_data
from _engine_helpers import run_ranks as _run_ranks

SIZES = [3, 1, 5, 2, 8, 4, 6, 7] * 3


def _cfg():
    # G >= every user's size: each unit's records are all of the user's, so the split is exact
    return TrainConfig(algorithm=ULS(8, 0.5), steps=4, clipping=FlatClip(0.5), optimizer=SGD(0.5),
                       noise_multiplier=1.3, delta=1e-5, seed=17, chunk_size=4, track_epsilon=False,
                       accountant="rdp")


def test_two_ranks_equal_one():
    world = 2
    models = [Mean(64) for _ in range(world)]
    results, shared = _run_ranks(world, lambda r, comb: train(models[r], user_data(SIZES, d=64, seed=2), sq_loss,
                                                              _cfg(), RunOptions(combiner=comb)))
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
    unseeded = TrainConfig(algorithm=ULS(8, 0.5), steps=4, clipping=FlatClip(0.5), optimizer=SGD(0.5),
                           noise_multiplier=1.3, delta=1e-5, chunk_size=4, track_epsilon=False, accountant="rdp")

    def run_all(resume, crash_at=None):
        def crash(m):
            if crash_at is not None and m["step"] == crash_at:
                raise KeyError("crash")

        return _run_ranks(world, lambda r, comb: train(Mean(64), user_data(SIZES, d=64, seed=2), sq_loss, unseeded,
                                                       RunOptions(combiner=comb, checkpoint_dir=str(dirs[r]),
                                                                  resume=resume,
                                                                  callbacks=[crash])), expected=(KeyError,))[0]

    run_all(resume=False, crash_at=2)
    assert (dirs[0] / "ledger_journal.jsonl").is_file()
    assert not dirs[1].exists() or not any(dirs[1].iterdir())
    res = run_all(resume=True)
    for r in range(world):  # 2 begun before the crash (unseeded: spent) + 4 now, on every rank
        assert res[r].record["steps_accounted"] == 6 and res[r].record["steps_lost_to_crashes"] == 2
