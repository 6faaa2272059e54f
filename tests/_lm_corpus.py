"""A tiny user-partitioned corpus and a public text, shared by the end-to-end LM tests."""

import json
import random

WORDS = ("the king is dead long live the queen my lord I pray you speak of love and war "
         "to be or not to be that is the question whether tis nobler in the mind").split()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def write_tiny_corpus(folder):
    """40 users with 1-5 short records each (users.jsonl) and 60 public paragraphs (public.txt)."""
    rng = random.Random(0)
    data = folder / "users.jsonl"
    with open(data, "w") as f:
        for u in range(40):
            for _ in range(1 + u % 5):
                f.write(json.dumps({"user": f"u{u}", "text": words(rng, rng.randint(3, 14))}) + "\n")
    public = folder / "public.txt"
    public.write_text("\n\n".join(words(rng, 20) for _ in range(60)))
    return data, public


def tiny_config(data, public, training_extra: str = "", privacy_extra: str = "", tail: str = "") -> str:
    """The tiny ULS training config the end-to-end tests share. ``training_extra`` and
    ``privacy_extra``: more keys of those sections, one per line, indented by two spaces;
    ``tail``: more top-level sections."""
    return f"""
data:
  source: jsonl
  path: {data}
  public_path: {public}
  heldout_users: 0.2
tokenizer:
  vocab_size: 300
  seq_len: 16
model:
  preset: tiny
  pretraining:
    steps: 6
    batch_size: 8
privacy:
  epsilon: 8.0
{privacy_extra}training:
  algorithm: uls
  steps: 4
  cohort_size: 8
  group_size: 2
  lr: 0.001
{training_extra}{tail}"""


def write_tiny_run(folder, training_extra: str = "", name: str = "tiny.yaml", **config_kw):
    """The tiny corpus and a config over it in ``folder``; returns (config path, data path).
    ``training_extra`` and ``config_kw`` (privacy_extra, tail) go to :func:`tiny_config`."""
    data, public = write_tiny_corpus(folder)
    cfg = folder / name
    cfg.write_text(tiny_config(data, public, training_extra, **config_kw))
    return cfg, data


def interrupt_after_checkpoint(monkeypatch, step: int, where: str = ""):
    """Make `userdp train` stop like Ctrl-C right after it saves the weights of ``step`` (in a
    run whose checkpoint path contains ``where``). Returns the real saver, to restore it."""
    import userdp.lm.training as F

    real = F._save_weights

    def boom(model, path, s, eps):
        real(model, path, s, eps)
        if s == step and where in str(path):
            raise KeyboardInterrupt

    monkeypatch.setattr(F, "_save_weights", boom)
    return real
