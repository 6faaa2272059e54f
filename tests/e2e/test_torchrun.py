"""userdp on torch.distributed, launched by torchrun (CPU, gloo; docs/scaling.md).

* Two processes give one process's model for the same seed — ULS, ELS and FedAvg, with record
  draws that matter (G below most users' sizes) — with exactly two all-reduces per step: the
  statistics (float64, a few numbers), then the noised clipped sums in float32.
* ``torchrun -m userdp train`` end to end: the same model as one process; rank 0 alone writes.
* A process killed mid-run ends the job with a clear message; ``--resume`` (on the same and on
  another world size) continues, and the ledger counts every step begun once.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from _paths import TESTS

from userdp.engine import SGD, ULS, FlatClip, RunOptions, TrainConfig, train
from userdp.engine.performance import Performance
from userdp.errors import UserError

from _engine_helpers import Mean, sq_loss, user_data
from _lm_corpus import write_tiny_run

HERE = TESTS
TORCHRUN = shutil.which("torchrun")
needs_torchrun = pytest.mark.skipif(
    TORCHRUN is None or not torch.distributed.is_available() or not sys.platform.startswith("linux"),
    reason="needs torchrun and torch.distributed (gloo) on Linux",
)


def _env(tmp_path):
    env = dict(os.environ, USERDP_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1", PYTHONPATH=str(HERE))
    env.pop("WORLD_SIZE", None)
    return env


def _in_process(args, tmp_path, monkeypatch, capsys):
    """``userdp <args>`` in this process, as the subprocesses see it (cwd ``tmp_path``, their
    USERDP_CACHE): the one-process reference, without an interpreter and its imports to start.
    Returns (exit code, stdout, stderr)."""
    from userdp.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("USERDP_CACHE", str(tmp_path / "cache"))
    capsys.readouterr()
    rc = main(args)
    out = capsys.readouterr()
    return rc, out.out, out.err


def _torchrun(n, args, tmp_path, **kw):
    cmd = [TORCHRUN, "--standalone", f"--nproc_per_node={n}", *args]
    return subprocess.run(cmd, cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=300, **kw)


# ----------------------------------------------------------------------------- the engine, 2 processes
@pytest.mark.heavy(
    counterpart="tests/engine/test_distribution.py::test_a_distribution_in_one_file_releases_the_replicated_runs_sum"
)
@pytest.mark.slow
@needs_torchrun
def test_two_processes_give_one_processs_parameters_for_uls_els_and_fedavg(tmp_path):
    import _dist_worker as worker

    out = _torchrun(2, [str(HERE / "_dist_worker.py"), str(tmp_path)], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    ref = worker.run_all()
    loaded = [torch.load(tmp_path / f"rank{r}.pt")["params"].pop("loaded_uls") for r in (0, 1)]
    # each rank reads only its share of every cohort: together, exactly what one process reads
    assert sorted(loaded[0] + loaded[1]) == sorted(ref.pop("loaded_uls"))
    assert 0 < len(loaded[0]) < len(loaded[0]) + len(loaded[1]) and len(loaded[1]) > 0
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        got["params"].pop("loaded_uls")
        assert got["world_size"] == 2
        for algo, params in ref.items():
            for name, p in params.items():
                # per-rank noise or per-rank record draws would move these by ~1e-1
                assert torch.allclose(got["params"][algo][name], p, atol=1e-5), (rank, algo, name)
        calls = got["all_reduce"]
        n_params = sum(p.numel() for p in ref["uls"].values())
        steps = 3 * 4
        assert len(calls) == 2 * steps  # per step: the statistics, then the noised clipped sums
        assert calls[0::2] == [("torch.float64", 7)] * steps
        assert calls[1::2] == [("torch.float32", n_params)] * steps  # one float32 bucket, not widened


# ----------------------------------------------------------------------------- userdp train under torchrun
def _tiny(tmp_path, training_extra):
    return write_tiny_run(tmp_path, training_extra, name="cfg.yaml")[0]


def _weights(run_dir):
    from safetensors.torch import load_file

    (f,) = list(Path(run_dir, "model").glob("*.safetensors"))
    return load_file(str(f))


@pytest.mark.heavy(
    counterpart="tests/engine/test_fsdp.py::test_ghost_norms_and_clipped_sums_of_a_fully_sharded_model_are_the_unsharded_models"
)
@pytest.mark.slow
@needs_torchrun
def test_lora_on_a_sharded_base_is_the_one_process_lora_run(tmp_path, monkeypatch, capsys):
    """`userdp train --nproc 2 --set training.sharding=fsdp` with LoRA: the base sharded by FSDP2, the
    adapters trained as one process trains them (same epsilon, the released merged weights within
    float32 rounding; the adapters start alike in every process and run: models.LORA_INIT_SEED)."""
    cfg = _tiny(tmp_path, "  seed: 5\n")
    lora = ["--set", "model.lora.enabled=true", "--set", "model.lora.rank=4"]
    rc, one, err = _in_process(
        ["train", str(cfg), "--output", "one", "--no-progress", "--json", *lora], tmp_path, monkeypatch, capsys
    )
    assert rc == 0, err[-3000:]
    shard = subprocess.run(
        [
            sys.executable,
            "-m",
            "userdp",
            "train",
            str(cfg),
            "--nproc",
            "2",
            "--output",
            "shard",
            "--no-progress",
            "--json",
            "--set",
            "training.sharding=fsdp",
            *lora,
        ],
        cwd=tmp_path,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert shard.returncode == 0, shard.stderr[-3000:]
    s1, s2 = json.loads(one.splitlines()[-1]), json.loads(shard.stdout.splitlines()[-1])
    assert s2["steps"] == s1["steps"] == 4 and s2["epsilon"] == s1["epsilon"]
    assert s2["loss_after"] == pytest.approx(s1["loss_after"], abs=1e-5)
    w1, w2 = _weights(tmp_path / "one"), _weights(tmp_path / "shard")
    gap = max(float((w1[k].float() - w2[k].float()).abs().max()) for k in w1)
    assert sorted(w1) == sorted(w2) and gap < 1e-5, gap  # float32 sums in another order
    priv = json.loads((tmp_path / "shard" / "privacy.json").read_text())
    assert priv["compute"]["sharding"] == "fsdp"


@pytest.mark.heavy(
    counterpart="tests/engine/test_distribution.py::test_a_distribution_in_one_file_releases_the_replicated_runs_sum"
)
@pytest.mark.slow
@needs_torchrun
def test_torchrun_train_matches_one_process_and_rank_0_alone_writes(tmp_path, monkeypatch, capsys):
    cfg = _tiny(tmp_path, "  seed: 5\n  checkpoint_every: 1\n")
    rc, one, err = _in_process(
        ["train", str(cfg), "--output", "one", "--no-progress", "--json"], tmp_path, monkeypatch, capsys
    )
    assert rc == 0, err[-3000:]
    # userdp's own launcher (issue 41): the same job as `torchrun --nproc_per_node=2 -m userdp train`
    two = subprocess.run(
        [
            sys.executable,
            "-m",
            "userdp",
            "train",
            str(cfg),
            "--nproc",
            "2",
            "--output",
            "two",
            "--no-progress",
            "--json",
        ],
        cwd=tmp_path,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    # the same job with the model sharded over the two processes (FSDP2, issue 37)
    shard = subprocess.run(
        [
            sys.executable,
            "-m",
            "userdp",
            "train",
            str(cfg),
            "--nproc",
            "2",
            "--output",
            "shard",
            "--no-progress",
            "--json",
            "--set",
            "training.sharding=fsdp",
        ],
        cwd=tmp_path,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert shard.returncode == 0, shard.stderr[-3000:]
    s3 = json.loads(shard.stdout.splitlines()[-1])
    assert s3["steps"] == 4 and s3["epsilon"] == json.loads(one.splitlines()[-1])["epsilon"]
    w3 = _weights(tmp_path / "shard")
    assert max(float((_weights(tmp_path / "one")[k].float() - w3[k].float()).abs().max()) for k in w3) < 1e-4
    assert json.loads((tmp_path / "shard" / "privacy.json").read_text())["compute"]["sharding"] == "fsdp"
    assert two.stdout.count("run directory:") == 1  # one summary, from rank 0
    s1, s2 = json.loads(one.splitlines()[-1]), json.loads(two.stdout.splitlines()[-1])
    assert s2["steps"] == s1["steps"] == 4 and s2["epsilon"] == s1["epsilon"]
    assert s2["loss_after"] == pytest.approx(s1["loss_after"], abs=1e-5)
    w1, w2 = _weights(tmp_path / "one"), _weights(tmp_path / "two")
    assert max(float((w1[k].float() - w2[k].float()).abs().max()) for k in w1) < 1e-4
    run = tmp_path / "two"
    assert len(run.joinpath("metrics.jsonl").read_text().splitlines()) == 4  # one writer: no duplicate rows
    assert len(run.joinpath("checkpoints", "ledger_journal.jsonl").read_text().splitlines()) == 1 + 4
    priv = json.loads(run.joinpath("privacy.json").read_text())
    assert priv["compute"]["device"] == "cpu x 2 processes"
    assert priv["compute"]["processes"] == {"world_size": 2, "backend": "gloo"}


@pytest.mark.parametrize(
    "override, words",
    [
        ("training.nope=1", "unknown key 'training.nope'"),
        ("data.path=/no/such/file.jsonl", "data.path /no/such/file.jsonl"),
        ("audit.canaries=10", "audit.canaries"),
        ("model.device=cuda:0", "names one GPU"),
        ("training.sharding=fsdp training.algorithm=fedavg", "training.sharding: fsdp a local-SGD update"),
        ("training.sharding=fsdp training.per_unit=vmap", "training.sharding: fsdp clips per unit with the ghost"),
    ],
)
def test_train_nproc_refuses_a_bad_input_before_any_process_starts(tmp_path, monkeypatch, capsys, override, words):
    from userdp import launcher
    from userdp.cli import main

    cfg = _tiny(tmp_path, "")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(launcher, "launch", lambda *a, **k: pytest.fail("a process was started"))
    sets = [a for o in override.split() for a in ("--set", o)]
    assert main(["train", str(cfg), "--nproc", "2", *sets, "--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in err, err
    assert not (tmp_path / "o").exists()


@pytest.mark.heavy(
    counterpart="tests/e2e/test_torchrun.py::test_train_nproc_refuses_a_bad_input_before_any_process_starts"
)
@pytest.mark.slow
@needs_torchrun
def test_a_bad_input_found_by_the_workers_ends_the_job_in_one_line_exit_2(tmp_path):
    cfg = _tiny(tmp_path, "")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(Path(tmp_path / "users.jsonl").read_text() + '{"user": "x", "text": broken\n')
    for extra, words in (
        (["--set", "training.cohort_size=100000"], "more than the"),
        (["--set", f"data.path={bad}"], "bad.jsonl:line 121: not valid JSON"),
    ):
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "userdp",
                "train",
                str(cfg),
                "--nproc",
                "2",
                *extra,
                "--output",
                "o",
                "--no-progress",
            ],
            cwd=tmp_path,
            env=_env(tmp_path),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 2, out.stderr[-3000:]
        errors = [ln for ln in out.stderr.splitlines() if "error" in ln.lower()]
        assert len(errors) == 1 and words in errors[0], out.stderr[-3000:]  # one line, from the job
        assert "Traceback" not in out.stderr and "ChildFailedError" not in out.stderr
        assert out.stderr.strip().splitlines()[-1] == errors[0]  # the last line the user reads
        assert not (tmp_path / "o").exists()


def test_the_workers_get_the_users_arguments_less_the_launchers():
    from userdp.cli.train import _worker_argv

    argv = [
        "--plugin",
        "p.py",
        "train",
        "c.yaml",
        "--nproc",
        "2",
        "--nnodes=1",
        "--set",
        "a.b=1",
        "--rdzv-endpoint",
        "h:1",
        "--node-rank",
        "0",
        "--no-progress",
    ]
    assert _worker_argv(argv) == ["--plugin", "p.py", "train", "c.yaml", "--set", "a.b=1", "--no-progress"]


def _children(pid):
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(x) for x in task.joinpath("children").read_text().split()]
    return out


def _rank_of(pid):
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(e for e in env if e.startswith(b"RANK=")).split(b"=")[1])


def _kill_one_rank(cmd, tmp_path, run, victim, after_step):
    """Start ``cmd`` (torchrun, 2 processes), kill -9 rank ``victim`` once metrics.jsonl shows step
    ``after_step``; returns torchrun's stderr once every process has ended (no hang)."""
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.time() + 240
        while time.time() < deadline:
            m = run / "metrics.jsonl"
            rows = m.read_text().splitlines() if m.is_file() else []
            if rows and json.loads(rows[-1])["step"] >= after_step:
                break
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.05)
        (pid,) = [p for p in _children(proc.pid) if _rank_of(p) == victim]
        os.kill(pid, 9)
        _, err = proc.communicate(timeout=120)  # every process ends: no hang
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    return err


def _begun_and_committed(run):
    """Steps begun (the journal's rows less its header) and the committed checkpoint's step: that of
    MANIFEST.json (a kill between that commit and the renames leaves the previous ledger.json in
    place, and the resume rolls the commit forward)."""
    begun = len((run / "checkpoints" / "ledger_journal.jsonl").read_text().splitlines()) - 1
    return begun, json.loads((run / "checkpoints" / "MANIFEST.json").read_text())["step"]


@pytest.mark.heavy(
    counterpart="tests/guarantee/test_guarantee_lm.py::test_crash_before_the_first_checkpoint_resumes_with_begun_steps_counted"
)
@pytest.mark.slow
@needs_torchrun
def test_killed_processes_end_the_job_and_resumes_count_every_step_once(tmp_path, monkeypatch, capsys):
    """Rank 1 killed, resumed on 2 processes with the model sharded (FSDP2); rank 0 killed, resumed on
    ONE process, unsharded (the checkpoint holds whole tensors, no per-rank state): every step begun
    is counted once, the model goes on from the commit."""
    cfg = _tiny(tmp_path, "  checkpoint_every: 1\n")  # unseeded: steps begun and lost are spent
    cfg.write_text(cfg.read_text().replace("steps: 4", "steps: 30"))
    run = tmp_path / "run"
    launch = [TORCHRUN, "--standalone", "--nproc_per_node=2", "-m", "userdp", "train"]
    err = _kill_one_rank(launch + [str(cfg), "--output", str(run), "--no-progress"], tmp_path, run, 1, 3)
    # the survivor (rank 0) says what happened and how to go on: its collective fails, or torchrun's
    # SIGTERM reaches it first
    assert re.search(r"rank 0 of 2: (lost contact with another process of the job|stopped by SIGTERM)", err), err
    assert f"--resume {run}" in err, err
    begun1, ckpt1 = _begun_and_committed(run)
    assert begun1 >= ckpt1 >= 2
    # the resume shards the model (a performance setting may change on resume): rank 0 of a sharded job killed
    _kill_one_rank(
        launch + ["--resume", str(run), "--no-progress", "--set", "training.sharding=fsdp"],
        tmp_path,
        run,
        0,
        begun1 + 2,
    )
    begun2, ckpt2 = _begun_and_committed(run)
    assert begun2 - begun1 >= ckpt2 - ckpt1 >= 1
    one = ["train", "--resume", str(run), "--no-progress", "--json"]
    rc, _, err = _in_process(one, tmp_path, monkeypatch, capsys)
    assert rc == 2 and "training.sharding: fsdp" in err  # one process cannot shard: said
    rc, _, err = _in_process(one + ["--set", "training.sharding=none"], tmp_path, monkeypatch, capsys)
    assert rc == 0, err[-3000:]
    priv = json.loads((run / "privacy.json").read_text())
    accounted, _ = _begun_and_committed(run)
    applied = len((run / "metrics.jsonl").read_text().splitlines())
    # the journal counts begun steps since the start, a checkpoint the applied ones
    lost = (begun1 - ckpt1) + (begun2 - begun1) - (ckpt2 - ckpt1)
    assert priv["steps_taken"] == accounted  # every step begun counted once
    assert priv["steps_lost_to_crashes"] == lost
    assert priv["steps_applied"] == applied and accounted == applied + lost
    assert [json.loads(r)["step"] for r in (run / "metrics.jsonl").read_text().splitlines()] == list(
        range(1, applied + 1)
    )


# ----------------------------------------------------------------------------- refusals, in process
def test_a_torchrun_environment_that_cannot_be_used_is_refused(monkeypatch):
    from userdp.world import init_world

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(UserError, match="RANK or LOCAL_RANK is missing"):
        init_world("cpu")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(UserError, match="names one GPU"):
        init_world("cuda:1")
    with pytest.raises(UserError, match="dist-timeout"):
        init_world("cpu", timeout_s=0)


def test_the_audit_is_refused_on_several_processes(tmp_path):
    from userdp.lm import config as C
    from userdp.lm.finetune import run
    from userdp.lm.job_context import Launch
    from userdp.world import World

    cfg = _tiny(tmp_path, "")
    c = C.load_config(str(cfg), ["audit.canaries=10"])
    with pytest.raises(UserError, match="audit runs in one process"):
        run(c, output=str(tmp_path / "r"), launch=Launch(world=World(rank=0, world_size=2)))
    assert not (tmp_path / "r").exists()


def test_a_rank_whose_config_differs_from_rank_0s_is_refused():
    """Threads stand in for processes (tests/engine/test_distributed.py); rank 1 reads another config."""
    from _engine_helpers import ThreadCombiner as _ThreadCombiner

    shared = {"barrier": threading.Barrier(2), "slots": [None, None], "calls": [0, 0]}
    errors = [None, None]

    def rank(r):
        cfg = TrainConfig(
            algorithm=ULS(2, 0.5),
            steps=3 + r,
            clipping=FlatClip(0.5),
            optimizer=SGD(0.5),
            noise_multiplier=1.0,
            delta=1e-5,
            seed=1,
            accountant="rdp",
            performance=Performance(track_epsilon=False),
        )
        try:
            train(Mean(4), user_data([3] * 8, d=4), sq_loss, cfg, RunOptions(combiner=_ThreadCombiner(r, 2, shared)))
        except Exception as e:  # noqa: BLE001 - recorded for the assertion
            errors[r] = e
            shared["barrier"].abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert isinstance(errors[1], UserError) and "differs from rank 0's" in str(errors[1])
    assert isinstance(errors[0], threading.BrokenBarrierError)  # rank 0 stops too (a process would see PeerLost)


def test_units_draw_the_same_records_whatever_the_chunking():
    """The record draw of a unit is keyed by (run, step, unit): a chunk size that splits the cohort
    differently (as W ranks do) trains the same model."""
    cfgs = [
        TrainConfig(
            algorithm=ULS(2, 0.6),
            steps=3,
            clipping=FlatClip(0.5),
            optimizer=SGD(0.5),
            noise_multiplier=1.0,
            delta=1e-5,
            seed=9,
            accountant="rdp",
            performance=Performance(chunk_size=c, track_epsilon=False),
        )
        for c in (1, 5)
    ]
    models = [Mean(4), Mean(4)]
    for m, c in zip(models, cfgs, strict=True):
        train(m, user_data(np.arange(1, 13), d=4, seed=3), sq_loss, c)
    assert torch.allclose(models[0].theta, models[1].theta, atol=1e-6)
