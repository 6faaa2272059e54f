"""Pretraining checkpoints and resumes like training does (issue 28, 1): a pretraining stopped
part-way continues from its last checkpoint, bit for bit what an uninterrupted one computes, and
says how long it will take."""

import pytest
import torch
from _paths import TESTS

from userdp.data.tokenize import PublicText, train_bpe
from userdp.lm.pretrain import PretrainSpec, Reporting, pretrain_model

TEXTS = [f"public document number {i} about the sea and the ships and the sailors" for i in range(200)]


def _tok():
    return train_bpe(PublicText(TEXTS, description="test"), 300)


class _Stop(Exception):
    pass


def test_an_interrupted_pretraining_continues_from_its_checkpoint_bit_for_bit(tmp_path):
    tok = _tok()
    spec = PretrainSpec(preset="tiny", seq_len=16, steps=12, batch_size=4, lr=3e-3, warmup=2, seed=3)
    ref, _ = pretrain_model(TEXTS, tok, spec, report=Reporting(progress=False))

    state = tmp_path / "state.pt"
    said = []

    def stop_at_8(step, loss):
        if step == 7:
            raise _Stop

    try:
        pretrain_model(
            TEXTS,
            tok,
            spec,
            report=Reporting(progress=False, state_path=state, say=said.append, log=stop_at_8, every=5),
        )
    except _Stop:
        pass
    assert state.is_file()  # the checkpoint of step 5 (every=5 below) survived the stop at step 8
    assert any("about" in s and "steps left" in s for s in said)  # how long, before it is done
    said.clear()
    again, info = pretrain_model(
        TEXTS, tok, spec, report=Reporting(progress=False, state_path=state, say=said.append, every=5)
    )
    assert any("continuing from step 5 of 12" in s for s in said), said
    assert not state.exists()  # removed once done
    for (n, a), (_, b) in zip(ref.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    assert info["steps"] == 12


_PRETRAIN_ONE = """
import sys
sys.path.insert(0, {tests!r})
from pathlib import Path
import torch
from _lm_corpus import tiny_config, write_tiny_corpus
from userdp.lm import config as C, prepare as F
from userdp.lm.starting_model import get_tokenizer_and_model
folder = Path(sys.argv[1])
folder.mkdir()
data, public = write_tiny_corpus(folder, seed_cache=False)
(folder / "c.yaml").write_text(tiny_config(data, public).replace("steps: 6", "steps: 60"))
cfg = C.load_config(str(folder / "c.yaml"), [])
prep = F.prepare_data(cfg.data, print)
get_tokenizer_and_model(cfg.tokenizer, cfg.model, prep, print, progress=False, device=torch.device("cpu"))
"""


@pytest.mark.heavy(
    counterpart="tests/lm/test_pretrain.py::test_an_interrupted_pretraining_continues_from_its_checkpoint_bit_for_bit"
)
def test_two_runs_that_need_one_pretrained_model_pretrain_it_once(tmp_path):
    """Two processes started together (two runs, tuning trials) that want the same pretrained model:
    one pretrains it, the other waits for its lock and loads what it saved."""
    import os
    import subprocess
    import sys

    code = _PRETRAIN_ONE.format(tests=str(TESTS))
    env = dict(os.environ, USERDP_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    env.pop("USERDP_TEST_SESSION", None)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path / f"run{i}")],
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert sum("pretrained in" in o for o in outs) == 1, outs  # one pretraining, not two
    other = next(o for o in outs if "pretrained in" not in o)
    assert "another process just saved" in other or "using the cached pretrained model" in other, other
    (entry,) = [p for p in (tmp_path / "cache" / "pretrained").iterdir() if p.is_dir()]
    assert not list((tmp_path / "cache" / "pretrained").glob("*.partial"))
