"""userdp.hf_trl.PrivateSFTTrainer (issue 38): TRL's SFTTrainer made user-level private. TRL prepares
the data (prompt-completion masking, EOS, truncation); the prepared rows, grouped by author, are the
engine's records, and the run is the engine's own-loop run on them. Packing, which would put several
people's text into one sequence, is refused."""

import warnings

import numpy as np
import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL is an optional extra (pip install userdp[trl])")

from _hf_helpers import hf_model  # noqa: E402
from _paths import REPO  # noqa: E402
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, pre_tokenizers  # noqa: E402
from tokenizers import models as tm  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from userdp.engine import ELS, ULS, FlatClip, TrainConfig, make_private  # noqa: E402
from userdp.errors import UserError  # noqa: E402
from userdp.hf import UserRecords  # noqa: E402
from userdp.hf_trl import PrivateSFTTrainer  # noqa: E402
from userdp.lm.models import IGNORE_INDEX, causal_lm_loss  # noqa: E402
from userdp.lm.report import build_report  # noqa: E402

warnings.filterwarnings("ignore", module="transformers")
warnings.filterwarnings("ignore", module="trl")

WORDS = ["the", "sky", "is", "blue", "red", "green", "cat", "dog", "what", "color", "it"]


def _tokenizer():
    vocab = {"<eos>": 0, "<unk>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tk = Tokenizer(tm.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", unk_token="<unk>", pad_token="<eos>")


def _chats(n=72, users=24, seed=0):
    rng = np.random.default_rng(seed)
    thing = rng.choice(["sky", "cat", "dog"], n)
    colour = rng.choice(["blue", "red", "green"], n)
    return Dataset.from_dict(
        {
            "prompt": [f"what color is the {t}" for t in thing],
            "completion": [f" it is {c}" for c in colour],
            "user": [f"u{(i * 5) % users}" for i in range(n)],
        }
    )


def _model():
    return hf_model(vocab_size=16)


def _config(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path / "out"),
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        use_cpu=True,
        optim="sgd",
        learning_rate=0.2,
        lr_scheduler_type="constant",
        disable_tqdm=True,
        max_length=16,
    )
    base.update(kw)
    return trl.SFTConfig(**base)


@pytest.mark.parametrize(
    "algorithm", [ULS(group_size=2, sampling_rate=0.4), ELS(group_size=2, sampling_rate=0.2)], ids=["uls", "els"]
)
def test_an_sft_run_is_the_engines_run_on_the_prepared_records(tmp_path, algorithm):
    """Same seed: PrivateSFTTrainer (with SFTConfig's own defaults: bf16 and gradient checkpointing
    on) and make_private in a plain loop over the rows TRL prepared end with the same parameters and
    epsilon; the prompt tokens carry no loss (completion_only_loss), and the run directory verifies."""
    privacy = TrainConfig(
        algorithm=algorithm, steps=3, clipping=FlatClip(0.5), noise_multiplier=1.0, delta=1e-4, seed=5
    )
    trainer = PrivateSFTTrainer(
        model=_model(),
        args=_config(tmp_path),
        train_dataset=_chats(),
        processing_class=_tokenizer(),
        privacy=privacy,
        user_field="user",
    )
    assert any(n.startswith("SFTConfig.bf16=True set aside") for n in trainer.userdp_notes)
    prepared = trainer.train_dataset
    first = prepared[0]
    assert first["labels"][:5] == [IGNORE_INDEX] * 5 and first["labels"][5:] == first["input_ids"][5:]
    trainer.train()

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    with make_private(model, opt, UserRecords(prepared, "user", pad_token_id=0), causal_lm_loss, privacy) as private:
        for step in private:
            opt.zero_grad()
            step.backward()
            opt.step()
    assert [h["units"] for h in trainer._private.history] == [h["units"] for h in private.history]
    for a, b in zip(trainer.model.parameters(), model.parameters(), strict=True):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=1e-6)
    assert trainer.epsilon() == pytest.approx(private.epsilon(), rel=1e-12) and trainer.epsilon() > 0
    rep = build_report(tmp_path / "out")
    assert rep["epsilon_run"] == pytest.approx(trainer.epsilon(), rel=1e-9) and rep["steps_taken"] == 3


@pytest.mark.parametrize(
    "setting,match",
    [
        (dict(packing=True), r"SFTConfig\.packing=True: packing joins records of different users"),
        (dict(padding_free=True), r"SFTConfig\.padding_free=True"),
        (dict(gradient_accumulation_steps=2), r"TrainingArguments\.gradient_accumulation_steps=2"),
    ],
)
def test_sft_settings_that_would_mix_users_or_break_the_step_are_refused_in_one_line(tmp_path, setting, match):
    privacy = TrainConfig(algorithm=ULS(2, 0.4), steps=2, noise_multiplier=1.0, delta=1e-4)
    with pytest.raises(UserError, match=match) as err:
        PrivateSFTTrainer(
            model=_model(),
            args=_config(tmp_path, **setting),
            train_dataset=_chats(),
            processing_class=_tokenizer(),
            privacy=privacy,
        )
    assert "\n" not in str(err.value)


def test_a_model_name_that_is_not_a_local_folder_is_refused(tmp_path):
    privacy = TrainConfig(algorithm=ULS(2, 0.4), steps=2, noise_multiplier=1.0, delta=1e-4)
    with pytest.raises(UserError, match="not a local folder .*downloads nothing"):
        PrivateSFTTrainer(
            model="Qwen/Qwen3-0.6B",
            args=_config(tmp_path),
            train_dataset=_chats(),
            processing_class=_tokenizer(),
            privacy=privacy,
        )


@pytest.mark.slow
def test_the_trl_example_runs_as_docs_hf_md_shows(tmp_path, capsys, monkeypatch):
    """examples/trl_sft.py as docs/hf.md runs it (in this process: the imports are already paid)."""
    import json
    import runpy
    import sys

    examples = REPO / "examples"
    monkeypatch.syspath_prepend(str(examples))  # as `python examples/trl_sft.py` puts its folder first
    monkeypatch.setattr(sys, "argv", [str(examples / "trl_sft.py"), "--steps", "3", "--output", str(tmp_path / "out")])
    runpy.run_path(str(examples / "trl_sft.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "over 3 steps (completed)" in out
    eps = float(out.split("user-level (")[1].split(",")[0])
    assert 0 < eps <= 3.0
    rec = json.loads((tmp_path / "out" / "privacy.json").read_text())
    assert rec["steps_taken"] == 3 and any("bf16" in n for n in rec["userdp_notes"])
    assert build_report(tmp_path / "out")["epsilon_run"] == pytest.approx(eps, abs=5e-4)


def test_a_conversational_dataset_needs_a_chat_template_and_says_so_in_one_line(tmp_path):
    conv = Dataset.from_dict(
        {
            "messages": [
                [{"role": "user", "content": "what color is the sky"}, {"role": "assistant", "content": "it is blue"}]
            ]
            * 24,
            "user": [f"u{i % 8}" for i in range(24)],
        }
    )
    privacy = TrainConfig(
        algorithm=ULS(group_size=2, sampling_rate=0.4),
        steps=2,
        clipping=FlatClip(0.5),
        noise_multiplier=1.0,
        delta=1e-4,
    )
    with pytest.raises(UserError, match="conversational.*no chat template") as exc:
        PrivateSFTTrainer(
            model=_model(),
            args=_config(tmp_path),
            train_dataset=conv,
            processing_class=_tokenizer(),
            privacy=privacy,
            user_field="user",
        )
    assert "\n" not in str(exc.value)


def test_prompts_longer_than_max_length_are_counted_or_refused_never_trained_on_silently(tmp_path):
    """TRL drops examples left with nothing to learn (a prompt longer than max_length truncates the
    completion away): the drop is counted in userdp_notes; when every example goes, one line."""
    privacy = TrainConfig(
        algorithm=ULS(group_size=2, sampling_rate=0.4),
        steps=2,
        clipping=FlatClip(0.5),
        noise_multiplier=1.0,
        delta=1e-4,
    )
    ds = _chats()
    long = ds.map(
        lambda r, i: {"prompt": r["prompt"] + (" the sky is blue" * 5 if i % 3 == 0 else "")}, with_indices=True
    )
    trainer = PrivateSFTTrainer(
        model=_model(),
        args=_config(tmp_path / "some", max_length=10),
        train_dataset=long,
        processing_class=_tokenizer(),
        privacy=privacy,
        user_field="user",
    )
    assert any("TRL dropped 24 of 72 examples" in n for n in trainer.userdp_notes), trainer.userdp_notes
    every = ds.map(lambda r: {"prompt": r["prompt"] + " the sky is blue" * 5})
    with pytest.raises(UserError, match="train_dataset: it holds no rows"):
        PrivateSFTTrainer(
            model=_model(),
            args=_config(tmp_path / "all", max_length=8),
            train_dataset=every,
            processing_class=_tokenizer(),
            privacy=privacy,
            user_field="user",
        )
