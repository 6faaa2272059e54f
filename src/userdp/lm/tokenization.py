"""Thin helpers around a ``tokenizers.Tokenizer`` for the LM jobs (encoding, special ids,
loading a saved tokenizer). Training the byte-level BPE on declared-public text is
``userdp.data``'s job; this module only uses the result."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from userdp.errors import UserError

EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>")
PAD_CANDIDATES = ("<pad>", "<|pad|>")


def as_tokenizers(tok):
    """The underlying ``tokenizers.Tokenizer`` (accepts a transformers fast tokenizer too)."""
    from tokenizers import Tokenizer

    if isinstance(tok, Tokenizer):
        return tok
    inner = getattr(tok, "backend_tokenizer", None) or getattr(tok, "_tokenizer", None)
    if isinstance(inner, Tokenizer):
        return inner
    raise UserError(f"tokenizer: expected a tokenizers.Tokenizer, got {type(tok).__name__}")


def special_ids(tok) -> dict[str, int]:
    t = as_tokenizers(tok)
    vocab = t.get_vocab()
    out = {}
    for key, cands in (("eos", EOS_CANDIDATES), ("pad", PAD_CANDIDATES)):
        for c in cands:
            if c in vocab:
                out[key] = int(vocab[c])
                break
    if "pad" not in out and "eos" in out:
        out["pad"] = out["eos"]
    return out


def encode_texts(tok, texts: Sequence[str]) -> list[list[int]]:
    t = as_tokenizers(tok)
    return [e.ids for e in t.encode_batch(list(texts), add_special_tokens=False)]


def load_tokenizer(path: str | Path):
    """A saved tokenizer: a ``tokenizer.json`` file or a folder holding one."""
    from tokenizers import Tokenizer

    p = Path(path)
    f = p / "tokenizer.json" if p.is_dir() else p
    if not f.is_file():
        raise UserError(f"tokenizer.path: no tokenizer.json at {path}")
    try:
        return Tokenizer.from_file(str(f))
    except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exception
        raise UserError(f"tokenizer.path: cannot read {f}: {exc}") from None
