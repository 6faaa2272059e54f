"""Progress off a terminal (issue 39, logs): no bar frames, a few plain lines for the long loops,
each message on its own line."""

from userdp import progress
from userdp.cli import main

from _fuzz_cases import _tiny_config  # noqa: E402


def test_a_loop_writes_one_plain_line_per_tenth_off_a_terminal(capsys):
    with progress.bar(95, "train uls", "step", lines=10) as b:
        for _ in range(95):
            b.update(1)
            b.set_postfix_str("loss 1.000")
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert "\r" not in err and len(lines) == 10, err
    assert lines[0] == "train uls: 10/95 step loss 1.000" and lines[-1].startswith("train uls: 95/95")
    with progress.bar(100, "tokenizing", "rec") as b:  # a short phase: nothing (its summary line says it)
        b.update(100)
    with progress.bar(100, "train", "step", initial=97, lines=10) as b:  # resumed near the end
        b.update(3)
    assert capsys.readouterr().err.splitlines() == ["train: 100/100 step"]
    with progress.shown(False), progress.bar(100, "train", "step", lines=10) as b:  # --no-progress
        b.update(100)
    assert capsys.readouterr().err == ""


def test_userdp_train_logs_plain_lines_off_a_terminal(tmp_path, capsys):
    cfg = _tiny_config(tmp_path, "training:\n  steps: 20\n")
    assert main(["train", str(cfg), "--output", str(tmp_path / "run")]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err and "\x1b[" not in err  # no bar frames, no cursor moves
    lines = err.splitlines()
    train = [x for x in lines if x.startswith("train uls: ")]
    assert 1 <= len(train) <= 10 and train[-1].startswith("train uls: 20/20 step")
    pre = [x for x in lines if x.startswith("pretrain")]
    assert len(pre) <= 12
    assert len(lines) < 60, err  # a few lines per phase, not one per frame
    assert any(x.startswith("privacy: sigma") for x in lines)  # the key line stands on its own
