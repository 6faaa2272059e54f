"""A tiny user-partitioned corpus and a public text, shared by the end-to-end LM tests, and the
tiny model pretrained on that text once per test session (:func:`seed_pretrained`)."""

import fcntl
import json
import os
import random
import shutil
from pathlib import Path

WORDS = [
    "the",
    "king",
    "is",
    "dead",
    "long",
    "live",
    "the",
    "queen",
    "my",
    "lord",
    "I",
    "pray",
    "you",
    "speak",
    "of",
    "love",
    "and",
    "war",
    "to",
    "be",
    "or",
    "not",
    "to",
    "be",
    "that",
    "is",
    "the",
    "question",
    "whether",
    "tis",
    "nobler",
    "in",
    "the",
    "mind",
]


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def write_tiny_corpus(folder, seed_cache: bool = True):
    """40 users with 1-5 short records each (users.jsonl) and 60 public paragraphs (public.txt).
    ``seed_cache``: ``folder/cache`` (where the tests point USERDP_CACHE) starts with the session's
    pretrained tiny model (:func:`seed_pretrained`)."""
    if seed_cache:
        seed_pretrained(Path(folder) / "cache")
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


#: set by conftest.py's pytest_configure: a folder of the whole test session (every xdist worker)
SESSION_ENV = "USERDP_TEST_SESSION"


def _session_pretrained() -> Path | None:
    """``pretrained/`` of a cache in which the tiny corpus's model (tiny_config's tokenizer and
    pretraining) was pretrained: built once per test session by the first worker that asks, under a
    lock, so that a dozen end-to-end modules do not each pretrain the same model. None outside a
    pytest session."""
    root = os.environ.get(SESSION_ENV)
    if not root:
        return None
    root = Path(root)
    done = root / "tiny-pretrained"
    if done.is_dir():
        return done
    with open(root / "tiny-pretrained.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.is_dir():
            _pretrain_tiny(root / f"tiny-build-{os.getpid()}", done)
    return done


def _pretrain_tiny(build: Path, done: Path) -> None:
    import torch

    from userdp.lm import config as C
    from userdp.lm import prepare as F
    from userdp.lm.starting_model import get_tokenizer_and_model

    build.mkdir(parents=True)
    data, public = write_tiny_corpus(build, seed_cache=False)
    cfg_path = build / "tiny.yaml"
    cfg_path.write_text(tiny_config(data, public))
    before = os.environ.get("USERDP_CACHE")
    os.environ["USERDP_CACHE"] = str(build / "cache")
    try:
        cfg = C.load_config(str(cfg_path), [])
        prep = F.prepare_data(cfg.data, lambda m: None)
        get_tokenizer_and_model(
            cfg.tokenizer, cfg.model, prep, lambda m: None, progress=False, device=torch.device("cpu")
        )
    finally:
        if before is None:
            os.environ.pop("USERDP_CACHE")
        else:
            os.environ["USERDP_CACHE"] = before
    os.rename(build / "cache" / "pretrained", done)
    shutil.rmtree(build)


def seed_pretrained(cache: Path) -> None:
    """Copy the session's pretrained tiny model into ``cache/pretrained`` (a no-op outside pytest):
    a run with tiny_config's settings then loads it instead of pretraining its own. A copy, not a
    link: tests may damage or clear their cache."""
    src = _session_pretrained()
    if src is not None:
        shutil.copytree(src, Path(cache) / "pretrained", dirs_exist_ok=True)
