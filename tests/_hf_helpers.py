"""A tiny Hugging Face setting shared by the Trainer's tests (tests/hf/, tests/guarantee/): a
dataset of token ids with a user column, a one-layer GPT-2 and CPU TrainingArguments."""

import numpy as np
import torch
from datasets import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments


def hf_dataset(n=90, users=30, seed=0, labels=False):
    rng = np.random.default_rng(seed)
    ids = [[int(t) for t in rng.integers(1, 50, rng.integers(3, 9))] for _ in range(n)]
    rows = {"input_ids": ids, "user": [f"u{(i * 7) % users}" for i in range(n)]}
    if labels:  # a prompt of two tokens masked out, as a chat collator would
        rows["labels"] = [[-100, -100] + r[2:] for r in ids]
    return Dataset.from_dict(rows)


def hf_model(vocab_size: int = 64):
    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=vocab_size,
        n_positions=16,
        n_embd=16,
        n_layer=1,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(cfg)


def hf_args(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path / "out") if tmp_path is not None else None,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        use_cpu=True,
        optim="sgd",
        learning_rate=0.2,
        lr_scheduler_type="constant",
        disable_tqdm=True,
    )
    base.update(kw)
    return TrainingArguments(**base)
