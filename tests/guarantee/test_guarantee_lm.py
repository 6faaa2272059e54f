"""Issue 9, the LM job, the CLI and the report: each test failed on the 0.1 code.

Items: 4 (shuffle headline), 5 (privacy.json's event = the ledger), 6 (plan -> train carries the
plan), 7 (seeded runs say so), 8 (counts treated as public), 9 (wrappers delegate), 11 (run
directory integrity), 12 (resume before the first checkpoint), 13 (a checkpoint is one unit),
14 (caches keyed by content).
"""

import errno
import json
import os

import numpy as np
import pytest
import torch
import yaml

from userdp import accounting
from userdp import accounting as A
from userdp.cli import main as cli
from userdp.engine import checkpoint as ckpt
from userdp.engine.journal import JOURNAL
from userdp.engine.user_data import TensorUserData

from _lm_corpus import write_tiny_run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("guarantee_lm")
    cfg, data = write_tiny_run(tmp, "  checkpoint_every: 1\n")
    return tmp, cfg, data


@pytest.fixture
def tiny(files, tmp_path, monkeypatch):
    shared, cfg, data = files
    monkeypatch.setenv("USERDP_CACHE", str(shared / "cache"))
    return tmp_path, cfg, data


def _train(args, capsys):
    rc = cli(["train", *args, "--no-progress", "--json"])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _one_error_line(err: str):
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert "Traceback" not in err
    assert lines and lines[-1].startswith("userdp: error:"), err
    return lines[-1]


# ------------------------------------------------------------------------------ item 4
def test_shuffle_headline_is_the_guarantee_without_amplification(tiny, capsys):
    tmp, cfg, _ = tiny
    out = tmp / "run"
    rc, stdout, _ = _train([str(cfg), "--output", str(out), "--set", "privacy.sampler=shuffle"], capsys)
    assert rc == 0
    s = json.loads(stdout.strip().splitlines()[-1])
    priv = json.loads((out / "privacy.json").read_text())
    assert s["epsilon_total"] == priv["epsilon"] == priv["epsilon_no_amplification"] == priv["epsilon_total"]
    assert priv["epsilon_assuming_poisson"] < priv["epsilon"]
    assert priv["epsilon"] <= 8.0  # the budget holds for the guarantee actually stated
    assert "WITHOUT amplification" in stdout
    assert cli(["report", str(out)]) == 0
    md = (out / "report.md").read_text()
    head = md.split("## 1.")[0]
    assert f"{priv['epsilon']:.4g}" in head and "WITHOUT amplification" in head
    assert "comparison only" in head


# ------------------------------------------------------------------------------ items 5, 12
def _interrupt_at(monkeypatch, step, exc=KeyboardInterrupt):
    import userdp.lm.training as F

    real = F._save_weights

    def boom(model, path, s, eps):
        if s == step:
            if exc is KeyboardInterrupt:
                raise KeyboardInterrupt
            raise exc
        real(model, path, s, eps)

    monkeypatch.setattr(F, "_save_weights", boom)
    return real


def test_crash_before_the_first_checkpoint_resumes_with_begun_steps_counted(tiny, capsys, monkeypatch):
    tmp, cfg, _ = tiny
    out = tmp / "run"
    real = _interrupt_at(monkeypatch, 2)
    rc, _, _ = _train([str(cfg), "--output", str(out), "--set", "training.checkpoint_every=2"], capsys)
    assert rc == 130
    assert not ckpt.exists(str(out / "checkpoints"))  # the first checkpoint never committed
    import userdp.lm.training as F

    monkeypatch.setattr(F, "_save_weights", real)
    rc, stdout, err = _train(["--resume", str(out)], capsys)
    assert rc == 0, err
    priv = json.loads((out / "privacy.json").read_text())
    # unseeded: the 2 begun steps cannot be replayed, so they are spent; sigma was calibrated for
    # 4 steps, so only 2 more fit the budget and the run stops there
    assert priv["steps_lost_to_crashes"] == 2 and priv["steps_taken"] == 4 and priv["steps_applied"] == 2
    assert json.loads(stdout.strip().splitlines()[-1])["stopped"] == "budget"
    assert priv["epsilon"] <= 8.0
    # item 5: privacy.json's event composes exactly what the ledger counted
    ev = accounting.event_from_dict(priv["dp_event"])
    assert ev.count == 4
    assert accounting.epsilon(ev, priv["delta"]) == pytest.approx(priv["epsilon"], rel=1e-9)


# ------------------------------------------------------------------------------ item 13
def test_disk_full_during_a_checkpoint_is_one_line_and_leaves_the_previous_unit(tiny, capsys, monkeypatch):
    tmp, cfg, _ = tiny
    out = tmp / "run"
    _interrupt_at(monkeypatch, 3, OSError(errno.ENOSPC, "No space left on device"))
    rc, _, err = _train([str(cfg), "--output", str(out)], capsys)
    assert rc == 2
    line = _one_error_line(err)
    assert "No space left on device" in line and "previous checkpoint is intact" in line
    d = out / "checkpoints"
    manifest = ckpt.verify(str(d))
    from safetensors import safe_open

    with safe_open(str(d / "model.safetensors"), "pt") as f:
        weights_step = int(f.metadata()["step"])
    assert manifest["step"] == ckpt.load(str(d))["step"] == weights_step == 2
    assert json.loads((d / "ledger.json").read_text())["step"] == 2
    assert not list(d.glob(".*.pending"))


# ------------------------------------------------------------------------------ items 6, 7
def test_plan_command_line_carries_the_plan_and_its_dp_median_epsilon(tiny, capsys):
    tmp, cfg, _ = tiny
    plan_file = tmp / "plan.json"
    rc = cli(
        [
            "plan",
            str(cfg),
            "--compute-budget",
            "8",
            "--dp-median-epsilon",
            "0.5",
            "--sample-users",
            "8",
            "--seed",
            "1",
            "--save",
            str(plan_file),
        ]
    )
    stdout = capsys.readouterr().out
    assert rc == 0 and plan_file.is_file()
    assert f"--plan {plan_file}" in stdout and "SEEDED DP median" in stdout
    out = tmp / "run"
    rc, stdout, err = _train([str(cfg), "--plan", str(plan_file), "--output", str(out)], capsys)
    assert rc == 0, err
    s = json.loads(stdout.strip().splitlines()[-1])
    assert s["epsilon_plan"] == 0.5
    # the median is spent through the ledger: inside epsilon, within the target, composed by the accountant
    priv = json.loads((out / "privacy.json").read_text())
    assert s["epsilon_total"] == s["epsilon"] <= priv["epsilon_target"]
    assert f"epsilon = {s['epsilon_total']:.3f}" in stdout and "DP median" in stdout and "included" in stdout
    assert A.has_pure_dp(A.event_from_dict(priv["dp_event"]))
    assert any("plan" in n for n in priv["not_accounted"])
    assert any("SEEDED DP MEDIAN" in a for a in priv["assumptions"])
    # a plan made on other data is refused
    other = json.loads(plan_file.read_text())
    other["data_fingerprint"] = "elsewhere"
    plan_file.write_text(json.dumps(other))
    rc, _, err = _train([str(cfg), "--plan", str(plan_file), "--output", str(tmp / "run2")], capsys)
    assert rc == 2 and "other data" in _one_error_line(err)


def test_seeded_run_says_so_on_the_cli_and_in_the_report(tiny, capsys):
    tmp, cfg, _ = tiny
    out = tmp / "run"
    rc, stdout, _ = _train([str(cfg), "--output", str(out), "--set", "training.seed=5"], capsys)
    assert rc == 0 and "SEEDED" in stdout
    assert cli(["report", str(out)]) == 0
    capsys.readouterr()
    md = (out / "report.md").read_text()
    assert "**Seeded run.**" in md.split("## 1.")[0]


# ------------------------------------------------------------------------------ item 8
def test_counts_treated_as_public_are_listed(tiny, capsys):
    tmp, cfg, _ = tiny
    out = tmp / "run"
    rc, _, _ = _train([str(cfg), "--output", str(out), "--set", "training.algorithm=els"], capsys)
    assert rc == 0
    priv = json.loads((out / "privacy.json").read_text())
    public = [a for a in priv["assumptions"] if a.startswith("treated as public")]
    assert any("number of users N" in a for a in public)
    assert any("|D'|" in a for a in public)
    assert any(str(priv["num_records"]) in a for a in public)
    assert "generator" in " ".join(priv["assumptions"]) and "float32" in " ".join(priv["assumptions"])


# ------------------------------------------------------------------------------ item 9
class _Ranked(TensorUserData):
    """Keeps each user's LAST G records for ELS (a ranked selection stand-in)."""

    def bounded_records(self, group_size, rng):
        users, records = [], []
        for u, n in enumerate(self.sizes()):
            keep = list(range(max(0, n - group_size), n))
            users += [u] * len(keep)
            records += keep
        return np.asarray(users), np.asarray(records)


def test_wrappers_delegate_ranked_selection():
    from userdp.engine.user_data import DelegatingUserData
    from userdp.lm.training import _TokenCounter

    sizes = np.array([5, 1, 7, 3])
    data = _Ranked(
        {"x": torch.arange(16.0), "labels": torch.zeros(16, dtype=torch.long)}, np.concatenate([[0], np.cumsum(sizes)])
    )
    want = data.bounded_records(2, np.random.default_rng(0))
    for wrapped in (DelegatingUserData(data), _TokenCounter(data).wrap()):
        got = wrapped.bounded_records(2, np.random.default_rng(0))
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
        assert wrapped.num_users == 4 and np.array_equal(wrapped.sizes(), sizes)


# ------------------------------------------------------------------------------ item 11
@pytest.fixture
def interrupted(tiny, capsys, monkeypatch):
    """A run interrupted while writing its step-4 checkpoint: checkpoint at 3, journal and metrics at 4."""
    tmp, cfg, data = tiny
    out = tmp / "run"
    real = _interrupt_at(monkeypatch, 4)
    rc, _, _ = _train([str(cfg), "--output", str(out)], capsys)
    assert rc == 130
    import userdp.lm.training as F

    monkeypatch.setattr(F, "_save_weights", real)
    return out


def test_deleted_journal_refuses_resume(interrupted, capsys):
    os.unlink(interrupted / "checkpoints" / JOURNAL)
    rc, _, err = _train(["--resume", str(interrupted)], capsys)
    # refused before any step: by the journal's data binding, or (when the new split moves the count of
    # training users, as a per-user keyed split can) by the checkpoint's config, which counts them
    line = _one_error_line(err)
    assert rc == 2 and ("ledger_journal.jsonl" in line or "cannot resume" in line)


def test_journal_truncated_to_the_checkpoint_refuses_resume(interrupted, capsys):
    j = interrupted / "checkpoints" / JOURNAL
    lines = j.read_text().splitlines(keepends=True)
    j.write_text("".join(lines[:4]))  # header + steps 1-3: looks like nothing was lost
    rc, _, err = _train(["--resume", str(interrupted)], capsys)
    assert rc == 2 and "truncated" in _one_error_line(err)


def test_journal_cut_with_its_head_file_is_caught_by_the_metrics(interrupted, capsys):
    """The journal cut back to the checkpoint AND ledger_head.json rewritten to match (a
    consistent pair): metrics.jsonl's step-4 line still cites line 4 of the chain."""
    ck = interrupted / "checkpoints"
    j = ck / JOURNAL
    lines = j.read_text().splitlines(keepends=True)
    j.write_text("".join(lines[:4]))
    head = json.loads((ck / "ledger_head.json").read_text())
    head.update(lines=3, head=json.loads(lines[3])["hash"])
    (ck / "ledger_head.json").write_text(json.dumps(head))
    rc, _, err = _train(["--resume", str(interrupted)], capsys)
    line = _one_error_line(err)
    assert rc == 2 and "metrics.jsonl (step 4)" in line and "truncated or replaced by an older copy" in line


def test_an_older_copy_of_journal_and_head_is_caught_by_the_metrics(tiny, capsys, monkeypatch):
    """The journal and its head file as they were at the checkpoint (step 3), restored over the
    run interrupted at step 4."""
    import userdp.lm.training as F

    tmp, cfg, _ = tiny
    out = tmp / "run"
    real = F._save_weights
    saved = {}

    def boom(model, path, s, eps):
        if s == 3:
            for name in (JOURNAL, "ledger_head.json"):
                saved[name] = (out / "checkpoints" / name).read_bytes()
        if s == 4:
            raise KeyboardInterrupt
        real(model, path, s, eps)

    monkeypatch.setattr(F, "_save_weights", boom)
    assert _train([str(cfg), "--output", str(out)], capsys)[0] == 130
    monkeypatch.setattr(F, "_save_weights", real)
    for name, raw in saved.items():
        (out / "checkpoints" / name).write_bytes(raw)
    rc, _, err = _train(["--resume", str(out)], capsys)
    assert rc == 2 and "truncated or replaced by an older copy" in _one_error_line(err)


def test_edited_split_seed_refuses_resume_and_evaluate(tiny, interrupted, capsys):
    c = interrupted / "config.yaml"
    conf = yaml.safe_load(c.read_text())
    conf["data"]["split_seed"] = 7
    c.write_text(yaml.safe_dump(conf))
    rc, _, err = _train(["--resume", str(interrupted)], capsys)
    # refused before any step: by the journal's data binding, or (when the new split moves the count of
    # training users, as a per-user keyed split can) by the checkpoint's config, which counts them
    line = _one_error_line(err)
    assert rc == 2 and ("ledger_journal.jsonl" in line or "cannot resume" in line)


def test_evaluate_refuses_a_changed_split(tiny, capsys):
    tmp, cfg, _ = tiny
    out = tmp / "run"
    assert _train([str(cfg), "--output", str(out)], capsys)[0] == 0
    assert cli(["evaluate", str(out), "--set", "data.split_seed=9"]) == 2
    assert "held out" in _one_error_line(capsys.readouterr().err)
    (out / "config.yaml").write_text((out / "config.yaml").read_text().replace("split_seed: 0", "split_seed: 9"))
    assert cli(["evaluate", str(out)]) == 2
    assert "config.yaml" in _one_error_line(capsys.readouterr().err)


def test_flipped_checkpoint_byte_refuses_resume(interrupted, capsys):
    p = interrupted / "checkpoints" / "model.safetensors"
    raw = bytearray(p.read_bytes())
    raw[-5] ^= 0x10
    p.write_bytes(bytes(raw))
    rc, _, err = _train(["--resume", str(interrupted)], capsys)
    assert rc == 2 and "model.safetensors: checksum mismatch" in _one_error_line(err)


def test_report_refuses_an_edited_epsilon_and_damaged_files(tiny, capsys):
    tmp, cfg, _ = tiny
    out = tmp / "run"
    assert _train([str(cfg), "--output", str(out)], capsys)[0] == 0
    p = out / "privacy.json"
    good = p.read_text()
    rec = json.loads(good)
    rec["epsilon"] = rec["epsilon"] / 2
    p.write_text(json.dumps(rec))
    assert cli(["report", str(out)]) == 2
    assert "privacy.json" in _one_error_line(capsys.readouterr().err)
    p.write_text(good[: len(good) // 2])
    assert cli(["report", str(out)]) == 2
    assert "privacy.json" in _one_error_line(capsys.readouterr().err)
    p.write_text(good)
    (out / "state.json").write_text("{not json")
    assert cli(["report", str(out)]) == 2
    assert "state.json" in _one_error_line(capsys.readouterr().err)


def test_report_refuses_files_from_another_run_and_an_event_edited_with_epsilon_recomputed(tiny, capsys):
    """Issue 25 (3): privacy.json or config.yaml copied in from another run of the same config, and
    a DpEvent whose sigma was raised with epsilon recomputed by userdp itself (no hash to forge)."""
    import shutil

    tmp, cfg, _ = tiny
    a, b = tmp / "a", tmp / "b"
    assert _train([str(cfg), "--output", str(a)], capsys)[0] == 0
    assert _train([str(cfg), "--output", str(b), "--set", "training.lr=0.002"], capsys)[0] == 0
    good = (b / "privacy.json").read_bytes()
    shutil.copy(a / "privacy.json", b / "privacy.json")
    assert cli(["report", str(b)]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "privacy.json" in line and "another run" in line
    (b / "privacy.json").write_bytes(good)
    good_cfg = (b / "config.yaml").read_bytes()
    shutil.copy(a / "config.yaml", b / "config.yaml")
    assert cli(["report", str(b)]) == 2
    assert "config.yaml" in _one_error_line(capsys.readouterr().err)
    (b / "config.yaml").write_bytes(good_cfg)
    rec = json.loads(good)
    rec["dp_event"]["event"]["event"]["noise_multiplier"] *= 1.5
    rec["epsilon"] = accounting.epsilon(accounting.event_from_dict(rec["dp_event"]), rec["delta"])
    assert rec["epsilon"] < json.loads(good)["epsilon"]
    (b / "privacy.json").write_text(json.dumps(rec))
    assert cli(["report", str(b)]) == 2
    assert "DpEvent is not the ledger journal's" in _one_error_line(capsys.readouterr().err)
    (b / "privacy.json").write_bytes(good)
    assert cli(["report", str(b)]) == 0


def test_run_files_are_strict_json_and_the_report_tells_what_happened(tiny, capsys):
    """Issue 28 (3): every file follows the --json rule (a non-private run's metrics.jsonl held
    ``Infinity``); the transparency line comes from the record (ghost, not "vmap" for every run);
    ``report --delta D`` gives epsilon at another delta from the verified event; the model folder
    carries a model card with the verified guarantee."""
    tmp, cfg, _ = tiny

    def strict_load(text):
        return json.loads(text, parse_constant=lambda c: (_ for _ in ()).throw(AssertionError(f"not JSON: {c}")))

    out = tmp / "np"
    assert _train([str(cfg), "--output", str(out), "--set", "training.algorithm=nonprivate"], capsys)[0] == 0
    rows = [strict_load(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows and all(r["epsilon"] == "inf" for r in rows)
    assert all(r["clip_norm"] is None for r in rows)  # it clips nothing
    diag = [strict_load(line) for line in (out / "diagnostics.jsonl").read_text().splitlines()]
    assert diag and all(r["fraction_clipped"] is None for r in diag)
    for name in ("privacy.json", "state.json", "eval.json", "report.json"):
        strict_load((out / name).read_text())
    card = (out / "model" / "README.md").read_text()
    assert "No differential-privacy guarantee" in card
    meta = yaml.safe_load(card.split("---")[1])  # a hub search for DP models must not find the baseline
    assert "differential-privacy" not in meta["tags"] and "user-level-differential-privacy" not in meta["tags"]
    assert "non-private-baseline" in meta["tags"] and meta["userdp"]["epsilon_at_delta_1e-6"] is None
    assert "guarantee above" not in (out / "report.md").read_text()  # there is none

    run = tmp / "dp"
    assert _train([str(cfg), "--output", str(run)], capsys)[0] == 0
    priv = json.loads((run / "privacy.json").read_text())
    assert priv["engine_record"]["per_unit"]["strategy"] == "ghost" and "ghost clipping" in priv["transparency"]
    assert "vmap" not in priv["transparency"]
    assert cli(["report", str(run), "--delta", "0.05", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    want = accounting.epsilon(accounting.event_from_dict(priv["dp_event"]), 0.05)
    assert rep["at_delta"]["delta"] == 0.05 and rep["at_delta"]["epsilon"] == pytest.approx(want, rel=1e-9)
    assert priv["delta"] < 0.05 and want < priv["epsilon"]  # a larger delta, a smaller epsilon
    assert cli(["report", str(run), "--delta", "2"]) == 2
    assert "--delta" in _one_error_line(capsys.readouterr().err)
    card = (run / "model" / "README.md").read_text()
    meta = yaml.safe_load(card.split("---")[1])
    assert meta["userdp"]["epsilon"] == pytest.approx(priv["epsilon_total"]) and meta["userdp"]["unit"] == "user"
    assert "differential-privacy" in meta["tags"] and "userdp report" in card
    # epsilon at delta = 1e-6 beside the run's own (issue 39): re-derived from the event, larger (smaller delta)
    at6 = accounting.epsilon(accounting.event_from_dict(priv["dp_event"]), 1e-6)
    assert priv["delta"] > 1e-6 and at6 > priv["epsilon"]
    assert meta["userdp"]["epsilon_at_delta_1e-6"] == pytest.approx(at6, rel=1e-9)
    assert f"At delta = 1e-06, the same training satisfies epsilon = {at6:.4g}" in card
    report = (run / "report.md").read_text()
    assert f"**At delta = 1e-06:** epsilon = {at6:.4g}" in report
    assert "/N for N = " in report and "well below" not in report  # delta stated neutrally
    assert all(n in card for n in priv["not_accounted"])
    assert cli(["evaluate", str(run)]) == 0  # the card is derived: not in the model's manifest


# ------------------------------------------------------------------------------ item 14
def test_data_cache_is_keyed_by_content_not_size_and_mtime(tiny):
    from userdp.lm import config as C
    from userdp.lm.prepare import prepare_data

    tmp, cfg, data = tiny
    path = tmp / "users.jsonl"
    rows = [json.dumps({"user": f"u{i % 7}", "text": f"record {i:03d} alpha"}) for i in range(40)]
    path.write_text("\n".join(rows) + "\n")
    st = path.stat()
    c = C.load_config(str(cfg), [f"data.path={path}"])
    first = prepare_data(c.data, log=lambda m: None)
    # same size, same mtime, other content (other users)
    other = [json.dumps({"user": f"v{i % 7}", "text": f"record {i:03d} alpha"}) for i in range(40)]
    path.write_text("\n".join(other) + "\n")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns
    second = prepare_data(c.data, log=lambda m: None)
    assert second.store.fingerprint != first.store.fingerprint
    assert second.data_fingerprint != first.data_fingerprint
