"""Issue 9, engine and accounting: each test failed on the 0.1 code and guards one gap.

Items: 1 (noise key), 2 (non-finite units), 3 (low precision), 5 (published event = ledger),
10 (mixture RDP underflow), 11 (journal and checkpoint integrity), 12 (resume from step 0),
13 (checkpoint is one atomic unit).
"""

import errno
import json
import os

import numpy as np
import pytest
import torch
from scipy import stats
from scipy.special import logsumexp

from userdp import accounting
from userdp.engine import ELS, SGD, ULS, FedAvg, FlatClip, RunOptions, TensorUserData, TrainConfig, train
from userdp.engine import checkpoint as ckpt
from userdp.engine.journal import JOURNAL
from userdp.engine.noise import gaussian as noise_mod
from userdp.engine.performance import Performance
from userdp.engine.run.step import EngineRun
from userdp.errors import UserError

from _engine_helpers import Crash, Mean, crash_at, sq_loss, train_config, user_data


# ------------------------------------------------------------------------------ item 1: the key
def test_keys_equal_modulo_2_32_give_different_noise():
    a = noise_mod.GaussianNoise(5, seeded=True).like([torch.zeros(64)], 1.0)[0]
    b = noise_mod.GaussianNoise(5 + (7 << 32), seeded=True).like([torch.zeros(64)], 1.0)[0]
    c = noise_mod.GaussianNoise(5 + (1 << 100), seeded=True).like([torch.zeros(64)], 1.0)[0]
    assert not torch.equal(a, b) and not torch.equal(a, c)


def test_unseeded_noise_is_keyed_by_at_least_128_bits_of_os_entropy(monkeypatch):
    asked = []
    real = os.urandom

    def spy(n):
        asked.append(n)
        return real(n)

    monkeypatch.setattr(noise_mod.os, "urandom", spy)
    g = noise_mod.GaussianNoise.from_os_entropy()
    assert asked and max(asked) * 8 >= 128
    with pytest.raises(RuntimeError):
        g.state_dict()  # an unseeded key is never saved
    other = noise_mod.GaussianNoise.from_os_entropy()
    assert not torch.equal(g.like([torch.zeros(8)], 1.0)[0], other.like([torch.zeros(8)], 1.0)[0])


def test_noise_is_standard_normal_in_float32():
    g = noise_mod.GaussianNoise(123, seeded=True)
    z = g.like([torch.zeros(100_000, dtype=torch.bfloat16), torch.zeros(100_000)], 2.5)
    assert all(t.dtype == torch.float32 for t in z)
    x = torch.cat(z).double().numpy() / 2.5
    assert stats.kstest(x, "norm").pvalue > 1e-3
    assert abs(x.std() - 1) < 0.01  # 6 standard errors at n = 2e5


def test_unseeded_checkpoint_holds_no_generator_state(tmp_path):
    data = user_data([3] * 10, d=4)
    train(
        Mean(4),
        data,
        sq_loss,
        TrainConfig(
            algorithm=ULS(2, 0.5),
            steps=2,
            noise_multiplier=3.0,
            delta=1e-5,
            performance=Performance(track_epsilon=False),
        ),
        RunOptions(checkpoint_dir=str(tmp_path)),
    )
    st = ckpt.load(str(tmp_path))
    assert not st["seeded"] and "noise_rng" not in st and "numpy_rng" not in st


# ------------------------------------------------------------------------------ item 2: non-finite units
def _poisoned(d=4):
    base = user_data([3, 2, 4, 3, 5], d=d, seed=2)
    bad = torch.full((3, d), float("inf"))
    bad[1, 0] = float("nan")
    return TensorUserData(
        {"x": torch.cat([base.tensors["x"], bad])}, np.concatenate([base.offsets, [base.offsets[-1] + 3]])
    )


@pytest.mark.parametrize(
    "algo", [ULS(3, 1.0), ELS(3, 1.0), FedAvg(3, 1.0, local_epochs=2, local_lr=0.2)], ids=["uls", "els", "fedavg"]
)
def test_a_non_finite_user_contributes_zero_and_is_counted(algo):
    data = _poisoned()
    model = Mean(4)
    res = train(
        model,
        data,
        sq_loss,
        TrainConfig(
            algorithm=algo,
            steps=3,
            noise_multiplier=1.0,
            delta=1e-5,
            seed=0,
            clipping=FlatClip(1.0),
            optimizer=SGD(0.5),
            accountant="rdp",
        ),
    )
    assert torch.isfinite(model.theta).all()
    assert res.record["nonfinite_units"] >= 3  # sampled every step (rate 1)
    assert "NOT privatized" in res.record["nonfinite_units_note"]
    assert all("nonfinite_units" in h for h in res.history)
    # and it contributed exactly zero: the clipped sum equals the sum without that user
    cfg = TrainConfig(
        algorithm=algo, steps=1, noise_multiplier=1.0, delta=1e-5, seed=0, clipping=FlatClip(1.0), accountant="rdp"
    )
    with_bad = EngineRun(Mean(4), data, sq_loss, cfg)
    clean = EngineRun(Mean(4), user_data([3, 2, 4, 3, 5], d=4, seed=2), sq_loss, cfg)
    s1, st1 = with_bad.clipped_sum(np.arange(with_bad.n_units))
    s2, _ = clean.clipped_sum(np.arange(clean.n_units))
    if isinstance(algo, ELS):
        assert st1[5] == 3  # its three records
    assert torch.allclose(s1[0], s2[0], atol=1e-6) or isinstance(algo, FedAvg)  # FedAvg draws differ in order
    assert torch.isfinite(s1[0]).all()


# ------------------------------------------------------------------------------ item 3: precision
def _bf16_run(data, sigma, seed=3, init=100.0, d=4096):
    model = Mean(d, torch.full((d,), init)).to(torch.bfloat16)
    cfg = TrainConfig(
        algorithm=ULS(1, 1.0),
        steps=1,
        noise_multiplier=sigma,
        delta=1e-5,
        seed=seed,
        clipping=FlatClip(1.0),
        optimizer=SGD(1.0),
        accountant="rdp",
        performance=Performance(track_epsilon=False),
    )
    run = EngineRun(model, data, sq_loss, cfg)
    run.before = run.master[0].detach().clone()
    run.run_step()
    # the release: the noised sum over the public denominator, as the optimizer got it (float32). The
    # master weights' difference (at 100, ulp 7.6e-6) would add the optimizer's rounding to it
    return run.master[0].grad.detach().clone(), run


def test_bf16_model_noise_std_matches_sigma_c_over_denominator():
    d = 4096
    n = 50
    # every record sits at the model: zero gradients, so the released update is the noise alone
    data = TensorUserData({"x": torch.full((n, d), 100.0)}, np.arange(n + 1))
    released, run = _bf16_run(data, sigma=2.0, d=d)
    assert run.master[0].dtype == torch.float32 and run.params[0].dtype == torch.bfloat16
    want = 2.0 * 1.0 / run.expected_weight  # sigma * C / denominator = 0.04, far below bf16's spacing at 100
    got = float(released.double().std())
    assert abs(got / want - 1) < 0.03
    assert run.record()["precision"]["master_weights"] == "float32"
    # and the float32 master weights took it (lr 1), to their spacing at 100 (7.6e-6)
    torch.testing.assert_close(run.before - run.master[0].detach(), released, rtol=0, atol=8e-6)


def test_bf16_model_one_adversarial_user_moves_the_release_by_at_most_c_over_denominator():
    d, n = 4096, 50
    x = torch.full((n, d), 100.0)
    neutral = TensorUserData({"x": torch.cat([x, torch.full((1, d), 100.0)])}, np.arange(n + 2))
    adversary = TensorUserData({"x": torch.cat([x, torch.full((1, d), -1e6)])}, np.arange(n + 2))
    r0, run0 = _bf16_run(neutral, sigma=2.0)
    r1, run1 = _bf16_run(adversary, sigma=2.0)
    assert run0.expected_weight == run1.expected_weight
    # same seed: the same cohort and noise; the last user is the only difference
    shift = float((r1 - r0).double().norm())
    bound = 1.0 / run0.expected_weight  # C / denominator
    assert shift <= bound * (1 + 1e-4)
    assert shift > 0.9 * bound  # it does move it, by about C (it is clipped, not dropped)


# ------------------------------------------------------------------------------ item 5: event = ledger


def test_published_event_composes_exactly_the_counted_steps_after_a_crash(tmp_path):
    data = user_data([3] * 30, d=4)
    cfg = TrainConfig(
        algorithm=ULS(2, 0.3),
        steps=8,
        noise_multiplier=2.0,
        delta=1e-5,
        performance=Performance(checkpoint_every=4, track_epsilon=False),
    )
    with pytest.raises(Crash):
        train(Mean(4), data, sq_loss, cfg, RunOptions(checkpoint_dir=str(tmp_path), callbacks=[crash_at(6)]))
    res = train(Mean(4), data, sq_loss, cfg, RunOptions(checkpoint_dir=str(tmp_path), resume=True))
    rec = res.record
    assert rec["steps_applied"] == 8 and rec["steps_accounted"] == 10 and rec["steps_lost_to_crashes"] == 2
    ev = accounting.event_from_dict(json.loads(json.dumps(rec["dp_event_total"])))
    assert ev.count == 10
    assert accounting.epsilon(ev, rec["delta"]) == pytest.approx(rec["epsilon"], rel=1e-12)


# ------------------------------------------------------------------------------ item 10: RDP underflow
def _exact_mog_rdp_pq(G, p, sigma, alpha):
    """D_alpha(P||Q) for integer alpha, exactly: a log-space power of the weight polynomial."""
    k = np.arange(G + 1)
    a = stats.binom.logpmf(k, G, p) - k**2 / (2 * sigma**2)
    v = a.copy()
    for _ in range(alpha - 1):
        out = np.full(len(v) + G, -np.inf)
        for i, ai in enumerate(a):
            out[i : i + len(v)] = np.logaddexp(out[i : i + len(v)], ai + v)
        v = out
    s = np.arange(len(v))
    return logsumexp(v + s**2 / (2 * sigma**2)) / (alpha - 1)


@pytest.mark.parametrize("G,p,sigma", [(256, 5e-4, 8.0), (1024, 1e-4, 30.0), (64, 1e-6, 2.0)])
def test_mixture_rdp_does_not_underflow_at_extremes(G, p, sigma):
    ev = accounting.els_step_event(sigma, p, G)
    orders = [2.0, 3.0, 5.0, 8.0]
    ours = accounting.mog_rdp(sigma, ev.sensitivities, ev.sampling_probs, orders)
    for o, r in zip(orders, ours, strict=True):
        exact = _exact_mog_rdp_pq(G, p, sigma, int(o))
        # never below the exact divergence (up to float64 rounding of log(1 + tiny)), and equal
        # to it here, where D(P||Q) dominates
        assert r >= exact * (1 - 1e-9) - 1e-12
        assert r == pytest.approx(exact, rel=1e-6, abs=1e-12)
    if (G, p, sigma) == (256, 5e-4, 8.0):
        assert ours[2] == pytest.approx(127.783, rel=1e-4)  # was 6.5e-4


# ------------------------------------------------------------------------------ items 11-13: integrity
def _cfg(**kw):
    base = dict(
        algorithm=ULS(2, 0.3), steps=8, noise_multiplier=2.0, delta=1e-5, checkpoint_every=4, track_epsilon=False
    )
    base.update(kw)
    return train_config(**base)


def _crashed_run(tmp_path, crash=6, **kw):
    data = user_data([3] * 30, d=4)
    with pytest.raises(Crash):
        train(Mean(4), data, sq_loss, _cfg(**kw), RunOptions(checkpoint_dir=str(tmp_path), callbacks=[crash_at(crash)]))
    return data


def test_deleted_journal_refuses_resume(tmp_path):
    data = _crashed_run(tmp_path)
    os.unlink(tmp_path / JOURNAL)
    with pytest.raises(UserError, match="ledger_journal.jsonl.*missing"):
        train(Mean(4), data, sq_loss, _cfg(), RunOptions(checkpoint_dir=str(tmp_path), resume=True))


def test_truncated_journal_refuses_resume(tmp_path):
    data = _crashed_run(tmp_path)
    lines = (tmp_path / JOURNAL).read_text().splitlines(keepends=True)
    (tmp_path / JOURNAL).write_text("".join(lines[:3]))  # below the checkpoint's 4 steps
    with pytest.raises(UserError, match="truncated"):
        train(Mean(4), data, sq_loss, _cfg(), RunOptions(checkpoint_dir=str(tmp_path), resume=True))


def test_journal_cut_back_to_a_valid_prefix_after_the_checkpoint_refuses_resume(tmp_path):
    """Crash at step 6 with a checkpoint at 4; the journal lines after the checkpoint are deleted
    (a valid prefix of the chain, so the chain itself verifies): the resume would account 8 steps
    instead of 10. ledger_head.json, written after every line, still cites line 6."""
    data = _crashed_run(tmp_path)
    lines = (tmp_path / JOURNAL).read_text().splitlines(keepends=True)
    assert len(lines) == 1 + 6
    (tmp_path / JOURNAL).write_text("".join(lines[: 1 + 4]))
    with pytest.raises(UserError, match="truncated or replaced by an older copy"):
        train(Mean(4), data, sq_loss, _cfg(), RunOptions(checkpoint_dir=str(tmp_path), resume=True))


def test_an_older_copy_of_the_journal_refuses_resume(tmp_path):
    """The journal as it was at the checkpoint, restored over the crashed run's."""
    data = user_data([3] * 30, d=4)
    saved = {}

    def copy_at_checkpoint(m):
        if m["step"] == 4:
            saved["journal"] = (tmp_path / JOURNAL).read_bytes()
        if m["step"] == 6:
            raise Crash

    with pytest.raises(Crash):
        train(Mean(4), data, sq_loss, _cfg(), RunOptions(checkpoint_dir=str(tmp_path), callbacks=[copy_at_checkpoint]))
    (tmp_path / JOURNAL).write_bytes(saved["journal"])
    with pytest.raises(UserError, match="truncated or replaced by an older copy"):
        train(Mean(4), data, sq_loss, _cfg(), RunOptions(checkpoint_dir=str(tmp_path), resume=True))


def test_deleted_journal_head_refuses_resume(tmp_path):
    data = _crashed_run(tmp_path)
    os.unlink(tmp_path / "ledger_head.json")
    with pytest.raises(UserError, match="ledger_head.json.*missing"):
        train(Mean(4), data, sq_loss, _cfg(), RunOptions(checkpoint_dir=str(tmp_path), resume=True))


def test_every_step_metric_cites_the_journal_head(tmp_path):
    """The engine hands each step's journal head to the callbacks (the LM job writes it into
    metrics.jsonl), so a record outside the journal binds its length."""
    data = user_data([3] * 30, d=4)
    seen = []
    train(Mean(4), data, sq_loss, _cfg(), RunOptions(checkpoint_dir=str(tmp_path), callbacks=[seen.append]))
    assert [m["journal"]["lines"] for m in seen] == list(range(1, 9))
    assert len({m["journal"]["head"] for m in seen}) == 8 and len({m["journal"]["run"] for m in seen}) == 1


def test_edited_journal_line_refuses_resume(tmp_path):
    data = _crashed_run(tmp_path)
    lines = (tmp_path / JOURNAL).read_text().splitlines(keepends=True)
    row = json.loads(lines[5])
    row["spent"] = 2  # claim fewer steps
    lines[5] = json.dumps(row) + "\n"
    (tmp_path / JOURNAL).write_text("".join(lines))
    with pytest.raises(UserError, match="hash chain"):
        train(Mean(4), data, sq_loss, _cfg(), RunOptions(checkpoint_dir=str(tmp_path), resume=True))


def test_torn_final_journal_line_is_repaired_and_never_undercounts(tmp_path):
    data = _crashed_run(tmp_path)
    with open(tmp_path / JOURNAL, "a") as f:
        f.write('{"spent": 7, "ha')  # a crash mid-write: step 7 never began
    res = train(Mean(4), data, sq_loss, _cfg(), RunOptions(checkpoint_dir=str(tmp_path), resume=True))
    assert res.record["steps_accounted"] == 6 + 4 and res.steps == 8


def test_journal_of_another_config_refuses_resume(tmp_path):
    data = _crashed_run(tmp_path)
    with pytest.raises(UserError):
        train(Mean(4), data, sq_loss, _cfg(noise_multiplier=2.5), RunOptions(checkpoint_dir=str(tmp_path), resume=True))
    with pytest.raises(UserError, match="different"):
        train(
            Mean(4),
            data,
            sq_loss,
            _cfg(),
            RunOptions(checkpoint_dir=str(tmp_path), resume=True, journal_context={"data_fingerprint": "other"}),
        )


def test_flipped_checkpoint_byte_refuses_resume(tmp_path):
    data = _crashed_run(tmp_path)
    p = ckpt.path(str(tmp_path))
    raw = bytearray(open(p, "rb").read())
    raw[len(raw) // 2] ^= 0x40
    open(p, "wb").write(bytes(raw))
    with pytest.raises(UserError, match="checkpoint.pt: checksum mismatch"):
        train(Mean(4), data, sq_loss, _cfg(), RunOptions(checkpoint_dir=str(tmp_path), resume=True))


def test_missing_manifest_refuses_resume(tmp_path):
    data = _crashed_run(tmp_path)
    os.unlink(ckpt.manifest_path(str(tmp_path)))
    with pytest.raises(UserError, match="MANIFEST.json: missing"):
        train(Mean(4), data, sq_loss, _cfg(), RunOptions(checkpoint_dir=str(tmp_path), resume=True))


def test_crash_before_first_checkpoint_resumes_from_step_zero_with_begun_steps_counted(tmp_path):
    data = user_data([3] * 30, d=4)
    cfg = _cfg(checkpoint_every=0)
    with pytest.raises(Crash):
        train(Mean(4), data, sq_loss, cfg, RunOptions(checkpoint_dir=str(tmp_path), callbacks=[crash_at(3)]))
    assert not ckpt.exists(str(tmp_path))
    res = train(Mean(4), data, sq_loss, cfg, RunOptions(checkpoint_dir=str(tmp_path), resume=True))
    assert res.steps == 8 and res.record["steps_accounted"] == 11 and res.record["steps_lost_to_crashes"] == 3


def test_disk_full_during_a_checkpoint_leaves_the_previous_one_whole(tmp_path):
    data = user_data([3] * 30, d=4)
    cfg = _cfg(steps=8, checkpoint_every=4)
    calls = {"n": 0}

    def extra(run):
        def write_weights(path):
            calls["n"] += 1
            if run.step == 8:
                with open(path, "wb") as f:
                    f.write(b"partial")
                raise OSError(errno.ENOSPC, "No space left on device")
            torch.save({"step": run.step}, path)

        return {"model.bin": write_weights}

    with pytest.raises(UserError, match="No space left on device.*previous checkpoint is intact"):
        train(Mean(4), data, sq_loss, cfg, RunOptions(checkpoint_dir=str(tmp_path), checkpoint_extra=extra))
    manifest = ckpt.verify(str(tmp_path))  # every file matches: one consistent unit
    assert manifest["step"] == 4
    assert torch.load(tmp_path / "model.bin")["step"] == 4 and ckpt.load(str(tmp_path))["step"] == 4
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".pending")]


def test_a_crash_between_commit_and_switch_rolls_forward(tmp_path, monkeypatch):
    ckpt.save(str(tmp_path), {"step": 1}, {"w.bin": lambda p: torch.save({"v": 1}, p)})
    monkeypatch.setattr(ckpt, "_switch", lambda directory, manifest: None)  # die right after the commit
    ckpt.save(str(tmp_path), {"step": 2}, {"w.bin": lambda p: torch.save({"v": 2}, p)})
    monkeypatch.undo()
    assert ckpt.load(str(tmp_path))["step"] == 2 and torch.load(tmp_path / "w.bin")["v"] == 2


def _shard_files(directory, step: int, payload: bytes) -> tuple:
    """A sharded run's folder as its ranks leave it before the commit: files in the pending folder,
    hashed (what engine.sharding.save_shards hands to checkpoint.save)."""
    from userdp.fileio import sha256_file

    folder = ckpt.shards_folder(step)
    pend = ckpt.pending_folder(str(directory), folder)
    os.makedirs(pend)
    for name in ("__0_0.distcp", "__1_0.distcp", ".metadata"):
        with open(os.path.join(pend, name), "wb") as f:
            f.write(payload + name.encode())
    return folder, {
        n: {"sha256": sha256_file(os.path.join(pend, n)), "bytes": os.path.getsize(os.path.join(pend, n))}
        for n in os.listdir(pend)
    }


def test_a_sharded_checkpoints_folder_commits_with_it_and_replaces_the_last(tmp_path, monkeypatch):
    """A sharded run's shards folder is one more part of the unit: switched in with the files,
    checked by every read, rolled forward after a crash between the commit and the switch, removed
    with the checkpoint it belonged to, and removed (never committed) when the rest cannot be written."""
    ckpt.save(str(tmp_path), {"step": 2}, shards=_shard_files(tmp_path, 2, b"a"))
    assert sorted(os.listdir(tmp_path / "shards-00000002")) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    monkeypatch.setattr(ckpt, "_switch", lambda directory, manifest: None)  # die right after the commit
    ckpt.save(str(tmp_path), {"step": 4}, shards=_shard_files(tmp_path, 4, b"b"))
    monkeypatch.undo()
    assert ckpt.load(str(tmp_path))["step"] == 4  # rolled forward: the new folder switched in ...
    assert (tmp_path / "shards-00000004" / "__1_0.distcp").read_bytes() == b"b__1_0.distcp"
    ckpt.save(str(tmp_path), {"step": 6}, shards=_shard_files(tmp_path, 6, b"c"))
    assert sorted(f for f in os.listdir(tmp_path) if "shards" in f) == ["shards-00000006"]  # ... the old ones gone
    (tmp_path / "shards-00000006" / "__0_0.distcp").write_bytes(b"edited")
    with pytest.raises(UserError, match=r"shards-00000006/__0_0\.distcp: checksum mismatch"):
        ckpt.load(str(tmp_path))
    (tmp_path / "shards-00000006" / "__0_0.distcp").write_bytes(b"c__0_0.distcp")

    def full(path):
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(UserError, match="previous checkpoint is intact"):
        ckpt.save(str(tmp_path), {"step": 8}, {"w.bin": full}, shards=_shard_files(tmp_path, 8, b"d"))
    assert ckpt.load(str(tmp_path))["step"] == 6
    assert sorted(f for f in os.listdir(tmp_path) if "shards" in f) == ["shards-00000006"]  # no pending folder
