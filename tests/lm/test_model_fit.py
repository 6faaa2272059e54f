"""The real-model path (issue 39): a local folder laid out as a Hugging Face hub download —
written by transformers' own ``save_pretrained`` (weights, config, tokenizer files with a chat
template) — of each family a user brings (GPT-2, Qwen2, Llama), fine-tuned with LoRA through
``userdp train``: the private text is tokenized with the model's own tokenizer, LoRA finds each
family's attention projections, and the released folder reloads as the same family with the
base's tokenizer and chat template."""

import json
from pathlib import Path

import pytest

from userdp.cli import main

from _fuzz_cases import _tiny_config  # noqa: E402

TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|endoftext|>{% endfor %}"


def _hub_folder(folder: Path, family: str) -> Path:
    """A tiny random-weight model of ``family`` and a BPE tokenizer with a chat template, saved
    by transformers as a hub download lays them out."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    text = ["the commit fixes the parser and the tests " * 4, "add docs for the cli and the config " * 4] * 20
    bpe.train_from_iterator(
        text,
        trainers.BpeTrainer(
            vocab_size=320,
            special_tokens=["<|endoftext|>", "<pad>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<pad>")
    tok.chat_template = TEMPLATE
    v = len(tok)
    torch.manual_seed(0)
    if family == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=v, n_embd=32, n_layer=2, n_head=4, n_positions=64))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(
            Qwen2Config(
                vocab_size=v,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=64,
            )
        )
    else:
        model = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=v,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=64,
                tie_word_embeddings=False,
            )
        )
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    "family,cls,targets",
    [
        ("gpt2", "GPT2LMHeadModel", ["c_attn"]),
        ("qwen2", "Qwen2ForCausalLM", ["q_proj", "v_proj"]),
        ("llama", "LlamaForCausalLM", ["q_proj", "v_proj"]),
    ],
)
def test_a_hub_layout_folder_fine_tunes_with_lora_and_releases_its_tokenizer(tmp_path, capsys, family, cls, targets):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from userdp.data.tokenize import load_tokenizer, tokenizer_fingerprint

    base = _hub_folder(tmp_path / family, family)
    assert (base / "config.json").is_file() and (base / "tokenizer_config.json").is_file()
    cfg = _tiny_config(
        tmp_path,
        f"model:\n  path: {base}\n  lora:\n    enabled: true\n    rank: 2\n"
        "tokenizer:\n  declared_public: true\noutput:\n  cache: run\n",
    )
    run = tmp_path / "run"
    assert main(["train", str(cfg), "--output", str(run), "--set", "model.preset=null", "--no-progress"]) == 0, (
        capsys.readouterr().err
    )
    priv = json.loads((run / "privacy.json").read_text())
    assert priv["private"] and priv["epsilon"] > 0
    # the private text was tokenized with the model's own tokenizer
    metas = [json.loads(p.read_text()) for p in (run / "cache" / "tokenized").glob("*/meta.json")]
    assert metas and {m["tokenizer"] for m in metas} == {tokenizer_fingerprint(load_tokenizer(base))}
    # LoRA found this family's attention projections; the release reloads as the same family
    reloaded = AutoModelForCausalLM.from_pretrained(run / "model", local_files_only=True)
    original = AutoModelForCausalLM.from_pretrained(base, local_files_only=True)
    assert type(reloaded).__name__ == cls
    before = dict(original.named_parameters())
    changed = [n for n, p in reloaded.named_parameters() if not (p.detach() == before[n].detach()).all()]
    assert changed and all(any(f".{t}." in n for t in targets) for n in changed), changed  # LoRA merged there only
    released = AutoTokenizer.from_pretrained(run / "model", local_files_only=True)
    assert released.chat_template == TEMPLATE and released.eos_token == "<|endoftext|>"
    for f in ("tokenizer.json", "tokenizer_config.json"):  # byte for byte, as the base has them
        assert (run / "model" / f).read_bytes() == (base / f).read_bytes()


def _mismatched(folder: Path, kind: str) -> Path:
    """A gpt2 hub folder made not to fit its tokenizer in one of the ways users meet."""
    import shutil

    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    base = _hub_folder(folder, "gpt2")
    tok = AutoTokenizer.from_pretrained(base, local_files_only=True)
    if kind == "a vocabulary smaller than the tokenizer's":
        GPT2LMHeadModel(
            GPT2Config(vocab_size=len(tok) - 20, n_embd=32, n_layer=1, n_head=4, n_positions=64)
        ).save_pretrained(base)
    elif kind == "an added special token past the vocabulary":
        tok.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|assistant|>"]})
        tok.save_pretrained(base)  # the model was not resized
    elif kind == "positions below tokenizer.seq_len":
        GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=4, n_positions=8)).save_pretrained(
            base
        )
    elif kind == "no tokenizer.json":
        (base / "tokenizer.json").unlink()
    else:
        shutil.rmtree(base)
    return base


@pytest.mark.parametrize(
    "kind, needle",
    [
        ("a vocabulary smaller than the tokenizer's", "embedding rows"),
        ("an added special token past the vocabulary", "embedding rows"),
        ("positions below tokenizer.seq_len", "tokenizer.seq_len 16 is longer than the 8 positions"),
        ("no tokenizer.json", "holds no tokenizer.json"),
    ],
)
def test_a_model_folder_that_does_not_fit_its_tokenizer_is_one_line_before_the_data_is_read(
    tmp_path, capsys, kind, needle
):
    """The model against its tokenizer and the sequence length, from config.json and tokenizer.json
    when the job starts: one line naming the folder and the two numbers, not torch's IndexError
    after the data was read and tokenized."""
    import userdp.lm.finetune as F

    base = _mismatched(tmp_path / "m", kind)
    cfg = _tiny_config(tmp_path, f"model:\n  path: {base}\ntokenizer:\n  declared_public: true\n")
    read = []
    real = F.prepare_data
    F.prepare_data = lambda *a, **k: read.append(1) or real(*a, **k)
    try:
        rc = main(["train", str(cfg), "--output", str(tmp_path / "run"), "--set", "model.preset=null", "--no-progress"])
    finally:
        F.prepare_data = real
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and needle in err[-1] and "Traceback" not in "\n".join(err), err[-3:]
    assert str(base) in err[-1] or "tokenizer.seq_len" in err[-1]
    assert read == []  # refused before any data was read
