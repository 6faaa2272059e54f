"""Bad input the last catalogue still found (issue 41): a full disk mid-run, ``init`` accepting
what ``train`` refuses, and a delta that gives no guarantee. Each class has several cases; each
ends in one line, exit 2 (or a ``UserError``), nothing half-written, the user's files untouched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from userdp.cli import main
from userdp.engine import ULS, TrainConfig
from userdp.engine.plan import make_plan
from userdp.errors import UserError

ROWS = "".join(json.dumps({"user": f"u{i % 5}", "text": f"a message number {i}"}) + "\n" for i in range(40))


def _one_error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(lines) == 1, err
    return lines[0]


# ------------------------------------------------------------------------------ a full disk
_FULL_DISK = textwrap.dedent("""
    import json, resource, signal, sys
    import numpy as np, torch
    from torch import nn
    from userdp.engine import ULS, Performance, RunOptions, TrainConfig, TensorUserData, train
    from userdp.errors import UserError

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
    x = torch.randn(24, 64, generator=torch.Generator().manual_seed(0))
    data = TensorUserData({"x": x}, np.arange(0, 25, 4))
    loss = lambda m, b: (m(b["x"]) ** 2).sum(-1)
    cfg = TrainConfig(ULS(2, 0.5), steps=4, noise_multiplier=1.0, delta=1e-3, seed=3, performance=Performance(checkpoint_every=2))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (8192, hard))  # the journal fits; a 16 KB checkpoint does not
    torch.manual_seed(0)
    try:
        train(nn.Linear(64, 64), data, loss, cfg, RunOptions(checkpoint_dir=sys.argv[1]))
        first = "finished"
    except UserError as exc:
        first = str(exc)
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))  # space freed
    torch.manual_seed(0)
    res = train(nn.Linear(64, 64), data, loss, cfg, RunOptions(checkpoint_dir=sys.argv[1], resume=True))
    print(json.dumps({"first": first, "steps": res.steps_accounted if hasattr(res, "steps_accounted") else None,
                      "epsilon": res.epsilon}))
""")


def test_a_full_disk_is_one_line_and_the_run_resumes_once_space_is_freed(tmp_path):
    ckpt = tmp_path / "ckpt"
    out = subprocess.run([sys.executable, "-c", _FULL_DISK, str(ckpt)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    first = res["first"]
    assert first != "finished" and "\n" not in first
    assert str(ckpt) in first and "could not write the checkpoint" in first and "MB free" in first, first
    assert "resume" in first
    assert res["epsilon"] is not None and res["epsilon"] > 0
    leftovers = [p.name for p in ckpt.iterdir() if p.name.startswith(".") and "pending" in p.name]
    assert leftovers == []  # nothing half-written where a later command would read it


def test_a_writer_librarys_own_failure_is_one_line_naming_the_path(tmp_path):
    # torch.save reports a full disk as RuntimeError("[enforce fail at inline_container.cc] unexpected pos")
    from userdp.fileio import atomic_dir, write_atomic

    def torch_like(path):
        open(path, "wb").write(b"partial")
        raise RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 64 vs 0")

    with pytest.raises(UserError, match=r"model.pt: cannot write it \(RuntimeError: .*unexpected pos.*MB free there"):
        write_atomic(tmp_path / "model.pt", torch_like)
    with pytest.raises(UserError, match="store: cannot write it"):
        with atomic_dir(tmp_path / "store") as tmp:
            torch_like(tmp / "shard.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no temporary left behind
    with pytest.raises(TypeError):  # a programming error is not disguised as a full disk
        write_atomic(tmp_path / "x.pt", lambda p: (_ for _ in ()).throw(TypeError("bug")))


# ------------------------------------------------------------------------------ init
@pytest.fixture
def data(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(ROWS)
    return p


def test_init_refuses_an_empty_public_text(tmp_path, data, capsys):
    pub = tmp_path / "pub.txt"
    pub.write_text("\n\n  \n")
    assert main(["init", str(data), "--public-text", str(pub), "--output", str(tmp_path / "c.yaml")]) == 2
    assert "--public-text" in _one_error(capsys) and not (tmp_path / "c.yaml").exists()


def test_init_refuses_a_file_with_a_single_user(tmp_path, capsys):
    one = tmp_path / "one.jsonl"
    one.write_text("".join(json.dumps({"user": "solo", "text": f"t{i}"}) + "\n" for i in range(9)))
    assert main(["init", str(one), "--output", str(tmp_path / "c.yaml")]) == 2
    assert "1 user" in _one_error(capsys) and not (tmp_path / "c.yaml").exists()


def test_init_refuses_an_output_folder_that_does_not_exist(tmp_path, data, capsys):
    assert main(["init", str(data), "--output", str(tmp_path / "no" / "such" / "c.yaml")]) == 2
    assert "does not exist" in _one_error(capsys) and not (tmp_path / "no").exists()


def test_two_inits_racing_for_one_output_the_second_is_refused(tmp_path, data, capsys, monkeypatch):
    from userdp.cli import init as init_cli

    out = tmp_path / "c.yaml"
    real = init_cli.build_config

    def other_init_wins(*a, **k):  # the other init writes its config between our check and our write
        out.write_text("# the other init's config\n")
        return real(*a, **k)

    monkeypatch.setattr(init_cli, "build_config", other_init_wins)
    assert main(["init", str(data), "--output", str(out)]) == 2
    assert "nothing was overwritten" in _one_error(capsys)
    assert out.read_text() == "# the other init's config\n"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_init_reads_a_jsonl_with_a_byte_order_mark_as_training_does(tmp_path, capsys):
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + ROWS.encode())
    assert main(["init", str(bom), "--output", str(tmp_path / "c.yaml")]) == 0
    assert 'user_field: "user"' in (tmp_path / "c.yaml").read_text()


@pytest.mark.parametrize("cmd", ["init", "stats"])
def test_a_latin1_byte_is_named_by_its_line(tmp_path, capsys, cmd):
    csv = tmp_path / "d.csv"
    csv.write_bytes(b"user,text\n" + b"".join(f"u{i % 3},row {i}\n".encode() for i in range(6)) + b"u1,caf\xe9 time\n")
    argv = ["init", str(csv), "--output", str(tmp_path / "c.yaml")] if cmd == "init" else ["data", "stats", str(csv)]
    assert main(argv) == 2
    assert "d.csv:line 8" in _one_error(capsys)


# ------------------------------------------------------------------------------ delta
@pytest.mark.parametrize("delta, users", [(0.5, 10), (0.1, 10), (1e-3, 1000), (2e-3, 600)])
def test_a_delta_of_at_least_one_over_n_is_refused(delta, users):
    with pytest.raises(UserError, match=r"privacy.delta = .* is at least 1/N"):
        make_plan(
            TrainConfig(ULS(2, 0.1), steps=3, noise_multiplier=1.0, delta=delta), num_users=users, num_units=users
        )


def test_a_delta_above_the_default_rule_is_stated_as_weaker():
    # 100 users: N^-1.1 = 6.3e-3; 9e-3 is below 1/N = 1e-2 (accepted) but above the default
    plan = make_plan(TrainConfig(ULS(2, 0.1), steps=3, noise_multiplier=1.0, delta=9e-3), num_users=100, num_units=100)
    assert "weaker guarantee" in plan.delta_rule and "N^-1.1" in plan.delta_rule
    ok = make_plan(TrainConfig(ULS(2, 0.1), steps=3, noise_multiplier=1.0, delta=1e-4), num_users=100, num_units=100)
    assert ok.delta_rule == "given"


def test_account_and_train_refuse_a_delta_that_gives_no_guarantee(tmp_path, data, capsys):
    assert (
        main(
            [
                "account",
                "--mechanism",
                "uls",
                "--users",
                "100",
                "--cohort-size",
                "10",
                "--steps",
                "5",
                "--noise-multiplier",
                "1",
                "--delta",
                "0.5",
            ]
        )
        == 2
    )
    assert "--delta" in _one_error(capsys)
    pub = tmp_path / "pub.txt"
    pub.write_text("\n\n".join("some public words here " * 3 for _ in range(20)))
    rc = main(
        [
            "train",
            "--set",
            "data.source=jsonl",
            "--set",
            f"data.path={data}",
            "--set",
            f"data.public_path={pub}",
            "--set",
            "model.preset=tiny",
            "--set",
            "model.pretrain=false",
            "--set",
            "privacy.delta=0.5",
            "--set",
            "training.steps=2",
            "--set",
            "training.cohort_size=2",
            "--no-progress",
            "--output",
            str(tmp_path / "run"),
        ]
    )
    assert rc == 2
    assert "privacy.delta = 0.5" in _one_error(capsys)
    assert not (tmp_path / "run" / "model").exists() and not os.path.exists(tmp_path / "run" / "privacy.json")
