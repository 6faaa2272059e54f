"""Every long phase reports progress through one bar helper (userdp.progress), and
`--no-progress` (progress.shown(False)) turns every one of them off."""

import json

import numpy as np
import pytest
import torch

import userdp.progress as P
from userdp.data import build_store, open_source
from userdp.data import tokenize as T
from userdp.data.tokenize import PublicText, tokenize_store, train_bpe

from _engine_helpers import Mean, sq_loss, user_data


class _Recorder:
    made: list = []

    def __init__(self, total=None, desc="", disable=None, **kw):
        self.total, self.desc, self.disable, self.n = total, desc, disable, 0
        _Recorder.made.append(self)

    def update(self, n=1):
        self.n += n

    def close(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.fixture
def bars(monkeypatch):
    _Recorder.made = []
    monkeypatch.setattr(P, "tqdm", _Recorder)
    monkeypatch.setattr(P, "_terminal", lambda: True)  # the bars as a terminal gets them (off one: test_progress_lines)
    return _Recorder.made


def _store(tmp_path, n=300):
    rng = np.random.default_rng(0)
    rows = [{"user": f"u{rng.integers(0, 20)}", "text": "a b c " * int(rng.integers(1, 9))} for _ in range(n)]
    p = tmp_path / "a.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return build_store(open_source(str(p)), tmp_path / "s", batch_size=64).store


def test_reading_tokenizing_planning_and_evaluating_each_count_their_whole_work(tmp_path, bars, monkeypatch):
    store = _store(tmp_path)
    (reading,) = [b for b in bars if b.desc == "reading records"]
    assert reading.n == 300 and reading.disable is None  # None: tqdm shows it on a terminal only
    tok = train_bpe(PublicText(["a b c d e"] * 20, description="t"), vocab_size=270, min_frequency=1)
    monkeypatch.setattr(T, "ENCODE_BLOCK", 50)  # several blocks of records: the bar counts them all
    tokenize_store(store, tok, 16, cache_dir=tmp_path / "tok")
    (tokenizing,) = [b for b in bars if b.desc == "tokenizing"]
    assert tokenizing.total == tokenizing.n == store.num_records

    from userdp.planning import GradientNormEstimator, NormSample

    est = GradientNormEstimator(
        Mean(3), user_data([4] * 40), sq_loss, NormSample(30, chunk_size=8), rng=np.random.default_rng(0)
    )
    est(2)
    (planning,) = [b for b in bars if b.desc.startswith("planning: L(G = 2)")]
    assert planning.total == planning.n == 30

    from userdp.lm.evaluate import record_nll

    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(7))

        def forward(self, input_ids, labels=None, **kw):
            return type("Out", (), {"logits": self.w.expand(*input_ids.shape, 7)})()

    class Data:
        num_users = 1

        def sizes(self):
            return np.array([70])

        def gather(self, users, records):
            n = len(users)
            return {"input_ids": torch.ones(n, 5, dtype=torch.long), "labels": torch.ones(n, 5, dtype=torch.long)}

    from userdp.lm.evaluate import evaluate_lm

    made = len(bars)
    nll, cnt = record_nll(LM(), Data(), np.zeros(70, np.int64), np.arange(70), batch_size=16)
    assert len(bars) == made and len(nll) == 70  # the per-user calls (personalization, audit) show none
    evaluate_lm(LM(), Data(), batch_size=16)
    (evaluating,) = [b for b in bars if b.desc == "evaluating"]
    assert evaluating.total == evaluating.n == 70


def test_no_progress_turns_every_bar_off_and_the_setting_is_scoped(tmp_path, bars):
    with P.shown(False):
        _store(tmp_path)
        assert not P.enabled()
    assert P.enabled()
    assert bars and all(b.disable is True for b in bars)
