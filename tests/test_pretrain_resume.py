"""Pretraining checkpoints and resumes like training does (issue 28, 1): a pretraining stopped
part-way continues from its last checkpoint, bit for bit what an uninterrupted one computes, and
says how long it will take."""

import torch

from userdp.data.tokenize import PublicText, train_bpe
from userdp.lm.pretrain import pretrain_model

TEXTS = [f"public document number {i} about the sea and the ships and the sailors" for i in range(200)]


def _tok():
    return train_bpe(PublicText(TEXTS, description="test"), 300)


class _Stop(Exception):
    pass


def test_an_interrupted_pretraining_continues_from_its_checkpoint_bit_for_bit(tmp_path):
    tok = _tok()
    kw = dict(preset="tiny", seq_len=16, steps=12, batch_size=4, lr=3e-3, warmup=2, seed=3, progress=False)
    ref, _ = pretrain_model(TEXTS, tok, **kw)

    state = tmp_path / "state.pt"
    said = []

    def stop_at_8(step, loss):
        if step == 7:
            raise _Stop

    try:
        pretrain_model(TEXTS, tok, **kw, state_path=state, say=said.append, log=stop_at_8, every=5)
    except _Stop:
        pass
    assert state.is_file()  # the checkpoint of step 5 (every=5 below) survived the stop at step 8
    assert any("about" in s and "steps left" in s for s in said)  # how long, before it is done
    said.clear()
    again, info = pretrain_model(TEXTS, tok, **kw, state_path=state, say=said.append, every=5)
    assert any("continuing from step 5 of 12" in s for s in said), said
    assert not state.exists()  # removed once done
    for (n, a), (_, b) in zip(ref.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), n
    assert info["steps"] == 12
